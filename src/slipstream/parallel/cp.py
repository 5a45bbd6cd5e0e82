"""Context parallelism (CP): each packed row is split into cp contiguous token shards, one per rank of a cp group (the
ranks that share one batch). Embeddings, RoPE (positions travel with their tokens), MLP/MoE, norms and the LM head
are per token and run on the shard alone; attention ALL-GATHERS keys and values over the cp group, so each rank
attends with its query shard to the whole row (causal and block-diagonal over the packed samples, at the shard's
offset: models/common/attention.py, backend "context_parallel"). Backward reduce-scatters the K/V gradients.

Why all-gather KV rather than ring or Ulysses attention: it is exact for any mask (packed samples, whatever their
boundaries relative to the shards), needs one collective per layer and no attention kernel changes. Its memory limit:
every rank holds the whole row's K and V of a layer ([T, G, K] each, kept for backward in every layer) and a boolean
mask [T / cp, T], and runs masked SDPA (also on GPU, no fused causal/varlen kernel): attention activations do not
shrink with cp, only everything else does. It serves rows whose full K/V and [T / cp, T] mask fit on one device;
longer rows need ring attention.

Rows are padded to a multiple of cp with one extra sample (positions from 0, never a loss token) that no real token
attends to. A target token t is predicted from the hidden state of token t - 1 (of the shared prefix's last token
for a branch's first token in a prefix tree, models/common/prefix_tree.py), so it belongs to the rank holding that
token: each rank computes log-probs of its own targets, and a differentiable sum over the cp group gives every rank
the whole row's log-probs (so masks over whole samples stay exact); each rank's loss then adds only its own targets.

Legend: B = rows, T = tokens per row (padded), t = tokens of one shard (T / cp).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 1 (tokens) over the cp group; backward sums the gradients and keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x_Bt: Tensor, group, num_ranks: int) -> Tensor:
        ctx.group = group
        x_tB = x_Bt.transpose(0, 1).contiguous()
        out_TB = x_tB.new_empty((num_ranks * x_tB.shape[0], *x_tB.shape[1:]))
        dist.all_gather_into_tensor(out_TB, x_tB, group=group)
        return out_TB.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad_BT: Tensor):
        grad_TB = grad_BT.transpose(0, 1).contiguous()
        num_ranks = dist.get_world_size(ctx.group)
        out_tB = grad_TB.new_empty((grad_TB.shape[0] // num_ranks, *grad_TB.shape[1:]))
        dist.reduce_scatter_tensor(out_tB, grad_TB, op=dist.ReduceOp.SUM, group=ctx.group)
        return out_tB.transpose(0, 1), None, None


class _SumOverRanks(torch.autograd.Function):
    """y = sum of x over the group, on every rank; the adjoint is the same sum of the gradients."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        grad_x = grad_y.clone()
        dist.all_reduce(grad_x, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_x, None


def shard_size(num_tokens: int, num_ranks: int) -> int:
    """t: tokens per shard of a row of `num_tokens` (rounded up: the row is padded to num_ranks * t)."""
    return -(-num_tokens // num_ranks)


def owned_tokens(
    num_tokens: int, rank: int, num_ranks: int, device: torch.device, parent_T: Tensor | None = None
) -> Tensor:
    """owned_T: tokens whose loss and counts `rank` adds up. Token t belongs to the rank holding its parent, the
    token whose hidden state predicts t: t - 1, or with `parent_T` (prefix trees, models/common/prefix_tree.py)
    parent_T[t]; a token nothing predicts (parent -1) to the rank holding t - 1, token 0 to the first rank. Each
    token has exactly one owner."""
    t_T = torch.arange(num_tokens, device=device)
    predictor_T = t_T - 1 if parent_T is None else torch.where(parent_T >= 0, parent_T, t_T - 1)
    holder_T = predictor_T.clamp(min=0) // shard_size(num_tokens, num_ranks)
    return holder_T == rank


@dataclass(frozen=True)
class RowShard:
    """This rank's part of one packed row."""

    input_ids_t: Tensor
    position_ids_t: Tensor
    row_position_ids_T: Tensor
    """Positions of the whole padded row (every rank's shard, in order): what attention's mask is built from."""
    offset: int
    """Index of this shard's first token in the row."""


class ContextParallel:
    """This rank's place in its cp group, and the row sharding and collectives the policy needs."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.rank, self.num_ranks = mesh.get_local_rank(), mesh.size()

    def shard_size(self, num_tokens: int) -> int:
        return shard_size(num_tokens, self.num_ranks)

    def shard_row(self, input_ids_T: Tensor, position_ids_T: Tensor) -> RowShard:
        """This rank's tokens of the row, padded to a multiple of the cp degree."""
        num_tokens = input_ids_T.numel()
        size = self.shard_size(num_tokens)
        num_pad = size * self.num_ranks - num_tokens
        # Padding is one more sample (positions restart at 0): real tokens never attend to it.
        pad_T = torch.arange(num_pad, device=input_ids_T.device)
        input_ids_T = torch.cat([input_ids_T, torch.zeros_like(pad_T)])
        position_ids_T = torch.cat([position_ids_T, pad_T])
        start = self.rank * size
        return RowShard(input_ids_T[start : start + size], position_ids_T[start : start + size], position_ids_T, start)

    def shard_tokens(self, x_T: Tensor, pad_value: float | int) -> Tensor:
        """x_t: this rank's part of a per-token tensor [T, ...], cut as `shard_row` cuts the row (padded with
        `pad_value`)."""
        num_tokens = x_T.shape[0]
        size = self.shard_size(num_tokens)
        pad = x_T.new_full((size * self.num_ranks - num_tokens, *x_T.shape[1:]), pad_value)
        return torch.cat([x_T, pad])[self.rank * size : (self.rank + 1) * size]

    def owned_tokens(self, num_tokens: int, device: torch.device, parent_T: Tensor | None = None) -> Tensor:
        return owned_tokens(num_tokens, self.rank, self.num_ranks, device, parent_T)

    def gather_tokens(self, x_Bt: Tensor) -> Tensor:
        """x_BT: the shards of every cp rank concatenated along dim 1 (differentiable)."""
        return _GatherTokens.apply(x_Bt, self.group, self.num_ranks)

    def sum_over_ranks(self, x: Tensor) -> Tensor:
        """Sum of `x` over the cp group, on every rank (differentiable)."""
        return _SumOverRanks.apply(x, self.group)
