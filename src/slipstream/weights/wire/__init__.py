"""What the sender and the receivers agree on: the bucket plan and manifest, pieces and lanes, the shared buffer, the
offer markers and published folders (the map: slipstream/weights/__init__.py). Imports nothing of send/ or receive/."""
