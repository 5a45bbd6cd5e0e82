"""GLM-4.5 MoE model arguments, read from a transformers `Glm4MoeConfig`."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class Glm4MoeArgs(TransformerArgs):
    """GQA attention with partial RoPE (`rope.partial_rotary_factor`, GLM-4.5: 0.5), biases on q/k/v only when
    `attention_bias` (never on o_proj, as transformers), per-head q/k RMSNorm when `qk_norm` (`use_qk_norm`). The first
    `first_k_dense_replace` layers have a dense SwiGLU of `intermediate_size`; the others an MoE of `num_experts`
    routed experts (sigmoid scores, selection-only `e_score_correction_bias`, group-limited top-k) plus a shared
    SwiGLU of `moe_intermediate_size * n_shared_experts` (common/moe_routing.py).

    Not modelled: the multi-token-prediction layers of the checkpoints (`model.layers.{num_layers + i}.*`,
    `num_nextn_predict_layers`): dropped on import, absent on export (vLLM's GLM-4.5 loader skips them too)."""

    num_experts: int
    """E (`n_routed_experts`)."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    moe_intermediate_size: int
    """F of one routed expert."""
    n_shared_experts: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    n_group: int
    """Q: expert groups of the group-limited top-k."""
    topk_group: int
    """Groups a token's experts may come from."""
    routed_scaling_factor: float
    num_mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint holds after the decoder layers (not modelled, see above)."""

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule: layers from `first_k_dense_replace` on are MoE layers."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Glm4MoeArgs":
        qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        fields = transformer_fields_from_hf(cfg, qk_norm=qk_norm, allow_partial_rotary=True)
        fields["mlp_bias"] = False
        return cls(**fields, **moe_fields_from_hf(cfg))


def moe_fields_from_hf(cfg: Any) -> dict[str, Any]:
    """Glm4MoeArgs' own fields from a GLM-4.5 (or GLM-5: the same names) config."""
    return dict(
        num_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        n_shared_experts=cfg.n_shared_experts,
        first_k_dense_replace=cfg.first_k_dense_replace,
        norm_topk_prob=bool(cfg.norm_topk_prob),
        n_group=cfg.n_group or 1,
        topk_group=cfg.topk_group or 1,
        routed_scaling_factor=float(cfg.routed_scaling_factor),
        num_mtp_layers=int(getattr(cfg, "num_nextn_predict_layers", 0) or 0),
    )
