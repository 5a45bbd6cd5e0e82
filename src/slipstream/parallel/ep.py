"""Expert parallelism (EP), applied from outside to stacked-experts modules (`forward(x_MD, counts_E) -> y_MD`, rows
sorted by expert, weights [E, ...]): each of the P ranks of the ep mesh keeps E / P experts (weights become DTensors
sharded on dim 0) and hooks around the module's forward send every routed row to the rank of its expert and bring
the results back.

Dispatch, per MoE layer: (1) an equal-size all_to_all_single of the per-expert row counts, (2) an all_to_all_single
of the rows with split sizes from those counts (gloo and NCCL both take unequal splits: no padding), (3) a
permutation from the received (source rank, expert) order to (expert, source rank) order, so each local expert's
rows are contiguous. Combine undoes (3) and (2). The row exchanges are autograd Functions whose backward is the
all-to-all with the split sizes swapped, so gradients reach the router and the inputs; each expert's weight gradient
sums over the rows of every rank of its ep group (FSDP then sums over the other ranks: parallel/fsdp.py).

Legend: M = routed rows of this rank (sorted by global expert), R = rows this rank's experts receive, P = ep ranks,
E = experts, e = local experts (E / P), D = hidden size.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows (dim 0) with split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x_MD: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        y_RD = x_MD.new_empty((sum(output_splits), *x_MD.shape[1:]))
        dist.all_to_all_single(y_RD, x_MD.contiguous(), output_splits, input_splits, group=group)
        return y_RD

    @staticmethod
    def backward(ctx, grad_y_RD: Tensor):
        grad_x_MD = grad_y_RD.new_empty((sum(ctx.input_splits), *grad_y_RD.shape[1:]))
        dist.all_to_all_single(grad_x_MD, grad_y_RD.contiguous(), ctx.input_splits, ctx.output_splits, group=ctx.group)
        return grad_x_MD, None, None, None


def all_to_all(x_MD: Tensor, output_splits: list[int], input_splits: list[int], group) -> Tensor:
    """Rows x_MD[sum(input_splits[:p]) : ...] go to rank p of `group`; returns the rows received, rank by rank."""
    return _AllToAll.apply(x_MD, output_splits, input_splits, group)


def expert_major_order(counts_PE: Tensor, num_rows: int | None = None) -> Tensor:
    """perm_R with x_expert_major_R = x_received_R[perm_R].

    Received rows come in (source rank p, local expert e) segments, p-major: counts_PE[p, e] rows each. perm_R lists
    the same rows e-major (expert 0's rows from ranks 0..P-1, then expert 1's, ...), keeping order within a segment.
    `num_rows` (R = counts_PE.sum(), when the caller knows it) spares a device-to-host sync on GPUs.
    """
    num_ranks, num_local = counts_PE.shape
    counts_flat = counts_PE.flatten()
    starts_PE = (counts_flat.cumsum(0) - counts_flat).view(num_ranks, num_local)
    starts_S, counts_S = starts_PE.T.flatten(), counts_PE.T.flatten()  # S = segments in expert-major order
    segments_S = torch.arange(counts_S.numel(), device=counts_S.device)
    segment_R = torch.repeat_interleave(segments_S, counts_S, output_size=num_rows)
    first_S = counts_S.cumsum(0) - counts_S
    within_R = torch.arange(segment_R.numel(), device=counts_S.device) - first_S[segment_R]
    return starts_S[segment_R] + within_R


def inverse_permutation(perm_R: Tensor) -> Tensor:
    inverse_R = torch.empty_like(perm_R)
    inverse_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
    return inverse_R


@dataclass
class _Route:
    """How one forward's rows travelled: what combine needs to bring the results back."""

    input_splits: list[int]
    output_splits: list[int]
    inverse_R: Tensor


class ExpertParallel:
    """The dispatch / combine hooks of one stacked-experts module over an ep mesh."""

    def __init__(self, mesh: DeviceMesh, num_experts: int):
        self.group = mesh.get_group()
        self.num_ranks = mesh.size()
        self.num_local = num_experts // self.num_ranks
        self._route: _Route | None = None

    def dispatch(self, module: nn.Module, args: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """Forward pre-hook: (x_MD, counts_E) of this rank's routed rows -> (x_RD, counts_e) of its experts' rows."""
        x_MD, counts_E = args
        counts_PE = counts_E.view(self.num_ranks, self.num_local)
        received_PE = torch.empty_like(counts_PE)
        dist.all_to_all_single(received_PE, counts_PE.contiguous(), group=self.group)
        # One device-to-host sync for both split lists (the row exchange needs them on the host).
        input_splits, output_splits = torch.stack([counts_PE.sum(1), received_PE.sum(1)]).tolist()
        x_RD = all_to_all(x_MD, output_splits, input_splits, self.group)
        perm_R = expert_major_order(received_PE, num_rows=sum(output_splits))
        # A recomputation under activation checkpointing may stop between dispatch and combine (early stop): the
        # next dispatch then replaces its route, which nothing needs any more.
        self._route = _Route(input_splits, output_splits, inverse_permutation(perm_R))
        return x_RD[perm_R], received_PE.sum(0)

    def combine(self, module: nn.Module, args: tuple, y_RD: Tensor) -> Tensor:
        """Forward hook: the experts' outputs, back on the ranks and in the order their rows came from."""
        route, self._route = self._route, None
        return all_to_all(y_RD[route.inverse_R], route.input_splits, route.output_splits, self.group)


def shard_experts(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each [E, ...] parameter of `module` (the same full tensor on every rank) by a DTensor sharded on dim 0
    over `mesh`: this rank keeps its E / P experts."""
    rank, num_ranks = mesh.get_local_rank(), mesh.size()
    # FSDP expects DTensors already on the mesh's device (it moves plain tensors itself).
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach().chunk(num_ranks, dim=0)[rank].to(device, copy=True)
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def apply_expert_parallel(experts: Sequence[nn.Module], mesh: DeviceMesh) -> None:
    """Shard every stacked-experts module of `experts` over `mesh` and route its rows there (all-to-all hooks)."""
    num_ranks = mesh.size()
    for module in experts:
        num_experts = module.num_experts
        if num_experts % num_ranks != 0:
            raise ValueError(
                f"trainer.parallel.ep ({num_ranks}) must divide the number of experts ({num_experts}) of every MoE "
                "layer; pick an ep that divides it"
            )
        shard_experts(module, mesh)
        ep = ExpertParallel(mesh, num_experts)
        module.register_forward_pre_hook(ep.dispatch)
        module.register_forward_hook(ep.combine)
