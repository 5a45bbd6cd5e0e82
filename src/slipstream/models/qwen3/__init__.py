"""Qwen3 dense family: plain nn.Module with per-head q/k RMSNorm, args from the HF config, HF weight adapter."""
