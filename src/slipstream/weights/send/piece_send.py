"""Every trainer rank sends the rows it holds (weights/wire/pieces.py): no gather on the trainer, each byte crosses the
link once. Rank q of the trainer is sender q of the transfer group; for each bucket in plan order it casts its rows
of the bucket's tensors into its piece (one fused copy per bucket, from views planned once) and broadcasts it on its
own lane (weights/wire/collective.py's Lanes: sender q and every receiver), side by side with the other senders, so
every receiver ends up with the whole bucket. When the version is also written to disk, rank 0 gets the other
senders' pieces over the trainer's own process group.

A model takes this path when each of its published tensors is either the same on every rank (a plain tensor, or a
DTensor replicated along every mesh dimension of size > 1: sender 0 sends it) or a DTensor sharded on dim 0 along
one mesh dimension that spans every trainer rank (FSDP2 over the whole trainer, or expert parallelism alone), and
the stream publishes tensors as the model holds them (no LoRA to fold in, no layout conversion of transformers'
fused experts). Anything else (HSDP, experts sharded twice by FSDP x EP) is streamed by rank 0 after a gather
(export.HFWeightStream); `PieceSender.plan` says which.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slipstream.weights.send.export import HFWeightStream
from slipstream.weights.send.shard_gather import rows_per_rank, shard_axis
from slipstream.weights.wire.pieces import row_count
from slipstream.weights.wire.stream import Bucket, BucketSink, Manifest, start_broadcast, start_pieces

NUM_SLOTS = 3
"""Bucket buffers per sender: one being filled while the two before it are still on the wire."""


@dataclass(frozen=True)
class _Source:
    """How one published tensor is held: `ranks[c]` holds rows chunk c of dim 0 (torch.chunk), or, with `ranks`
    None, every rank holds it whole."""

    module: nn.Module
    attr: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...] | None

    def rows(self) -> list[int]:
        assert self.ranks is not None
        return rows_per_rank(self.shape[0], len(self.ranks))


@dataclass(frozen=True)
class _Copy:
    """One copy of a version into this rank's piece: rows [lo, hi) of the source's local rows (None: all of them) into
    `count` consecutive tensors of the bucket at byte `offset` (`shape`: the destination view's)."""

    source: _Source
    lo: int | None
    hi: int | None
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    first_row: int
    """The first of this rank's rows within the whole tensor (to take them when the tensor is unsharded now)."""
    rows: int
    """This rank's rows of the source."""


class NotDirect(ValueError):
    """The model cannot be sent piece by piece (the message says why): stream it whole from rank 0."""


def _source(module: nn.Module, attr: str, world: int) -> _Source:
    from torch.distributed.tensor import DTensor, Replicate

    tensor = getattr(module, attr)
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return _Source(module, attr, shape, None)
    mesh = tensor.device_mesh
    if all(isinstance(p, Replicate) or mesh.size(d) == 1 for d, p in enumerate(tensor.placements)):
        return _Source(module, attr, shape, None)
    axis = shard_axis(tensor)
    if axis is None or axis.size != world:
        raise NotDirect(f"{attr} of {type(module).__name__} is sharded as {tensor.placements} over {mesh}")
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    if sorted(ranks) != list(range(world)):
        raise NotDirect(f"{attr} of {type(module).__name__}: its mesh {ranks} is not the trainer's {world} ranks")
    return _Source(module, attr, shape, ranks)


class PieceSender:
    """One trainer rank's side of a piece-by-piece stream of `stream`'s model, in the bucket plan `buckets` (the
    bucket plan of one sender; `manifest` adds who sends which rows). Build it once per model on every rank; raises
    NotDirect for a model this path cannot send."""

    def __init__(self, stream: HFWeightStream, buckets: tuple[Bucket, ...], rank: int, world: int) -> None:
        from slipstream.models.common.lora import has_lora

        if has_lora(stream.model):
            raise NotDirect("LoRA adapters are folded into the weights on the way")
        if stream.transposed:
            raise NotDirect("some tensors are published transposed from the model's layout")
        self.rank, self.world = rank, world
        where: dict[str, tuple[_Source, int | None]] = {}
        for group in stream.plan:
            for module, attr, names, first in group:
                source = _source(module, attr, world)
                for j, name in enumerate(names):
                    where[name] = (source, None if first is None else first + j)
        shapes = {t.name: t.shape for b in buckets for t in b.tensors}
        for name, (source, index) in where.items():  # transformers' layout conversions that only reorder are fine
            shape = source.shape if index is None else source.shape[1:]
            if shapes.get(name) != shape:
                raise NotDirect(f"{name} is published as {shapes.get(name)} from a tensor of shape {source.shape}")
        if len(shapes) != len(where):
            raise NotDirect("the published tensors are not the model's (transformers' converted experts)")
        rows_of = {name: self._rows(source, index, shapes[name]) for name, (source, index) in where.items()}
        if world > 1:
            buckets = tuple(Bucket(b.dtype, b.tensors, tuple(rows_of[t.name] for t in b.tensors)) for b in buckets)
        self.buckets = buckets
        self.copies = [self._copies(b, where) for b in buckets]
        self.slots: list[Tensor] = []
        self.views: dict[tuple[int, int], list[Tensor]] = {}
        self.ahead = 0
        """Buckets 0 .. ahead - 1 are in their slots already (`prepare`), for the next `send` only."""

    def manifest(self, step: int) -> Manifest:
        return Manifest(step, self.buckets, self.world)

    def _rows(self, source: _Source, index: int | None, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Rows per sender of a published tensor of `shape`: index `index` of the source's dim 0, or the whole."""
        out = [0] * self.world
        if source.ranks is None:
            out[0] = row_count(shape)
            return tuple(out)
        chunks = source.rows()
        if index is None:
            for c, rank in enumerate(source.ranks):
                out[rank] = chunks[c]
            return tuple(out)
        start = 0
        for c, rank in enumerate(source.ranks):
            if start <= index < start + chunks[c]:
                out[rank] = row_count(shape)
                return tuple(out)
            start += chunks[c]
        raise AssertionError(f"index {index} outside the {source.shape[0]} rows of {source.attr}")

    def _copies(self, bucket: Bucket, where: dict[str, tuple[_Source, int | None]]) -> list[_Copy]:
        """This rank's copies into its piece of `bucket`: consecutive stacked tensors of one source become one."""
        copies: list[_Copy] = []
        for (offset, nbytes), meta in zip(bucket.layout.own[self.rank], bucket.tensors, strict=True):
            if not nbytes:
                continue
            source, index = where[meta.name]
            first_row, rows = self._own_rows(source)
            if index is None:
                shape = source.shape if source.ranks is None else (rows, *source.shape[1:])
                copies.append(_Copy(source, None, None, offset, nbytes, shape, first_row, rows))
                continue
            local = index - first_row
            last = copies[-1] if copies else None
            if last is not None and last.source is source and last.hi == local and last.offset + last.nbytes == offset:
                copies[-1] = _Copy(
                    source, last.lo, local + 1, last.offset, last.nbytes + nbytes, (last.shape[0] + 1, *meta.shape),
                    first_row, rows,
                )  # fmt: skip
            else:
                copies.append(_Copy(source, local, local + 1, offset, nbytes, (1, *meta.shape), first_row, rows))
        return copies

    def _own_rows(self, source: _Source) -> tuple[int, int]:
        """(first row, rows) of the source that this rank holds."""
        if source.ranks is None:
            return 0, source.shape[0] if source.shape else 1
        chunks = source.rows()
        c = source.ranks.index(self.rank)
        return sum(chunks[:c]), chunks[c]

    def _views(self, b: int, slot: int) -> list[Tensor]:
        views = self.views.get((b, slot))
        if views is None:
            dtype = getattr(torch, self.buckets[b].dtype)
            buf = self.slots[slot]
            views = self.views[(b, slot)] = [
                buf[c.offset : c.offset + c.nbytes].view(dtype).view(c.shape) for c in self.copies[b]
            ]
        return views

    @torch.no_grad()
    def _fill(self, b: int, slot: int) -> None:
        """Cast this rank's rows of bucket b into its piece (one fused copy)."""
        from torch.distributed.tensor import DTensor

        srcs = []
        for c in self.copies[b]:
            tensor = getattr(c.source.module, c.source.attr)
            if isinstance(tensor, DTensor):
                tensor = tensor._local_tensor  # what to_local() returns without grad, minus its cost
            elif c.source.ranks is not None:  # its FSDP unit is unsharded right now: take this rank's rows
                tensor = tensor[c.first_row : c.first_row + c.rows]
            held = c.rows if c.source.ranks is not None else c.source.shape[0] if c.source.shape else None
            if held is not None and tensor.shape[0] != held:
                raise RuntimeError(
                    f"{c.source.attr} of {type(c.source.module).__name__}: this rank holds {tensor.shape[0]} rows where "
                    f"the sender planned {held}: its sharding changed since the publisher was built"
                )
            if c.lo is not None:
                tensor = tensor[c.lo : c.hi]
            srcs.append(tensor)
        if srcs:
            torch._foreach_copy_(self._views(b, slot), srcs)

    def _ensure_slots(self, device: torch.device) -> None:
        size = max(b.nbytes for b in self.buckets)
        if not self.slots or self.slots[0].numel() < size or self.slots[0].device != device:
            n = min(NUM_SLOTS, len(self.buckets))
            self.slots, self.views = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(n)], {}

    def prepare(self, device: torch.device) -> None:
        """Cast the first buckets (one per slot) ahead of the next `send`, which then starts their broadcasts back to
        back: the publisher calls it before it waits for the receivers, so the casts that used to hold the first small
        buckets back (the sender's host queued each in ~140 us, against 87-366 us of link for the first three of the
        0.6B shape) overlap that wait. Every trainer rank calls it alike (or none); valid for the next `send` only, with
        the weights unchanged in between."""
        if not self.buckets:
            return
        self._ensure_slots(device)
        self.ahead = len(self.slots)
        for b in range(self.ahead):
            self._fill(b, b)

    def send(
        self,
        group,
        device: torch.device,
        files: BucketSink | None = None,
        collect: bool = False,
        observers: tuple[BucketSink, ...] = (),
    ) -> None:
        """Send one version: every bucket, this rank's piece broadcast on its lane of `group` (the session's Lanes; one
        trainer rank: the session's group). Every trainer rank calls this at the same time. `collect` (every rank
        alike): rank 0 also gets every other rank's piece, over the trainer's default process group, and hands each
        whole bucket to `files` (rank 0's safetensors shards of checkpoint steps). `observers` (one trainer rank only,
        whose piece is the whole bucket) see each bucket as it is sent, without waiting for the send
        (weights/send/changes.py). Raises what a group raises (a receiver that died); the caller closes the group."""
        if not self.buckets:
            return
        if observers and self.world > 1:
            raise ValueError("bucket observers need the whole bucket: one trainer rank only")
        collect = collect and self.world > 1
        if files is not None and self.world > 1 and not (collect and self.rank == 0):
            raise ValueError("whole buckets for files need collect=True on every rank, and files on rank 0 only")
        ahead, self.ahead = self.ahead, 0
        if ahead and self.slots[0].device != device:
            raise ValueError(f"buckets prepared on {self.slots[0].device}, sent from {device}")
        self._ensure_slots(device)
        size = max(b.nbytes for b in self.buckets)
        whole = torch.empty(size, dtype=torch.uint8, device=device) if files is not None and self.world > 1 else None
        cuda = device.type == "cuda"
        pending: dict[int, list] = {}
        """Bucket -> its sends still in flight (CUDA: each runs on its group's NCCL stream, after the fill)."""
        for b, bucket in enumerate(self.buckets):
            slot = b % len(self.slots)
            for work in pending.pop(b - len(self.slots), ()):
                work.wait()  # the buffer's last sends are done before it is filled again (CUDA: the stream waits)
            if b >= ahead:
                self._fill(b, slot)
            wire = self.slots[slot][: bucket.nbytes]
            # No stream of our own: a group's collective waits for what the current stream queued (this fill), and
            # runs on its own NCCL stream, so the next fill goes on at once (one stream switch and two events fewer
            # per bucket on the sender's host, which the first small buckets wait for).
            works = start_pieces(group, wire, bucket.layout) if self.world > 1 else [start_broadcast(group, wire)]
            for observer in observers:  # reads `wire` on this stream, before its next fill
                observer.send(b, bucket, wire)
            if collect:
                works += self._collect(wire, bucket)
            if files is not None or not cuda:
                for work in works:
                    work.wait()  # gloo: this thread waits
                works = []
            if files is not None:
                flat = wire
                if whole is not None:
                    flat = whole[: bucket.nbytes]
                    bucket.layout.reassemble(wire, flat)
                files.send(b, bucket, flat)
            pending[b] = works
        for works in pending.values():
            for work in works:
                work.wait()
        if files is not None:
            files.close()

    def _collect(self, wire: Tensor, bucket: Bucket) -> list:
        """Start moving every other rank's piece of `wire` to rank 0 (its place in rank 0's `wire`)."""
        import torch.distributed as dist

        starts, sizes = bucket.layout.piece_starts, bucket.layout.piece_bytes
        if self.rank == 0:
            ops = [dist.P2POp(dist.irecv, wire[starts[q] : starts[q] + sizes[q]], q) for q in range(1, self.world)]
        else:
            ops = [dist.P2POp(dist.isend, wire[starts[self.rank] : starts[self.rank] + sizes[self.rank]], 0)]
        ops = [op for op in ops if op.tensor.numel()]
        return dist.batch_isend_irecv(ops) if ops else []
