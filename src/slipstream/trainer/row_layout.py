"""Which rows our (dense) models run a packed micro-batch in: the packed row itself, or one right-padded row per
sample, whichever the attention path that would run makes cheaper. Both give the same log-probs.

Where no fused varlen kernel applies (CPU; float32 on CUDA) packed samples share one row under a block-diagonal
mask, and attention costs T^2 for T packed tokens, most of it masked away: with many short samples (RL groups of
short completions) that dominates the step. Padded rows cost B * L^2 attention (B samples, L the longest) plus the
linear layers over the B * L - T pad tokens; on CUDA they also turn the masked path into fused causal attention.
Pads sit at the end of their row and only attend backwards, so no real token ever sees one. A prefix tree (samples
sharing a prompt, models/common/prefix_tree.py) is one padded row: its branches stay in the row, under its mask.

Legend: T = packed tokens, B = trees (a plain sample is a tree without branches), L = longest tree.
"""

import torch
from torch import nn

from slipstream.models.common.attention import varlen_attn
from slipstream.models.common.transformer import DecoderLM
from slipstream.trainer.data import PaddedLayout

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def use_padded_rows(model: nn.Module, layout: PaddedLayout, device: torch.device, compute_dtype: torch.dtype) -> bool:
    """True when one padded row per sample costs fewer FLOPs than the packed row for our `model`.

    Never for a single sample (or tree), for MoE models (pad tokens would be routed and counted in the load-balance
    statistics), or where packed rows run the fused varlen kernel (CUDA, 16-bit compute, no prefix trees) and pads
    are only waste.
    """
    if not isinstance(model, DecoderLM) or layout.num_rows == 1 or hasattr(model, "moe_stats"):
        return False
    if model.packed_attention == "flex":  # its block mask skips what the samples do not see: no waste to avoid
        return False
    # Prefix trees take the masked reference on every device (no fused kernel takes their mask): padded rows, one
    # per tree, keep that mask [trees, L, L] instead of [T, T].
    fused = device.type == "cuda" and varlen_attn is not None and compute_dtype in _SIXTEEN_BIT
    if fused and not layout.num_branches:
        return False
    num_tokens, num_rows, max_len = int(layout.row_T.numel()), layout.num_rows, layout.max_len
    per_token, per_pair = layer_flops(model)
    packed = num_tokens * per_token + num_tokens * num_tokens * per_pair
    padded = num_rows * max_len * per_token + num_rows * max_len * max_len * per_pair
    return padded < packed


def layer_flops(model: DecoderLM) -> tuple[int, int]:
    """Forward FLOPs of one block: (per token in its linear layers, per query-key pair in attention)."""
    a = model.args
    attn_proj = a.hidden_size * a.head_dim * (2 * a.num_heads + 2 * a.num_kv_heads)
    mlp = 3 * a.hidden_size * a.intermediate_size
    return 2 * (attn_proj + mlp), 4 * a.num_heads * a.head_dim


def tree_row_costs(model: nn.Module, context_parallel: bool) -> tuple[int, int]:
    """(per token, per query-key pair) forward FLOPs of a row, to judge whether samples are cheaper as one prefix
    tree (trainer/sft_trees.py). Where `use_padded_rows` may give each sample a row of its own (our dense models,
    without context parallelism or flex attention), a tree's one row pays attention over all of its tokens, so pairs
    count; elsewhere rows are packed whatever the trees, and a tree only removes tokens: (1, 0)."""
    if context_parallel or not isinstance(model, DecoderLM) or hasattr(model, "moe_stats"):
        return 1, 0
    if model.packed_attention == "flex":
        return 1, 0
    return layer_flops(model)
