"""Inference: vLLM's OpenAI server started with the right flags plus a worker extension that loads weights."""
