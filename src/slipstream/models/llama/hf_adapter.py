"""Llama weights: HF checkpoint keys <-> ours (renames only; a tied head is stored once, as the embedding).

HF `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `input_layernorm`, `post_attention_layernorm`, `mlp.*`
become `layers.{i}.attn.*`, `attn_norm`, `mlp_norm`, `mlp.*`; `model.embed_tokens`/`model.norm` drop `model.`.
"""

from torch import Tensor

from slipstream.models.common.hf_keys import dense_key_pairs, prepare_hf, rename_keys
from slipstream.models.llama.args import LlamaArgs


def from_hf(hf_sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """Our state dict (same tensor objects) from an HF Llama state dict (checkpoint or in-memory)."""
    return rename_keys(prepare_hf(hf_sd, args), dense_key_pairs(args), to_hf=False, what="llama from_hf")


def to_hf(sd: dict[str, Tensor], args: LlamaArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict (same tensor objects; no `lm_head.weight` when tied, like save_pretrained)."""
    return rename_keys(sd, dense_key_pairs(args), to_hf=True, what="llama to_hf")
