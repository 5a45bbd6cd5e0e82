"""Qwen3.5-MoE model arguments, read from a transformers `Qwen3_5MoeTextConfig` (or the text part of a
`Qwen3_5MoeConfig`), with the checks of what is not modelled."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class Qwen35MoeArgs(TransformerArgs):
    """Layers of two kinds (`layer_types`): Gated DeltaNet linear attention (`linear_num_key_heads` query/key heads of
    `linear_key_head_dim`, `linear_num_value_heads` value heads of `linear_value_head_dim`, a causal depthwise conv of
    `linear_conv_kernel_dim` taps, the gated delta rule, a gated RMSNorm) or gated full attention (GQA whose
    `q_proj` also yields a per-head output gate, zero-centred q/k RMSNorm, partial RoPE: Qwen3.5 rotates 1/4 of
    `head_dim`). Every layer's MLP is an MoE of `num_experts` softmax-routed experts (top `num_experts_per_tok`,
    weights renormalised) plus a shared SwiGLU of `shared_expert_intermediate_size` scaled by
    sigmoid(`shared_expert_gate`(x)). All RMSNorms but the gated one are zero-centred (weight + 1).

    `intermediate_size` is unused (no dense MLP layer); it holds `moe_intermediate_size`.

    Not modelled: multimodal RoPE (text positions only: with text, transformers' three position rows are equal and
    mRoPE is plain RoPE), the vision encoder (`qwen3_5_moe` checkpoints: use impl='hf'), multi-token-prediction weights
    (`mtp.*`, dropped on import), context parallelism (model.py says why)."""

    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int
    """E: routed experts."""
    num_experts_per_tok: int
    """A: experts each token is routed to."""
    moe_intermediate_size: int
    """F of one routed expert."""
    shared_expert_intermediate_size: int
    router_aux_loss_coef: float
    """From the config, for a trainer that chooses to add the aux loss; the model never adds it."""
    norm_topk_prob: bool = True
    """transformers' Qwen3.5-MoE router always renormalises the top-A weights."""

    def is_linear_layer(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Qwen35MoeArgs":
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        _check_qwen3_5_moe_supported(cfg)
        fields = transformer_fields_from_hf(
            cfg,
            qk_norm=True,
            allow_partial_rotary=True,
            family="qwen3_5_moe",
            layer_types=LAYER_TYPES,
            intermediate_size=cfg.moe_intermediate_size,
            mlp_bias=False,
        )
        return cls(
            **fields,
            layer_types=tuple(cfg.layer_types),
            linear_conv_kernel_dim=cfg.linear_conv_kernel_dim,
            linear_key_head_dim=cfg.linear_key_head_dim,
            linear_value_head_dim=cfg.linear_value_head_dim,
            linear_num_key_heads=cfg.linear_num_key_heads,
            linear_num_value_heads=cfg.linear_num_value_heads,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
        )


def _check_qwen3_5_moe_supported(cfg: Any) -> None:
    """Reject Qwen3.5-MoE config features the custom model does not compute as the checkpoint means (the shared
    checks, layer types included, follow in `transformer_fields_from_hf`)."""
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads != 0:
        raise ValueError(
            f"qwen3_5_moe: linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({cfg.linear_num_key_heads})"
        )
    if getattr(cfg, "head_dim", None) is None:
        raise ValueError("qwen3_5_moe: the config must set head_dim")
