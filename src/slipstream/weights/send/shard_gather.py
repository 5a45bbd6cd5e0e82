"""Gathering a sharded model for the weight stream in few collectives: the tensors of several consecutive layers are
cast to the published dtype on each rank (its shard only; a cast is elementwise, so the values are bit-identical to
casting the whole tensor), all-gathered together in one flat collective per process group and dtype, and laid out
whole by one copy (`torch.split_with_sizes_copy`).

Compared with unsharding each layer's FSDP unit (export.HFWeightStream without a gatherer): one collective
per chunk of about `CHUNK_BYTES` instead of one per layer, each of those with FSDP's own copy-in and copy-out, and
the next chunk's gather in flight while the current one is consumed. The bytes are the same on GPUs (FSDP's mixed
precision already gathers bfloat16) and half on CPUs (where FSDP gathers float32). Tensors published in float32
(a family's `keep_in_fp32`) travel in float32 from the float32 masters.

A tensor takes this path when it is a DTensor sharded on dim 0 along exactly one mesh dimension of size > 1 and
replicated along the others (FSDP2, HSDP, expert parallelism alone): rank c of that dimension holds rows
[c * s, min((c + 1) * s, R)) with s = ceil(R / n), as torch.chunk splits them. Any other DTensor (experts sharded
twice, by EP and by FSDP) is gathered alone with `full_tensor()`, and plain tensors are used as they are.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

CHUNK_BYTES = 256 << 20
"""Consecutive layers are gathered together until their tensors (whole, published dtype) reach about this size."""

Entry = tuple[nn.Module, str, list[str], int | None]
"""A stream plan entry: (module, attribute, HF names, first stacked index or None)."""


@dataclass(frozen=True)
class ShardAxis:
    """Where a tensor's dim-0 shards live: the process group of the mesh dimension, this rank's place in it, and the
    device its collectives run on (a shard offloaded to the CPU travels from there)."""

    group: object
    rank: int
    size: int
    device: torch.device


def shard_axis(tensor: Tensor) -> ShardAxis | None:
    """The mesh dimension `tensor` is row-sharded along, when it is a DTensor sharded on dim 0 along exactly one mesh
    dimension of size > 1 and replicated along every other; None otherwise (gather it another way)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return None
    mesh = tensor.device_mesh
    sharded = [d for d, p in enumerate(tensor.placements) if mesh.size(d) > 1 and not isinstance(p, Replicate)]
    if len(sharded) != 1:
        return None
    d = sharded[0]
    placement = tensor.placements[d]
    if type(placement) is not Shard or placement.dim != 0:  # not _StridedShard, not another dim
        return None
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    return ShardAxis(mesh.get_group(d), mesh.get_local_rank(d), mesh.size(d), device)


def rows_per_rank(rows: int, size: int) -> list[int]:
    """Rows each of `size` ranks holds of a tensor of `rows` rows split as torch.chunk splits it."""
    step = math.ceil(rows / size)
    return [max(0, min(step, rows - c * step)) for c in range(size)]


@dataclass
class _Source:
    """One sharded tensor of a gather: plan entry `key`, its whole shape, and where its pieces go."""

    key: tuple[int, int]
    shape: tuple[int, ...]
    rows: list[int]
    send_offset: int
    """Where this rank's shard starts in the per-rank send buffer (elements); each rank reserves ceil(R / n) rows."""
    whole_offset: int
    """Where the whole tensor starts in the gathered-and-arranged buffer (elements)."""

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


@dataclass
class _Gather:
    """One collective of a chunk: every source sharded along `axis`, gathered in `dtype`."""

    axis: ShardAxis
    dtype: torch.dtype
    sources: list[_Source] = field(default_factory=list)
    send_numel: int = 0
    whole_numel: int = 0
    slot_sizes: list[int] = field(default_factory=list)
    """Each source's slot in a rank's send buffer (elements): ceil(R / n) rows."""
    whole_sizes: list[int] = field(default_factory=list)
    """Each source's whole tensor (elements)."""
    even: bool = True
    """Every rank holds the same rows of every source: each rank's slot is exactly its piece of the whole."""

    def add(self, source: _Source) -> None:
        self.sources.append(source)
        self.slot_sizes.append(max(source.rows) * source.row_numel)
        self.whole_sizes.append(math.prod(source.shape))
        self.even = self.even and min(source.rows) == max(source.rows)
        self.send_numel += self.slot_sizes[-1]
        self.whole_numel += self.whole_sizes[-1]


@dataclass
class Pending:
    """A chunk whose gathers are in flight."""

    works: list[tuple[_Gather, object, Tensor, Tensor]]
    """(gather, its async work, the send buffer kept alive until it completes, the receive buffer)."""


class ShardGatherer:
    """Gathers the sharded tensors of a stream plan (`plan[k]`: layer group k's entries) chunk by chunk.
    `dtypes[k][i]` is the dtype entry i of group k is published in. Every rank builds the same chunks from the same
    plan, so the collectives match across ranks."""

    def __init__(self, plan: Sequence[Sequence[Entry]], dtypes: Sequence[Sequence[torch.dtype]], chunk_bytes: int):
        self.plan, self.dtypes = plan, dtypes
        self.axes: dict[tuple[int, int], ShardAxis] = {}
        sizes = []
        for k, entries in enumerate(plan):
            size = 0
            for i, (module, attr, _, _) in enumerate(entries):
                tensor = getattr(module, attr)
                axis = shard_axis(tensor) if tensor.is_floating_point() else None
                if axis is not None:
                    self.axes[(k, i)] = axis
                size += tensor.numel() * torch.empty((), dtype=dtypes[k][i]).element_size()
            sizes.append(size)
        self.chunks: list[list[int]] = []
        total = 0
        for k, size in enumerate(sizes):
            if not self.chunks or total >= chunk_bytes:
                self.chunks.append([])
                total = 0
            self.chunks[-1].append(k)
            total += size
        self.chunk_of = {k: j for j, groups in enumerate(self.chunks) for k in groups}
        self._planned: dict[tuple[tuple[int, int], ...], list[_Gather]] = {}
        self.num_collectives = sum(len(self._gathers(groups)[0]) for groups in self.chunks)
        """All-gathers per version while every tensor is sharded."""

    def _gathers(self, groups: list[int]) -> tuple[list[_Gather], dict[tuple[int, int], Tensor]]:
        """The collectives of the layer groups `groups`: one per process group and dtype, over the tensors sharded
        right now (planned once per set of such tensors, then reused: a version's stream asks for every chunk), and
        this rank's shard of each of those tensors (read in the same pass: the host work is per tensor)."""
        from torch.distributed.tensor import DTensor

        local: dict[tuple[int, int], Tensor] = {}
        for k in groups:
            for i, (module, attr, _, _) in enumerate(self.plan[k]):
                if (k, i) in self.axes:
                    tensor = getattr(module, attr)
                    if isinstance(tensor, DTensor):
                        local[(k, i)] = tensor._local_tensor  # what to_local() returns without grad, minus its cost
        sharded = tuple(local)
        if sharded not in self._planned:
            by_key: dict[tuple[int, torch.dtype], _Gather] = {}
            for k, i in sharded:
                module, attr, _, _ = self.plan[k][i]
                axis, dtype = self.axes[(k, i)], self.dtypes[k][i]
                gather = by_key.setdefault((id(axis.group), dtype), _Gather(axis, dtype))
                shape = tuple(getattr(module, attr).shape)
                rows = rows_per_rank(shape[0], axis.size)
                gather.add(_Source((k, i), shape, rows, gather.send_numel, gather.whole_numel))
            self._planned[sharded] = list(by_key.values())
        return self._planned[sharded], local

    def is_gathered(self, k: int, i: int) -> bool:
        return (k, i) in self.axes

    @torch.no_grad()
    def start(self, chunk: int) -> Pending:
        """Cast this rank's shards of chunk `chunk` into send buffers and start the chunk's all-gathers. A tensor
        whose FSDP unit is unsharded right now (the root's after a forward) is left out: the stream takes it as it
        is (FSDP's state is the same on every rank, so every rank leaves out the same tensors)."""
        works = []
        gathers, local = self._gathers(self.chunks[chunk])
        for gather in gathers:
            device = gather.axis.device
            send = torch.empty(gather.send_numel, dtype=gather.dtype, device=device)
            # one split for every source's slot (each reserves ceil(R / n) rows), then a fused cast-and-copy
            slots = send.split(gather.slot_sizes)
            dsts, srcs = [], []
            for source, slot in zip(gather.sources, slots, strict=True):
                shard = local[source.key]
                if shard.shape[0] != source.rows[gather.axis.rank]:
                    raise RuntimeError(self._layout_error(source, shard, gather.axis))
                if shard.numel():
                    dsts.append(slot if slot.numel() == shard.numel() else slot[: shard.numel()])
                    srcs.append(shard.reshape(-1) if shard.device == device else shard.reshape(-1).to(device))
            if dsts:
                torch._foreach_copy_(dsts, srcs)  # the cast happens here
            received = torch.empty(gather.axis.size * gather.send_numel, dtype=gather.dtype, device=device)
            work = _all_gather_flat(received, send, gather.axis.group)
            works.append((gather, work, send, received))
        return Pending(works)

    def _layout_error(self, source: _Source, shard: Tensor, axis: ShardAxis) -> str:
        k, i = source.key
        module, attr, _, _ = self.plan[k][i]
        return (
            f"{attr} of {type(module).__name__}: this rank holds {shard.shape[0]} rows, torch.chunk says "
            f"{source.rows[axis.rank]}: the shard layout is not the one this gather assumes"
        )

    @torch.no_grad()
    def finish(self, pending: Pending) -> dict[tuple[int, int], Tensor]:
        """Wait for a chunk's gathers; its whole tensors by plan entry, laid out by one copy per gather.

        `received` holds, rank after rank, every source's slot. Seen as [ranks, send], its columns split by slot are,
        where every rank holds the same rows of every source (the common case), each whole tensor seen as [ranks,
        piece]: `torch.split_with_sizes_copy` along dim 1 writes them all (one fused kernel on CUDA: what FSDP2
        uses for its own copy-out). Otherwise the valid rows are copied rank by rank, in one `_foreach_copy_`."""
        out: dict[tuple[int, int], Tensor] = {}
        for gather, work, _, received in pending.works:
            work.wait()
            whole = torch.empty(gather.whole_numel, dtype=gather.dtype, device=received.device)
            size = gather.axis.size
            wholes = whole.split(gather.whole_sizes)
            received_RS = received.view(size, gather.send_numel)
            if gather.even:
                targets = [part.view(size, -1) for part in wholes]
                torch.split_with_sizes_copy(received_RS, gather.slot_sizes, dim=1, out=targets)
            else:
                _copy_rank_by_rank(gather, received_RS.split(gather.slot_sizes, 1), wholes)
            for source, part in zip(gather.sources, wholes, strict=True):
                out[source.key] = part.view(source.shape)
        pending.works.clear()  # the received buffers go before the next chunk's are allocated
        return out


def _copy_rank_by_rank(gather: _Gather, slots: Sequence[Tensor], wholes: Sequence[Tensor]) -> None:
    """Copy each rank's valid rows of every source from its slot (slots[s] is [ranks, slot]) into the whole."""
    dsts, srcs = [], []
    for source, slot_RS, whole_part in zip(gather.sources, slots, wholes, strict=True):
        row = 0
        for c, rows in enumerate(source.rows):
            if rows:
                dsts.append(whole_part[row * source.row_numel : (row + rows) * source.row_numel])
                srcs.append(slot_RS[c, : rows * source.row_numel])
            row += rows
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _all_gather_flat(received: Tensor, send: Tensor, group: object):
    """Start an all-gather of equal-size flat buffers into one (the name changed in torch 2.12)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(received, send, group=group, async_op=True)
