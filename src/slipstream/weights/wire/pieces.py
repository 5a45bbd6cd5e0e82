"""A bucket sent by several trainer ranks at once, each sending the rows it holds (its FSDP shard) instead of one rank
gathering the whole model first: every byte then crosses the link once, not twice (all-gather, then broadcast).

Sender q's *piece* of a bucket is, tensor after tensor in bucket order, the rows of that tensor it holds (a
tensor's rows are its first-dim slices; a 0-d tensor is one row). On the wire a bucket's buffer is piece 0, then
piece 1, ...: each sender broadcasts its own piece as the root of its lane (weights/wire/collective.py), into the same
offsets on every receiver. Receivers then lay the tensors out whole (tensor after tensor, as one sender would have
sent them) with one copy (a `torch.cat` of the wire's segments in the whole layout's order), and hand them on exactly
as before; or, once the loads are a copy plan (weights/receive/copy_plan.py), its copies read each sender's rows where
they arrived on the wire (`PieceLayout.runs`), and no bucket is laid out. A `Bucket.rows` table (from
the manifest) says how many rows of each tensor each sender holds.
"""

import functools
import itertools
from dataclasses import dataclass

import torch


def row_count(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of this shape: its first dim (a 0-d tensor is one row)."""
    return shape[0] if shape else 1


@dataclass(frozen=True)
class PieceLayout:
    """Where every sender's rows of every tensor of one bucket lie, on the wire and once laid out whole (bytes)."""

    piece_bytes: tuple[int, ...]
    """Size of each sender's piece."""
    piece_starts: tuple[int, ...]
    """Where each sender's piece starts in the bucket's wire buffer."""
    wire_sizes: tuple[int, ...]
    """The wire buffer cut into (sender, tensor) segments, sender-major, empty segments left out."""
    whole_sizes: tuple[int, ...]
    """The whole layout cut into (tensor, sender) segments, tensor-major, empty segments left out."""
    order: tuple[int, ...]
    """order[i]: the index in `whole_sizes` of wire segment i."""
    own: tuple[tuple[tuple[int, int], ...], ...]
    """own[q][j]: (offset in the wire buffer, bytes) of sender q's rows of tensor j."""

    @property
    def nbytes(self) -> int:
        return sum(self.piece_bytes)

    @functools.cached_property
    def _wire_order(self) -> tuple[int, ...]:
        """_wire_order[k]: the wire segment that is segment k of the whole layout."""
        inverse = [0] * len(self.order)
        for i, k in enumerate(self.order):
            inverse[k] = i
        return tuple(inverse)

    def in_whole_order(self, wire: torch.Tensor) -> list[torch.Tensor]:
        """The segments of `wire` (uint8, this layout) in the order of the whole layout: concatenated, they are the
        tensors laid out whole."""
        segments = wire.split(self.wire_sizes)
        return [segments[i] for i in self._wire_order]

    def runs(
        self, j: int, offset: int, shape: tuple[int, ...], stride: tuple[int, ...], itemsize: int
    ) -> list[tuple[int, int, int]] | None:
        """Where a strided view of tensor j lies on the wire: the view is `offset` bytes from the tensor's first byte
        once laid out whole, `shape` and `stride` (elements) with its largest stride first. Returns, per run of
        indices along the view's first dim whose bytes one sender holds, (first index, end index, wire offset of the
        run's first byte); None when some index's bytes straddle two senders (copy that view from the whole layout).
        A 0-d view is one index."""
        if not shape:
            shape, stride = (1,), (0,)
        inner = itemsize * (1 + sum((n - 1) * s for n, s in zip(shape[1:], stride[1:], strict=True)))
        step = stride[0] * itemsize
        runs, covered, start = [], 0, 0
        for pieces in self.own:  # sender after sender
            wire_at, size = pieces[j]
            lo, hi = start, start + size  # this sender's rows of tensor j, laid out whole
            start = hi
            if not size:
                continue
            if step == 0:  # one index (size 1): the view's bytes lie with one sender or straddle
                first, end = (0, 1) if lo <= offset and offset + inner <= hi else (0, 0)
            else:
                first = max(0, -(-(lo - offset) // step))
                end = min(shape[0], (hi - inner - offset) // step + 1)
            if end <= first:
                continue
            if first != covered:
                return None
            runs.append((first, end, wire_at + offset + first * step - lo))
            covered = end
        return runs if covered == shape[0] else None

    def reassemble(self, wire: torch.Tensor, whole: torch.Tensor) -> None:
        """Lay the tensors of `wire` out whole in `whole` (uint8, same size): one `torch.cat` into it. On CUDA its
        batched kernel copied a 657 MiB bucket's 122 segments at 1.4 TB/s against 0.9 TB/s for `_foreach_copy_`
        (H200, benchmarks/RESULTS.md), and needs no host sync (unlike `torch.split_with_sizes_copy`, whose plan is
        uploaded from pageable memory)."""
        concat(self.in_whole_order(wire), whole)


def concat(segments: list[torch.Tensor], out: torch.Tensor) -> None:
    """`torch.cat(segments, out=out)`; nothing for no segments (an empty bucket)."""
    if segments:
        torch.cat(segments, out=out)


def piece_layout(shapes: list[tuple[int, ...]], element_size: int, rows: tuple[tuple[int, ...], ...]) -> PieceLayout:
    """The layout of a bucket whose tensors have these shapes and element size, sender q holding rows[j][q] rows of
    tensor j (validated: each tensor's rows add up to its row count)."""
    if len(rows) != len(shapes):
        raise ValueError(f"a rows table of {len(rows)} tensors for a bucket of {len(shapes)}")
    senders = len(rows[0]) if rows else 1
    row_bytes = []
    for j, (shape, split) in enumerate(zip(shapes, rows, strict=True)):
        if len(split) != senders or any(r < 0 for r in split) or sum(split) != row_count(shape):
            raise ValueError(
                f"tensor {j} of shape {list(shape)}: rows per sender {list(split)} must be {senders} counts >= 0 "
                f"adding up to {row_count(shape)}"
            )
        numel = 1
        for size in shape[1:]:
            numel *= size
        row_bytes.append(numel * element_size)
    sizes = [[split[q] * row_bytes[j] for j, split in enumerate(rows)] for q in range(senders)]
    piece_bytes = tuple(sum(s) for s in sizes)
    piece_starts = tuple(itertools.accumulate(piece_bytes, initial=0))[:-1]
    # whole layout: tensor j, then sender q within it; index of each non-empty (j, q) segment in that order
    whole_index: dict[tuple[int, int], int] = {}
    whole_sizes = []
    for j in range(len(rows)):
        for q in range(senders):
            if sizes[q][j]:
                whole_index[(j, q)] = len(whole_sizes)
                whole_sizes.append(sizes[q][j])
    wire_sizes, order, own = [], [], []
    for q in range(senders):
        offset, mine = piece_starts[q], []
        for j in range(len(rows)):
            mine.append((offset, sizes[q][j]))
            if sizes[q][j]:
                wire_sizes.append(sizes[q][j])
                order.append(whole_index[(j, q)])
            offset += sizes[q][j]
        own.append(tuple(mine))
    return PieceLayout(piece_bytes, piece_starts, tuple(wire_sizes), tuple(whole_sizes), tuple(order), tuple(own))
