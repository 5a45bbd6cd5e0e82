"""A bucket sent by several trainer ranks at once, each sending the rows it holds (its FSDP shard) instead of one rank
gathering the whole model first: every byte then crosses the link once, not twice (all-gather, then broadcast).

Sender q's *piece* of a bucket is, tensor after tensor in bucket order, the rows of that tensor it holds (a
tensor's rows are its first-dim slices; a 0-d tensor is one row). On the wire a bucket's buffer is piece 0, then
piece 1, ...: each sender broadcasts its own piece as the root, into the same offsets on every member. Receivers
then lay the tensors out whole (tensor after tensor, as one sender would have sent them) with one copy
(`torch.split_with_sizes_copy`), and hand them on exactly as before. A `Bucket.rows` table (from the manifest) says
how many rows of each tensor each sender holds.
"""

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

    def segments(self, wire: torch.Tensor, whole: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations in `whole`, sources in `wire`) of the copy that lays the tensors of `wire` (uint8, this
        layout) out whole in `whole` (uint8, same size): equal-size flat segments, so `_foreach_copy_` takes its
        multi-tensor path on CUDA. (Not `torch.split_with_sizes_copy`: its CUDA kernel uploads its plan from pageable
        host memory, which makes the host wait for everything queued on the stream, the receive of this bucket.)"""
        targets = whole.split(self.whole_sizes)
        return [targets[i] for i in self.order], list(wire.split(self.wire_sizes))

    def reassemble(self, wire: torch.Tensor, whole: torch.Tensor) -> None:
        """Lay the tensors of `wire` out whole in `whole` (one fused copy; see `segments`)."""
        torch._foreach_copy_(*self.segments(wire, whole))


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
