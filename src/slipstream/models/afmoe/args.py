"""AFMoE (Arcee Trinity) model arguments, read from a transformers `AfmoeConfig` (with the checks of what is not
modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class AfmoeArgs(TransformerArgs):
    """GQA attention with per-head q/k RMSNorm (`qk_norm` always on) and a sigmoid output gate
    (`o_proj(attn * sigmoid(gate_proj(x)))`); `layer_types[i]` says whether layer i attends within a sliding window
    of `sliding_window` tokens WITH RoPE, or to the whole sample WITHOUT RoPE (transformers applies RoPE on the
    sliding layers only). Every block normalises before and after attention and before and after its MLP. The first
    `num_dense_layers` layers have a dense SwiGLU of `intermediate_size`; the others an MoE of `num_experts` SwiGLU
    experts of `moe_intermediate_size` (sigmoid scores, top-A on `scores + expert_bias`, gates the chosen scores
    renormalised then times `route_scale`: GroupLimitedSigmoidRouter with one group) plus a shared SwiGLU of
    `moe_intermediate_size * num_shared_experts`. With `mup_enabled` the token embeddings are scaled by sqrt(D).

    Not modelled, rejected by `from_hf_config`: an activation other than silu, layer types other than the two above.
    Ignored: attention dropout (training here runs without it)."""

    num_experts: int
    """E: routed experts."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    moe_intermediate_size: int
    """F of one routed expert."""
    num_shared_experts: int
    num_dense_layers: int
    route_scale: float
    layer_types: tuple[str, ...]
    """Per layer: "sliding_attention" (window + RoPE) or "full_attention" (no RoPE)."""
    sliding_window: int
    mup_enabled: bool

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: layers from `num_dense_layers` on are MoE layers."""
        return layer >= self.num_dense_layers

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "AfmoeArgs":
        fields = transformer_fields_from_hf(cfg, qk_norm=True, family="afmoe", layer_types=LAYER_TYPES, mlp_bias=False)
        return cls(
            **fields,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            num_shared_experts=int(cfg.num_shared_experts or 0),
            num_dense_layers=int(cfg.num_dense_layers or 0),
            route_scale=float(cfg.route_scale if cfg.route_scale is not None else 1.0),
            layer_types=tuple(cfg.layer_types),
            sliding_window=int(cfg.sliding_window or 0),
            mup_enabled=bool(getattr(cfg, "mup_enabled", False)),
        )
