"""AFMoE family (`afmoe`: Arcee Trinity): gated attention with per-head q/k RMSNorm, sliding-window layers with RoPE
and full-attention layers without it (NoPE), sandwich norms around attention and MLP, dense-first layers, then an MoE
of sigmoid-routed experts (selection-only `expert_bias`, renormalised and scaled gates) plus a shared expert."""
