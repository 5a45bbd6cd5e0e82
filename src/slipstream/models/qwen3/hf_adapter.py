"""Qwen3 (dense) weights: HF checkpoint keys <-> ours (renames only), as for Llama plus
`self_attn.{q,k}_norm.weight` -> `attn.{q,k}_norm.weight`."""

from torch import Tensor

from slipstream.models.common.hf_keys import dense_key_pairs, prepare_hf, rename_keys
from slipstream.models.qwen3.args import Qwen3Args


def from_hf(hf_sd: dict[str, Tensor], args: Qwen3Args) -> dict[str, Tensor]:
    """Our state dict (same tensor objects) from an HF Qwen3 state dict (checkpoint or in-memory)."""
    return rename_keys(prepare_hf(hf_sd, args), dense_key_pairs(args), to_hf=False, what="qwen3 from_hf")


def to_hf(sd: dict[str, Tensor], args: Qwen3Args) -> dict[str, Tensor]:
    """HF checkpoint state dict (same tensor objects; no `lm_head.weight` when tied)."""
    return rename_keys(sd, dense_key_pairs(args), to_hf=True, what="qwen3 to_hf")
