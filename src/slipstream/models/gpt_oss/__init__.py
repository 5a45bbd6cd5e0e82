"""GPT-OSS family (`gpt_oss`): GQA attention with biases, learned per-head attention sinks and sliding-window layers
alternating with full ones, YaRN RoPE; every layer an MoE of biased experts with a clamped SwiGLU behind a biased
softmax top-k router."""
