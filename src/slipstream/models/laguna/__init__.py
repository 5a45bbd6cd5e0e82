"""Laguna family (`laguna`: Poolside): gated attention (softplus gate per head or per head dim) with per-head q/k
RMSNorm, per-layer head counts, sliding-window and full layers with their own RoPE (partial on full layers), dense
or MoE layers per `mlp_layer_types`: sigmoid-routed experts (selection-only bias, optional logit softcap, renormalised
and scaled gates) plus a shared expert."""
