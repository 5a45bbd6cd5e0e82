"""Inference: vLLM's OpenAI server started with the right flags plus the vLLM plugin registering Slipstream's
weight-transfer engine (slipstream.weights.receive.engine)."""
