"""Qwen3-MoE family: Qwen3 attention + top-k softmax-routed grouped experts, args from the HF config, HF adapter."""
