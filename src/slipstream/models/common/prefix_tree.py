"""Packed rows of prefix trees, read from position_ids alone (no other metadata travels with a batch).

A row holds trees back to back. A tree starts where position_ids is 0 (and at a row's first token); its first
segment, the ROOT, counts 0, 1, 2, ... A BRANCH starts wherever the count breaks at a position p > 0: it continues
the first p tokens of its tree's root (the shared prefix) and counts p, p + 1, ... A plain packed sample is a tree
without branches, so packed batches of independent samples mean what they always meant.

    tokens     a b c d e | f g | h         root "a b c d e", branch "f g" forked at p=3, branch "h" at p=2
    positions  0 1 2 3 4 | 3 4 | 2         samples: [a b c d e], [a b c f g], [a b h]

Attention: query q may attend key k iff both are in the same tree, k <= q, and k is in q's segment or k is one of
the p root tokens q's branch continues. Every segment therefore sees exactly the tokens of its own sample, and
position_ids give each token its position inside that sample: a tree computes what its samples computed one by one,
with the shared prefix computed once. Token t of a segment is predicted from `parent_index`: t - 1, or for a branch's
first token the root's token at position p - 1.

Legend: B = rows, T = tokens per row, t = query tokens (a slice of a row's tokens).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class TreeIds:
    """Per token of packed rows: its tree, its segment, and what the segment continues."""

    tree_start_BT: Tensor
    """Index (column) of the first token of the token's tree."""
    segment_start_BT: Tensor
    """Index of the first token of the token's segment (its tree's root or a branch)."""
    fork_BT: Tensor
    """Root tokens the token's segment continues: 0 in a root, p in a branch forked at position p."""

    @property
    def is_root_BT(self) -> Tensor:
        return self.segment_start_BT == self.tree_start_BT


def tree_ids(position_ids_BT: Tensor) -> TreeIds:
    """Trees and segments of packed rows (no host sync). A row's first token starts a tree whatever its position."""
    num_tokens = position_ids_BT.shape[-1]
    col_BT = torch.arange(num_tokens, device=position_ids_BT.device).expand_as(position_ids_BT)
    is_tree_start_BT = position_ids_BT == 0
    is_tree_start_BT[..., 0] = True
    prev_BT = F.pad(position_ids_BT[..., :-1], (1, 0), value=-2)
    is_segment_start_BT = is_tree_start_BT | (position_ids_BT != prev_BT + 1)
    zero_BT = torch.zeros_like(col_BT)
    tree_start_BT = torch.cummax(torch.where(is_tree_start_BT, col_BT, zero_BT), dim=-1).values
    segment_start_BT = torch.cummax(torch.where(is_segment_start_BT, col_BT, zero_BT), dim=-1).values
    fork_BT = torch.where(segment_start_BT == tree_start_BT, zero_BT, position_ids_BT.gather(-1, segment_start_BT))
    return TreeIds(tree_start_BT, segment_start_BT, fork_BT)


def has_branches(position_ids_BT: Tensor) -> Tensor:
    """0-dim bool tensor (no host sync): does any row hold a branch, i.e. a count break at a position other than 0?"""
    breaks_BT = position_ids_BT[..., 1:] != position_ids_BT[..., :-1] + 1
    return (breaks_BT & (position_ids_BT[..., 1:] != 0)).any()


def tree_mask(position_ids_BT: Tensor, query_offset: int = 0, num_queries: int | None = None) -> Tensor:
    """mask_B1tT (bool, True = may attend) of queries [query_offset, query_offset + t) over every key of the rows.

    Causal and block-diagonal over the trees; inside a tree, the rule of the module docstring. O(t * T) memory:
    the reference for CPU, context parallelism and tests."""
    num_tokens = position_ids_BT.shape[-1]
    num_queries = num_tokens - query_offset if num_queries is None else num_queries
    ids = tree_ids(position_ids_BT)
    q = slice(query_offset, query_offset + num_queries)
    device = position_ids_BT.device
    query_t = torch.arange(query_offset, query_offset + num_queries, device=device)
    causal_tT = torch.arange(num_tokens, device=device)[None, :] <= query_t[:, None]
    same_tree_BtT = ids.tree_start_BT[:, q, None] == ids.tree_start_BT[:, None, :]
    same_segment_BtT = ids.segment_start_BT[:, q, None] == ids.segment_start_BT[:, None, :]
    in_prefix_BtT = ids.is_root_BT[:, None, :] & (position_ids_BT[:, None, :] < ids.fork_BT[:, q, None])
    return (same_tree_BtT & causal_tT & (same_segment_BtT | in_prefix_BtT)).unsqueeze(1)


def parent_index(position_ids_T: Tensor) -> Tensor:
    """parent_T: the token whose hidden state predicts token t (t - 1, or the root's token at position p - 1 for a
    branch's first token); -1 at a tree's first token, which nothing predicts. One packed row (1-D)."""
    ids = tree_ids(position_ids_T[None])
    t_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device)
    tree_start_T, segment_start_T, fork_T = ids.tree_start_BT[0], ids.segment_start_BT[0], ids.fork_BT[0]
    parent_T = torch.where((segment_start_T == t_T) & (fork_T > 0), tree_start_T + fork_T - 1, t_T - 1)
    return torch.where(tree_start_T == t_T, torch.full_like(t_T, -1), parent_T)


def segment_index(position_ids_T: Tensor) -> Tensor:
    """segment_T: index (0, 1, ...) of the token's segment in the row: each root and each branch is one sample."""
    ids = tree_ids(position_ids_T[None])
    t_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device)
    return torch.cumsum((ids.segment_start_BT[0] == t_T).long(), dim=0) - 1
