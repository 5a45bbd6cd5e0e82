"""Micro-batch tensors and the packed <-> padded layout used to run packed samples through plain transformers.

Legend: T = tokens of a packed micro-batch, B = trees (one per padded row; a plain sample is a tree without
branches), L = longest tree, D = hidden, E = tokens with every tree written out as its samples.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from slipstream.models.common.prefix_tree import tree_ids
from slipstream.transport.rollouts import MicroBatch, Routing, TrainingBatch


class MicroBatchError(ValueError):
    """A micro-batch breaks the packing contract of transport/rollouts.py."""


@dataclass(frozen=True)
class PackedMicroBatch:
    """A MicroBatch as tensors on the training device; entry t describes token t."""

    input_ids_T: Tensor
    position_ids_T: Tensor
    loss_mask_T: Tensor
    advantages_T: Tensor
    inference_logprobs_T: Tensor
    temperatures_T: Tensor
    replay_TRA: Tensor | None = None
    """Router replay: inference's experts per token for each of the R MoE layers (int64, -1 where none)."""
    layout: "PaddedLayout | None" = None
    """The rows' layout, computed on the CPU while validating (to_packed) and copied with the tokens, so the
    forward need not rebuild it on the device (a host sync and a dozen small kernels per micro-batch)."""
    sample_tokens: int | None = None
    """Tokens of the micro-batch's samples written out one by one (each prefix tree's branches with their own copy
    of the shared prefix): what a forward that cannot take a tree runs (`expand_trees`); counted on the CPU by
    to_packed (None: not counted)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.numel()


@dataclass(frozen=True)
class PaddedLayout:
    """Where each packed token sits in padded rows, one row per tree (a plain sample is a tree without branches;
    models/common/prefix_tree.py): token t is at [row_T[t], col_T[t]]."""

    row_T: Tensor
    col_T: Tensor
    is_start_T: Tensor
    """A tree's first token: nothing predicts it."""
    parent_T: Tensor
    """The token whose hidden state predicts token t (t - 1, or the shared prefix's last token for a branch's first
    token; -1 at tree starts)."""
    num_rows: int
    max_len: int
    num_branches: int
    """Branches of all trees (0: independent samples only)."""

    def to(self, device: torch.device) -> "PaddedLayout":
        """The same layout with its tensors on `device`."""
        moved = {f: getattr(self, f).to(device) for f in ("row_T", "col_T", "is_start_T", "parent_T")}
        return replace(self, **moved)


def to_packed(mb: MicroBatch, device: torch.device) -> PackedMicroBatch:
    """Convert and validate one micro-batch (sample starts, positions, temperatures, loss at sample starts).

    Converted through numpy and validated on the CPU, then copied to `device`: no host sync per check on a GPU
    (each check on GPU tensors waited for the device; measured on an H100: ~10 ms of idle GPU per 16k-token step)."""
    if not mb.input_ids:
        raise MicroBatchError("empty micro-batch: the orchestrator must not emit micro-batches without tokens")
    with one_cpu_thread():
        cpu = _to_cpu_packed(mb)
    if torch.device(device).type == "cpu":
        return cpu
    return PackedMicroBatch(**{f: t if t is None or isinstance(t, int) else t.to(device) for f, t in vars(cpu).items()})


@contextmanager
def one_cpu_thread() -> Iterator[None]:
    """Run torch's CPU ops on one thread: a micro-batch's tensors are small, and waking a pool of intra-op threads
    per op costs more than the op (measured on an H200 host, 32 threads: the CPU layout of 16k tokens took 8.0 ms,
    1.2 ms on one thread; the GPU waits for it at every step's start). The setting is process-wide while it lasts."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _to_cpu_packed(mb: MicroBatch) -> PackedMicroBatch:
    """The micro-batch as validated CPU tensors, with the layout built while validating."""
    try:
        cpu = PackedMicroBatch(
            input_ids_T=_tensor(mb.input_ids, np.int64),
            position_ids_T=_tensor(mb.position_ids, np.int64),
            loss_mask_T=_tensor(mb.loss_mask, np.bool_),
            advantages_T=_tensor(mb.advantages, np.float32),
            inference_logprobs_T=_tensor(mb.inference_logprobs, np.float32),
            temperatures_T=_tensor(mb.temperatures, np.float32),
            replay_TRA=None,
        )
    except (OverflowError, RuntimeError, ValueError, TypeError) as e:  # e.g. an id beyond int64 (msgpack: uint64)
        raise MicroBatchError(
            f"micro-batch values of the wrong kind (input_ids and position_ids must be integers that fit in int64, "
            f"loss_mask booleans, the rest numbers): {e}"
        ) from e
    if mb.routing is not None:
        cpu = replace(cpu, replay_TRA=routing_tensor(mb.routing, len(mb.input_ids), torch.device("cpu")))
    layout = validate_packed(cpu)
    return replace(cpu, layout=layout, sample_tokens=written_out_tokens(cpu.position_ids_T, layout))


def written_out_tokens(position_ids_T: Tensor, layout: PaddedLayout) -> int:
    """Tokens of the samples with every tree written out (`expand_trees`): a branch's first token sits at the
    position where its shared prefix ends, so each branch adds that many copied tokens."""
    if not layout.num_branches:
        return position_ids_T.numel()
    t_T = torch.arange(position_ids_T.numel())
    branch_start_T = (layout.parent_T >= 0) & (layout.parent_T != t_T - 1)
    return position_ids_T.numel() + int(position_ids_T[branch_start_T].sum())


def _tensor(values: list, dtype: type) -> Tensor:
    """A CPU tensor of `values` (a list from the wire), through numpy: about twice as fast as torch.tensor."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))


def validate_packed(packed: PackedMicroBatch) -> PaddedLayout:
    """The packing contract's checks on one converted micro-batch (MicroBatchError naming what is wrong); returns
    its rows' layout, built on the way."""
    if (packed.position_ids_T < 0).any():
        raise MicroBatchError("position_ids must be >= 0")
    layout = build_padded_layout(packed.position_ids_T)
    if (packed.loss_mask_T & layout.is_start_T).any():
        raise MicroBatchError("a sample's first token has loss_mask=True, but nothing precedes it to predict it")
    if layout.num_branches and (packed.loss_mask_T & shared_prefix_mask(packed.position_ids_T)).any():
        raise MicroBatchError(
            "a shared prefix of a prefix tree has loss_mask=True: a prefix is shared only where no sample has loss "
            "(its loss would be counted once instead of once per sample)"
        )
    if not ((packed.temperatures_T > 0) & packed.temperatures_T.isfinite()).all():
        raise MicroBatchError(
            "temperatures must be finite and > 0 (log-probs at temperature 0 are undefined); use 1.0 for prompts"
        )
    if not (packed.advantages_T.isfinite().all() and packed.inference_logprobs_T.isfinite().all()):
        raise MicroBatchError("advantages and inference_logprobs must be finite (a NaN or inf poisons the loss)")
    return layout


def routing_tensor(routing: Routing, num_tokens: int, device: torch.device) -> Tensor:
    """replay_TRA (int64, -1 where inference did not route the token) from a micro-batch's Routing."""
    if routing.dtype not in ("uint8", "uint16"):
        raise MicroBatchError(f"routing.dtype must be uint8 or uint16, got {routing.dtype!r}")
    if routing.num_layers < 1 or routing.top_k < 1:
        raise MicroBatchError(
            f"routing.num_layers and routing.top_k must be >= 1, got {routing.num_layers}, {routing.top_k}"
        )
    if len(routing.data) % np.dtype(routing.dtype).itemsize:
        raise MicroBatchError(f"routing.data holds {len(routing.data)} bytes, not whole {routing.dtype} values")
    array = np.frombuffer(routing.data, dtype=routing.dtype)
    shape = (num_tokens, routing.num_layers, routing.top_k)
    if array.size != num_tokens * routing.num_layers * routing.top_k:
        raise MicroBatchError(f"routing holds {array.size} expert ids, not {shape} for the micro-batch's tokens")
    values = torch.from_numpy(array.astype(np.int64)).view(shape)
    values[values == np.iinfo(routing.dtype).max] = -1
    return values.to(device)


def build_padded_layout(position_ids_T: Tensor) -> PaddedLayout:
    """One row per tree; validate the positions. A tree starts where position_ids restart at 0 and its root counts
    0, 1, 2, ...; a branch continues the first p tokens of its tree's root, for 1 <= p <= the root's length, and
    counts p, p + 1, ... (models/common/prefix_tree.py). One host sync."""
    if int(position_ids_T[0]) != 0:
        raise MicroBatchError(f"position_ids must start at 0 (got {int(position_ids_T[0])})")
    ids = tree_ids(position_ids_T[None])
    tree_start_T, segment_start_T, fork_T = ids.tree_start_BT[0], ids.segment_start_BT[0], ids.fork_BT[0]
    t_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device)
    is_start_T = tree_start_T == t_T
    row_T = torch.cumsum(is_start_T.long(), dim=0) - 1
    col_T = t_T - tree_start_T
    # A root's length is one more than the largest position among its tokens.
    root_len_T = torch.zeros_like(t_T).scatter_reduce(
        0, row_T, torch.where(ids.is_root_BT[0], position_ids_T + 1, 0), "amax"
    )[row_T]
    is_branch_start_T = (segment_start_T == t_T) & ~is_start_T
    bad_T = is_branch_start_T & ((fork_T < 1) | (fork_T > root_len_T))
    num_rows, max_len, num_branches, num_bad = torch.stack(
        [row_T[-1] + 1, col_T.max() + 1, is_branch_start_T.sum(), bad_T.sum()]
    ).tolist()
    if num_bad:
        t = int(torch.nonzero(bad_T)[0])
        raise MicroBatchError(
            f"position_ids must count 0, 1, 2, ... inside each sample and restart at 0 per sample, or continue a "
            f"shared prefix of the tree's first sample (prefix_tree.py); token {t} is at position "
            f"{int(position_ids_T[t])} after {int(position_ids_T[t - 1])}, but its tree's first sample has only "
            f"{int(root_len_T[t])} tokens"
        )
    parent_T = torch.where(is_branch_start_T, tree_start_T + fork_T - 1, t_T - 1)
    return PaddedLayout(
        row_T=row_T,
        col_T=col_T,
        is_start_T=is_start_T,
        parent_T=torch.where(is_start_T, -1, parent_T),
        num_rows=num_rows,
        max_len=max_len,
        num_branches=num_branches,
    )


def shared_prefix_mask(position_ids_T: Tensor) -> Tensor:
    """shared_T: root tokens that some branch of their tree continues (the deduplicated prefixes)."""
    ids = tree_ids(position_ids_T[None])
    t_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device)
    tree_T = torch.cumsum((ids.tree_start_BT[0] == t_T).long(), dim=0) - 1
    longest_fork_T = torch.zeros_like(tree_T).scatter_reduce(0, tree_T, ids.fork_BT[0], "amax")[tree_T]
    return ids.is_root_BT[0] & (position_ids_T < longest_fork_T)


def padded_position_ids(position_ids_T: Tensor, layout: PaddedLayout) -> Tensor:
    """position_ids_BL of the padded rows: each tree's positions, pads continuing the position of its last token
    (pads sit at the end of a row and only attend backwards: no real token ever sees one)."""
    lengths_B = torch.bincount(layout.row_T, minlength=layout.num_rows)
    last_B = position_ids_T[torch.cumsum(lengths_B, dim=0) - 1]
    col_L = torch.arange(layout.max_len, device=position_ids_T.device)
    pads_BL = last_B[:, None] + 1 + col_L[None, :] - lengths_B[:, None]
    return torch.where(col_L[None, :] < lengths_B[:, None], unpack(position_ids_T, layout, pad_value=0), pads_BL)


def expand_trees(position_ids_T: Tensor) -> tuple[Tensor, Tensor]:
    """(source_E, own_T): the micro-batch with every tree written out as its samples one after another (a branch
    preceded by a copy of the prefix it continues): expanded token e is packed token source_E[e], and packed token
    t's own (not copied) occurrence is expanded token own_T[t]. For models that take no prefix-tree mask."""
    ids = tree_ids(position_ids_T[None])
    t_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device)
    starts = torch.nonzero(ids.segment_start_BT[0] == t_T).squeeze(-1).tolist()
    tree_starts = ids.tree_start_BT[0][starts].tolist()
    forks = ids.fork_BT[0][starts].tolist()
    ends = [*starts[1:], position_ids_T.numel()]
    source, own = [], []
    for start, end, tree_start, fork in zip(starts, ends, tree_starts, forks, strict=True):
        source += range(tree_start, tree_start + fork)
        own += range(len(source), len(source) + end - start)
        source += range(start, end)
    return torch.tensor(source, device=position_ids_T.device), torch.tensor(own, device=position_ids_T.device)


def unpack(values_T: Tensor, layout: PaddedLayout, pad_value: float | int) -> Tensor:
    """Packed [T, ...] -> padded [B, L, ...] (right padding with pad_value)."""
    shape = (layout.num_rows, layout.max_len, *values_T.shape[1:])
    values_BL = torch.full(shape, pad_value, dtype=values_T.dtype, device=values_T.device)
    values_BL[layout.row_T, layout.col_T] = values_T
    return values_BL


def pack(values_BL: Tensor, layout: PaddedLayout) -> Tensor:
    """Padded [B, L, ...] -> packed [T, ...]; differentiable."""
    return values_BL[layout.row_T, layout.col_T]


def count_loss_tokens(batch: TrainingBatch) -> int:
    return sum(sum(mb.loss_mask) for mb in batch.micro_batches)


def validate_batch(batch: TrainingBatch, step: int, rank: int, world_size: int) -> None:
    """Check the batch is the one awaited and its loss normaliser matches its loss tokens. `rank` and `world_size`
    count batch files (data ranks): trainer ranks, except that the cp ranks of a group share one."""
    if (batch.step, batch.rank) != (step, rank):
        raise MicroBatchError(f"expected the batch of step {step} rank {rank}, got step {batch.step} rank {batch.rank}")
    local = count_loss_tokens(batch)
    if batch.num_loss_tokens <= 0 or local > batch.num_loss_tokens:
        raise MicroBatchError(
            f"step {step}: batch.num_loss_tokens={batch.num_loss_tokens} but this rank's micro-batches hold {local} "
            "loss tokens; it must be the step's loss-token count across all ranks (> 0)"
        )
    if world_size == 1 and local != batch.num_loss_tokens:
        raise MicroBatchError(
            f"step {step}: batch.num_loss_tokens={batch.num_loss_tokens} but the only rank's micro-batches hold "
            f"{local} loss tokens; they must be equal with one batch per step"
        )
