"""AFMoE (Arcee Trinity) model arguments, read from a transformers `AfmoeConfig` (with the checks of what is not
modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs
from slipstream.models.common.rope import rope_args_from_hf

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
        _check_afmoe_supported(cfg)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=rope_args_from_hf(cfg),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=False,
            qk_norm=True,
            pad_token_id=getattr(cfg, "pad_token_id", None),
            initializer_range=getattr(cfg, "initializer_range", 0.02),
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


def _check_afmoe_supported(cfg: Any) -> None:
    """Reject AFMoE config features that our model does not compute as transformers does."""
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"afmoe: hidden_act '{cfg.hidden_act}' is not supported (silu only); use impl='hf'")
    layer_types = list(cfg.layer_types or [])
    if len(layer_types) != cfg.num_hidden_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ValueError(
            f"afmoe: layer_types {layer_types} must give one of {LAYER_TYPES} per layer ({cfg.num_hidden_layers})"
        )
    if "sliding_attention" in layer_types and not (cfg.sliding_window or 0) > 0:
        raise ValueError(f"afmoe: sliding layers need sliding_window > 0, got {cfg.sliding_window}")
