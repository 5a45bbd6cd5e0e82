"""The vLLM workers' side of the weight path: the weight-transfer engine, the receiver, bucket receives and copy plans
(the map: slipstream/weights/__init__.py). Imports wire/ only: never send/, the trainer, parallel/ or models/."""
