"""Llama family (SmolLM2, Llama 2/3): plain nn.Module, args from the HF config, HF weight adapter."""
