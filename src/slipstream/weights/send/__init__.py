"""The trainer's side of the weight path: the model as a stream of Hugging Face tensors, gathered or sent as each
rank's own rows, published by folder, broadcast or shared memory (the map: slipstream/weights/__init__.py)."""
