"""MiniMax-M2 model arguments, read from a transformers `MiniMaxM2Config` (with the checks of what is not modelled)."""

from dataclasses import dataclass
from typing import Any

from slipstream.models.common.args import TransformerArgs, transformer_fields_from_hf


@dataclass(frozen=True, kw_only=True)
class MiniMaxM2Args(TransformerArgs):
    """GQA attention with partial RoPE (`rotary_dim` / `partial_rotary_factor`, MiniMax-M2: 64 of 128), no biases, and
    q/k RMSNorm over the WHOLE projection (`q_norm` of width H*K, `k_norm` of width G*K; `qk_norm` is always on). Every
    layer is an MoE of `num_experts` routed SwiGLU experts of width `intermediate_size` (transformers' name for the
    expert width here): sigmoid scores, top-A on `scores + e_score_correction_bias`, gate weights the chosen scores
    renormalised to sum to 1 (GroupLimitedSigmoidRouter with one group and no scaling, common/moe_routing.py).

    Not modelled, rejected by `from_hf_config`: router jitter noise (transformers multiplies the MoE input by noise in
    training mode), shared experts (`shared_intermediate_size` > 0), a scoring function other than sigmoid, linear
    attention layers (`attn_type_list` with 0s, MiniMax-Text-01 style). Not modelled, dropped on import: the
    multi-token-prediction modules of the checkpoints (`model.layers.{num_layers + i}.*`, `num_mtp_modules`)."""

    num_experts: int
    """E (`num_local_experts`)."""
    num_experts_per_tok: int
    """A: routed experts per token."""
    router_aux_loss_coef: float
    """From the config, for a trainer that chooses to add the aux loss; the model never adds it."""
    num_mtp_layers: int = 0
    """Multi-token-prediction modules the checkpoint holds after the decoder layers (not modelled, see above)."""

    @property
    def moe_intermediate_size(self) -> int:
        """F of one routed expert (transformers' `intermediate_size`)."""
        return self.intermediate_size

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "MiniMaxM2Args":
        _check_minimax_m2_supported(cfg)
        fields = transformer_fields_from_hf(cfg, qk_norm=True, allow_partial_rotary=True)
        fields["attention_bias"] = fields["mlp_bias"] = False
        return cls(
            **fields,
            num_experts=cfg.num_local_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0),
            num_mtp_layers=int(getattr(cfg, "num_mtp_modules", 0) or 0),
        )


def _check_minimax_m2_supported(cfg: Any) -> None:
    """Reject MiniMax-M2 config features that neither transformers' model nor ours computes as the checkpoint means."""
    if float(getattr(cfg, "router_jitter_noise", 0.0) or 0.0) != 0.0:
        raise ValueError(
            f"minimax_m2: router_jitter_noise={cfg.router_jitter_noise} is not supported by the custom model (no "
            "training-time noise on the MoE input); set it to 0 or use impl='hf'"
        )
    if int(getattr(cfg, "shared_intermediate_size", 0) or 0) > 0:
        raise ValueError(
            f"minimax_m2: shared experts (shared_intermediate_size={cfg.shared_intermediate_size}) are not modelled "
            "(transformers ignores them too); use a checkpoint without shared experts"
        )
    scoring = getattr(cfg, "scoring_func", "sigmoid")
    if scoring not in (None, "sigmoid"):
        raise ValueError(f"minimax_m2: scoring_func '{scoring}' is not supported (sigmoid only); use impl='hf'")
    qk_norm_type = getattr(cfg, "qk_norm_type", None)
    if qk_norm_type not in (None, "per_layer"):
        raise ValueError(
            f"minimax_m2: qk_norm_type '{qk_norm_type}' is not supported ('per_layer' only: one norm over all heads)"
        )
    attn_types = getattr(cfg, "attn_type_list", None) or []
    if any(int(t) != 1 for t in attn_types):
        raise ValueError(
            "minimax_m2: linear-attention layers (attn_type_list entries != 1) are not supported; full attention only"
        )
