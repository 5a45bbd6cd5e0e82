"""Qwen3.5-MoE family (`qwen3_5_moe_text`): a hybrid of Gated DeltaNet linear-attention layers and gated full-attention
layers, every layer an MoE with a gated shared expert; packed rows restart the linear layers' conv and recurrent state
at every sample."""
