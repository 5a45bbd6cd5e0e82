"""Inference: vLLM's OpenAI server started with the right flags plus Slipstream's weight-transfer engine (vLLM plugin)."""
