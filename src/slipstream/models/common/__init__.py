"""Layers shared by the model families: RMSNorm, RoPE, packed-sequence attention, SwiGLU MLP, grouped-expert MoE,
the decoder-only skeleton, and Hugging Face state-dict key helpers."""
