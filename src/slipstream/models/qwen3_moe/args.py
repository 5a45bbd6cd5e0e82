"""Qwen3-MoE model arguments, read from a transformers `Qwen3MoeConfig`."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeArgs(TransformerArgs):
    """Qwen3 attention; MoE feed-forward on layers chosen by `decoder_sparse_step`/`mlp_only_layers` (dense
    SwiGLU of `intermediate_size` elsewhere). No shared expert."""

    num_experts: int
    """E (`num_experts`; transformers 5 stores it as `num_local_experts`, the attribute reads either)."""
    num_experts_per_tok: int
    """A: experts each token is routed to."""
    moe_intermediate_size: int
    """F of one expert."""
    norm_topk_prob: bool
    """Renormalise the A routing weights of a token to sum to 1 (Qwen3-30B-A3B: true)."""
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    router_aux_loss_coef: float
    """From the config, for a trainer that chooses to add the aux loss; the model never adds it."""

    def is_moe_layer(self, layer: int) -> bool:
        """transformers' rule for which decoder layers get the sparse MoE block."""
        return (
            layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "Qwen3MoeArgs":
        fields = transformer_fields_from_hf(cfg, qk_norm=True)
        fields["mlp_bias"] = False
        return cls(
            **fields,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=bool(cfg.norm_topk_prob),
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=tuple(cfg.mlp_only_layers or ()),
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0)),
        )
