"""Expert parallelism (EP), applied from outside to stacked-experts modules (GroupedExperts: weights [E, ...]): each of
the P ranks of the ep mesh keeps E / P experts (weights become DTensors sharded on dim 0) and the module gets a
`token_dispatch` (TokenDispatch below), which `models.common.moe.mix_experts` calls instead of mixing locally.

Token dispatch, per MoE layer, with static shapes: every rank sends each of its N tokens once to every rank of the
group (not once per routed expert), with the token's expert ids renumbered for that rank (-1 for the slots whose
expert lives elsewhere) and its gate weights (0 there). The receiving rank runs its experts on the rows
(`mix_local_experts`: masked slots are sorted last and not computed) and sends back, per row, the weighted sum over
its own experts in float32; the sender adds the P partial sums of each token in rank order and rounds once to the
output dtype. Nothing is read on the host, so a compiled, checkpointed block traces whole (a device-to-host read
of split sizes is a graph break, and a graph break inside an activation-checkpointed block runs that whole block
eagerly: what the earlier per-(token, expert) exchange did). The exchange moves P x N rows per rank each way;
with top-k routing that is no more than a per-(token, expert) exchange (N x k rows) while ep <= k, the single-node
case, and up to ep / k times more beyond it.

The exchanges are torch's functional collectives (`_c10d_functional.all_to_all_single`, equal splits; rows,
weights and partial sums are differentiable: backward is the reverse all-to-all, so gradients reach the router and
the inputs; each expert's weight gradient sums over the rows of every rank of its ep group, FSDP then sums over the
other ranks: parallel/fsdp.py). Being ops, not calls on a process group, they are what selective activation
checkpointing can save (parallel/ac.py keeps their outputs: a recomputed block exchanges nothing) and what
torch.compile traces.

Legend: N = tokens of this rank, A = active experts per token, P = ep ranks, e = local experts (E / P), D = hidden
size, R = P x N rows received.
"""

import contextlib
from collections.abc import Sequence

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from slipstream.models.common.moe import mix_local_experts


def all_to_all(x_KD: Tensor, group) -> Tensor:
    """Block p of x_KD's P equal row blocks goes to rank p of `group`; returns the blocks received, rank by rank
    (differentiable; eagerly an AsyncCollectiveTensor: the first op that reads it waits for the exchange)."""
    return funcol.all_to_all_single_autograd(x_KD.contiguous(), None, None, group)


class Capacity:
    """Rows per rank and destination of the current forward's exchanges: the largest token count N of the ep group,
    agreed by one all-reduce (read on the host) per forward; each rank pads its N tokens to it."""

    def __init__(self, mesh: DeviceMesh):
        self.group = mesh.get_group()
        self.rows_R0: Tensor | None = None
        """An empty [rows, 0] tensor: the agreed rows travel as its size, which torch.compile treats as a dynamic
        size after the first change (a Python int would be a constant: one recompilation per value). Set for the
        current forward (kept for its recomputation in backward); None: agree at the next exchange."""

    def agree(self, num_tokens: int, device: torch.device) -> int:
        largest = torch.tensor([num_tokens], device=device)
        return int(funcol.wait_tensor(funcol.all_reduce(largest, "max", self.group)).item())

    def clear(self, *_args) -> None:
        """Root forward pre-hook: a new forward agrees anew."""
        self.rows_R0 = None

    @torch._dynamo.disable
    def agree_before_block(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of each MoE block (outside its compiled, checkpointed body: the host read would break
        that graph): the first block of a forward agrees for all of them."""
        if self.rows_R0 is None:
            x_BTD = args[0]
            self.rows_R0 = x_BTD.new_empty(self.agree(x_BTD.shape[:-1].numel(), x_BTD.device), 0)


class TokenDispatch:
    """`experts.token_dispatch` under expert parallelism: mix_experts across the ranks of one ep group."""

    def __init__(self, mesh: DeviceMesh, num_experts: int, capacity: Capacity):
        self.group = mesh.get_group()
        self.num_ranks = mesh.size()
        self.num_local = num_experts // self.num_ranks
        self.capacity = capacity
        self.compute_dtype: torch.dtype | None = None
        """Set when no FSDP unit casts the experts' weights (parallel/fsdp.py): their matmuls then run under autocast
        to this dtype, as on FSDP's parameters in that dtype (float32: nothing to do)."""

    def __call__(
        self, experts: nn.Module, x_ND: Tensor, expert_ids_NA: Tensor, weights_NA: Tensor, dtype: torch.dtype
    ) -> Tensor:
        num_ranks, num_local = self.num_ranks, self.num_local
        num_tokens, top_k = expert_ids_NA.shape
        # Without the block hooks (a bare MoE module) every exchange agrees on its own: the same on every rank.
        agreed_R0 = self.capacity.rows_R0
        rows = self.capacity.agree(num_tokens, x_ND.device) if agreed_R0 is None else agreed_R0.shape[0]
        if rows < num_tokens:
            raise RuntimeError(f"expert parallelism: {num_tokens} tokens for an exchange agreed at {rows} rows")
        pad = rows - num_tokens  # padding tokens route nowhere (no slot of theirs is any rank's)
        ids_CA = F.pad(expert_ids_NA, (0, 0, 0, pad), value=-1)
        first_P11 = (torch.arange(num_ranks, device=x_ND.device) * num_local).view(num_ranks, 1, 1)
        mine_PCA = (ids_CA.unsqueeze(0) >= first_P11) & (ids_CA.unsqueeze(0) < first_P11 + num_local)
        local_PCA = torch.where(mine_PCA, ids_CA.unsqueeze(0) - first_P11, -1)
        weights_CA = F.pad(weights_NA, (0, 0, 0, pad))
        weights_PCA = torch.where(mine_PCA, weights_CA.unsqueeze(0), torch.zeros_like(weights_CA).unsqueeze(0))
        x_PCD = F.pad(x_ND, (0, 0, 0, pad)).unsqueeze(0).expand(num_ranks, rows, x_ND.shape[-1])
        x_RD = all_to_all(x_PCD.reshape(num_ranks * rows, -1), self.group)
        local_RA = funcol.wait_tensor(
            funcol.all_to_all_single(local_PCA.reshape(-1, top_k).contiguous(), None, None, self.group)
        )
        weights_RA = all_to_all(weights_PCA.reshape(-1, top_k), self.group)
        cast = self.compute_dtype not in (None, torch.float32)
        with torch.autocast(x_ND.device.type, dtype=self.compute_dtype) if cast else contextlib.nullcontext():
            y_RD = mix_local_experts(experts, x_RD, local_RA, weights_RA, num_local, x_ND.dtype)
        # Each token's partial sums, rank by rank, added in float32 in rank order.
        y_PCD = all_to_all(y_RD, self.group).view(num_ranks, rows, -1)
        return y_PCD.sum(dim=0)[:num_tokens].to(dtype)


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


def apply_expert_parallel(experts: Sequence[nn.Module], mesh: DeviceMesh) -> Capacity:
    """Shard every stacked-experts module of `experts` over `mesh` and mix its experts across the ranks
    (TokenDispatch). Returns their shared Capacity: `install_capacity_hooks` makes it agree once per forward."""
    num_ranks = mesh.size()
    capacity = Capacity(mesh)
    for module in experts:
        num_experts = module.num_experts
        if num_experts % num_ranks != 0:
            raise ValueError(
                f"trainer.parallel.ep ({num_ranks}) must divide the number of experts ({num_experts}) of every MoE "
                "layer; pick an ep that divides it"
            )
        shard_experts(module, mesh)
        module.token_dispatch = TokenDispatch(mesh, num_experts, capacity)
    return capacity


def install_capacity_hooks(capacity: Capacity, root: nn.Module, blocks: Sequence[nn.Module]) -> None:
    """Agree on the exchanges' rows once per forward of `root`: cleared by a pre-hook of `root`, agreed by a pre-hook of
    the outermost module of each block (`blocks`: as wrapped for checkpointing, the modules that get compiled) that
    holds an expert-parallel experts module."""
    root.register_forward_pre_hook(capacity.clear)
    for block in blocks:
        if any(getattr(m, "token_dispatch", None) is not None for m in block.modules()):
            block.register_forward_pre_hook(capacity.agree_before_block)
