"""Model families (plain nn.Modules), model acquisition (cache.py, gguf_import.py: alias registry and GGUF import,
hub.py: Hugging Face Hub ids, resolve.py: `model.name` resolution) and tiny test models."""
