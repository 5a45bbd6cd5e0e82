"""Laguna (Poolside) model arguments, read from a transformers `LagunaConfig` (with the checks of what is not
modelled)."""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from slipstream.models.common.args import TransformerArgs, check_supported, transformer_fields_from_hf
from slipstream.models.common.rope import RopeArgs, rope_args_from_hf

LAYER_TYPES = ("sliding_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")


@dataclass(frozen=True, kw_only=True)
class LagunaArgs(TransformerArgs):
    """GQA attention with per-head q/k RMSNorm (`qk_norm` always on), RoPE on every layer with parameters per layer
    type (`rope` for "full_attention" layers, `sliding_rope` for "sliding_attention" ones: the checkpoints rotate half
    of each head with theta 500k on full layers and all of it with theta 10k on sliding ones), a sliding window of
    `sliding_window` tokens on the sliding layers, a per-layer query head count (`num_heads_per_layer`), and the heads'
    output times softplus(`g_proj(x)`) before `o_proj`: one gate per head, or per head dim with `gate_per_head`
    False. Pre-norm blocks (Llama's). Layers marked "dense" in `mlp_layer_types` have a dense SwiGLU of
    `intermediate_size`; "sparse" ones an MoE of `num_experts` SwiGLU experts of `moe_intermediate_size` (float32
    logits, tanh-softcapped when `router_logit_softcapping` > 0, sigmoid scores, top-A on `scores +
    e_score_correction_bias`, gates the chosen scores renormalised then times `routed_scaling_factor`) plus a shared
    SwiGLU of `shared_expert_intermediate_size`.

    Not modelled, rejected by `from_hf_config`: an activation other than silu, `moe_apply_router_weight_on_input`
    (transformers refuses it too), `gating` other than True / "per-head" / "per-element" (transformers reads False as
    per-element gating), RoPE types other than common/rope.py's. Ignored: attention dropout (training here runs
    without it)."""

    num_heads_per_layer: tuple[int, ...]
    """H of each layer (`num_attention_heads_per_layer`); `num_heads` is the config's default."""
    layer_types: tuple[str, ...]
    """Per layer: "sliding_attention" or "full_attention"."""
    sliding_window: int
    sliding_rope: RopeArgs
    """RoPE of the sliding layers (`rope` is the full layers')."""
    gate_per_head: bool
    """One softplus gate per head (`gating` True or "per-head"), else one per head dim ("per-element")."""
    mlp_layer_types: tuple[str, ...]
    """Per layer: "dense" or "sparse"."""
    num_experts: int
    """E: routed experts."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    moe_intermediate_size: int
    """F of one routed expert."""
    shared_expert_intermediate_size: int
    routed_scaling_factor: float
    """`moe_routed_scaling_factor`: multiplies the routed experts' sum (not the shared expert)."""
    router_logit_softcapping: float
    """c > 0: router logits become c * tanh(logits / c) before the sigmoid; 0: unchanged."""
    router_aux_loss_coef: float
    """From the config, for a trainer that chooses to add the aux loss; the model never adds it."""

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "LagunaArgs":
        _check_laguna_supported(cfg)
        full_rope, sliding_rope = _ropes_from_hf(cfg)
        fields = transformer_fields_from_hf(
            cfg, qk_norm=True, family="laguna", layer_types=LAYER_TYPES, mlp_bias=False, rope=full_rope
        )
        return cls(
            **fields,
            num_heads_per_layer=tuple(_heads_per_layer(cfg)),
            layer_types=tuple(cfg.layer_types),
            sliding_window=int(cfg.sliding_window or 0),
            sliding_rope=sliding_rope,
            gate_per_head=cfg.gating is True or cfg.gating == "per-head",
            mlp_layer_types=tuple(cfg.mlp_layer_types),
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            routed_scaling_factor=float(cfg.moe_routed_scaling_factor),
            router_logit_softcapping=float(cfg.moe_router_logit_softcapping or 0.0),
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        )


def _heads_per_layer(cfg: Any) -> list[int]:
    return list(cfg.num_attention_heads_per_layer or [cfg.num_attention_heads] * cfg.num_hidden_layers)


def _ropes_from_hf(cfg: Any) -> tuple[RopeArgs, RopeArgs]:
    """(full layers' RoPE, sliding layers' RoPE) from Laguna's `rope_parameters`, keyed by layer type. Every type the
    layers use must be there; a type no layer uses takes the other's (never applied)."""
    params = cfg.rope_parameters or {}
    used = [t for t in LAYER_TYPES if t in cfg.layer_types]
    if any(not isinstance(params.get(t), dict) for t in used):
        raise ValueError(
            f"laguna: rope_parameters must hold RoPE parameters for each layer type the layers use ({used}), "
            f"keyed by type; got {params}"
        )
    ropes = {
        t: rope_args_from_hf(
            SimpleNamespace(rope_parameters=params[t], max_position_embeddings=cfg.max_position_embeddings),
            allow_partial_rotary=True,
            allow_yarn=True,
        )
        for t in used
    }
    return ropes.get("full_attention", ropes[used[0]]), ropes.get("sliding_attention", ropes[used[0]])


def _check_laguna_supported(cfg: Any) -> None:
    """Reject Laguna config features that our model does not compute as transformers does."""
    check_supported(cfg, family="laguna", layer_types=LAYER_TYPES)  # layer types first: the RoPE reading needs them
    if getattr(cfg, "moe_apply_router_weight_on_input", False):
        raise ValueError("laguna: moe_apply_router_weight_on_input = true is not supported (nor by transformers)")
    if not (cfg.gating is True or cfg.gating in ("per-head", "per-element")):
        raise ValueError(
            f"laguna: gating {cfg.gating!r} is not supported; use True, 'per-head' or 'per-element' (transformers "
            "gates per element for any other value, False included: write 'per-element' if that is meant)"
        )
    heads, kv_heads = _heads_per_layer(cfg), getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if len(heads) != cfg.num_hidden_layers or any(h % kv_heads for h in heads):
        raise ValueError(
            f"laguna: num_attention_heads_per_layer {heads} must give, for each of the {cfg.num_hidden_layers} "
            f"layers, a multiple of num_key_value_heads ({kv_heads})"
        )
    mlp_types = list(cfg.mlp_layer_types or [])
    if len(mlp_types) != cfg.num_hidden_layers or set(mlp_types) - set(MLP_LAYER_TYPES):
        raise ValueError(
            f"laguna: mlp_layer_types {mlp_types} must give one of {MLP_LAYER_TYPES} for each of the "
            f"{cfg.num_hidden_layers} layers"
        )
