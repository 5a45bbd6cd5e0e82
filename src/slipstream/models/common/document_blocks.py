"""flex_attention's BlockMask for packed rows of independent samples (documents), computed directly from where
each sample starts: a few vectorised ops and no host sync, instead of `create_block_mask` evaluating the mask on
every block pair (about 5 ms of host time per micro-batch on an H200 host, measured with torch.profiler; the GPU
waits meanwhile). Prefix trees keep `create_block_mask` (attention.build_block_mask).

For query block i (tokens [iS, iS + S - 1], S = BLOCK tokens) with sample starts s_first (of its first token) and
s_last (of its last token), sample starts never decreasing along a row:
- key block j holds some allowed pair iff floor(s_first / S) <= j <= i (a query of the first sample sees the keys
  from s_first on, and no key comes after the query);
- key block j < i is full (every pair allowed) iff all of block i's queries are in one sample and key block j lies
  inside it: j >= ceil(s_last / S) (s_last <= iS then says the whole block is one sample);
- the partial blocks are the allowed ones that are not full, the diagonal block always among them; a last query
  block cut short by the row's end has no full block (its padding queries see nothing).
These are `create_block_mask`'s definitions (tests/unit/test_flex_attention.py compares both, block by block).

Legend: B = rows, T = tokens per row, Q = query blocks, K = key blocks.
"""

import torch
from torch import Tensor

BLOCK = 128
"""flex_attention's default block size (both directions)."""


def document_block_mask(sample_start_BT: Tensor, mask_mod, block: int = BLOCK):
    """BlockMask of causal attention inside each sample; `sample_start_BT[b, t]` is the column where token t's
    sample starts in row b. `mask_mod` decides inside the partial blocks (it must agree with this rule)."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = sample_start_BT.shape
    num_blocks = -(-T // block)
    device = sample_start_BT.device
    first_Q = torch.arange(num_blocks, device=device) * block
    last_Q = torch.clamp(first_Q + block - 1, max=T - 1)
    s_first_BQ, s_last_BQ = sample_start_BT[:, first_Q], sample_start_BT[:, last_Q]
    lowest_BQ = torch.div(s_first_BQ, block, rounding_mode="floor")
    full_from_BQ = torch.div(s_last_BQ + block - 1, block, rounding_mode="floor")
    i_Q1 = torch.arange(num_blocks, device=device)[:, None]
    j_1K = torch.arange(num_blocks, device=device)[None, :]
    allowed_BQK = (j_1K >= lowest_BQ[..., None]) & (j_1K <= i_Q1)
    full_BQK = (j_1K >= full_from_BQ[..., None]) & (j_1K < i_Q1)
    if T % block:  # a last, incomplete query block holds padding queries, which see nothing: no full block there
        full_BQK[:, -1] = False
    partial_BQK = allowed_BQK & ~full_BQK
    return BlockMask.from_kv_blocks(
        *_ordered(partial_BQK),
        *_ordered(full_BQK),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(T, T),
    )


def _ordered(blocks_BQK: Tensor) -> tuple[Tensor, Tensor]:
    """(num_blocks_B1Q, indices_B1QK) int32: per query block, how many key blocks are set and which, ascending
    first (the rest of a row's indices is ignored by flex_attention)."""
    num_Q = blocks_BQK.shape[-1]
    key_K = torch.arange(num_Q, device=blocks_BQK.device)
    # set blocks sort by their index, unset ones after all of them
    order_BQK = torch.argsort(torch.where(blocks_BQK, key_K, key_K + num_Q), dim=-1)
    counts_BQ = blocks_BQK.sum(-1)
    return counts_BQ[:, None].to(torch.int32), order_BQK[:, None].to(torch.int32)
