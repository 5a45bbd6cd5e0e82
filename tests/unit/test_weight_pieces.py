"""A bucket sent by several trainer ranks, each its own rows (weights/wire/pieces.py): the layout on the wire, the copy
that lays the tensors out whole, and the manifest's rows table (JSON round trip and every malformed table refused)."""

import math

import pytest
import torch

from slipstream.weights.wire.pieces import piece_layout
from slipstream.weights.wire.stream import Bucket, Manifest, TensorMeta, unpack

SHAPES = [(5, 3), (3,), (), (4, 2, 2), (0, 7)]
ROWS = ((3, 2), (0, 3), (1, 0), (2, 2), (0, 0))
"""Uneven rows, a tensor held by one sender, a 0-d tensor (one row), an empty tensor."""


def _tensors() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(shape, dtype=torch.float32) for shape in SHAPES]


def _wire(tensors, rows) -> torch.Tensor:
    """What the senders put on the wire: sender 0's rows of every tensor, then sender 1's."""
    parts = []
    for q in range(len(rows[0])):
        for t, split in zip(tensors, rows, strict=True):
            flat = t.reshape(t.shape[0] if t.dim() else 1, math.prod(t.shape[1:]))
            start = sum(split[:q])
            parts.append(flat[start : start + split[q]].reshape(-1))
    return torch.cat(parts).view(torch.uint8)


def test_pieces_are_laid_out_whole_by_one_copy():
    tensors = _tensors()
    layout = piece_layout(SHAPES, 4, ROWS)
    assert layout.piece_bytes == ((3 * 3 + 0 + 1 + 2 * 4) * 4, (2 * 3 + 3 + 0 + 2 * 4) * 4)
    assert layout.piece_starts == (0, layout.piece_bytes[0])
    wire = _wire(tensors, ROWS)
    assert wire.numel() == layout.nbytes
    whole = torch.full((layout.nbytes,), 255, dtype=torch.uint8)
    layout.reassemble(wire, whole)
    bucket = Bucket("float32", tuple(TensorMeta(f"t{i}", "float32", s) for i, s in enumerate(SHAPES)), ROWS)
    got = dict(unpack(whole, bucket))
    for i, t in enumerate(tensors):
        assert torch.equal(got[f"t{i}"], t), i
    # sender q's own rows of tensor j: where its copy goes in the wire buffer
    assert layout.own[1][0] == (layout.piece_starts[1], 2 * 3 * 4)
    assert layout.own[0][1] == (layout.own[0][0][1], 0)


def test_one_sender_is_the_plain_layout():
    bucket = Bucket("float32", tuple(TensorMeta(f"t{i}", "float32", s) for i, s in enumerate(SHAPES)))
    assert bucket.senders == 1 and bucket.layout.piece_bytes == (bucket.nbytes,)
    assert bucket.layout.wire_sizes == bucket.layout.whole_sizes and list(bucket.layout.order) == sorted(
        bucket.layout.order
    )


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (((3, 1), (0, 3), (1, 0), (2, 2), (0, 0)), "adding up to 5"),
        (((3, 2), (0, 3), (1, 0), (2, 2)), "rows table of 4 tensors"),
        (((3, 2), (0, 3, 0), (1, 0), (2, 2), (0, 0)), "must be 2 counts"),
        (((6, -1), (0, 3), (1, 0), (2, 2), (0, 0)), ">= 0"),
    ],
)
def test_a_bad_rows_table_is_refused(rows, message):
    with pytest.raises(ValueError, match=message):
        piece_layout(SHAPES, 4, rows)


def _manifest(senders: int = 2) -> Manifest:
    metas = tuple(TensorMeta(f"t{i}", "float32", s) for i, s in enumerate(SHAPES))
    rows = ROWS if senders == 2 else None
    second = Bucket("bfloat16", (TensorMeta("u", "bfloat16", (5, 3)),), ((5, 0),) if rows else None)
    return Manifest(3, (Bucket("float32", metas, rows), second), senders)


def test_manifest_with_senders_round_trips_and_one_sender_keeps_the_old_format():
    manifest = _manifest()
    data = manifest.to_dict()
    assert data["senders"] == 2 and data["buckets"][0]["rows"] == [list(r) for r in ROWS]
    assert Manifest.from_dict(data) == manifest
    assert Manifest.from_dict(data).buckets[0].rows == ROWS
    plain = _manifest(1).to_dict()
    assert "senders" not in plain and all("rows" not in b for b in plain["buckets"])
    assert Manifest.from_dict(plain) == _manifest(1)


def test_manifest_rows_are_checked():
    data = _manifest().to_dict()
    bad = {**data, "buckets": [{**data["buckets"][0], "rows": [[5, 1]] + data["buckets"][0]["rows"][1:]}]}
    with pytest.raises(ValueError, match=r"buckets\[0\]: tensor 0 of shape \[5, 3\]"):
        Manifest.from_dict(bad)
    missing = {**data, "buckets": [{k: v for k, v in data["buckets"][0].items() if k != "rows"}]}
    with pytest.raises(ValueError, match="'rows' must list"):
        Manifest.from_dict(missing)
    with pytest.raises(ValueError, match="'senders' must be an integer >= 1"):
        Manifest.from_dict({**data, "senders": 0})
    with pytest.raises(ValueError, match="'rows' table but the manifest has one sender"):
        Manifest.from_dict({**data, "senders": 1})
    with pytest.raises(ValueError, match="split among 1 sender"):
        Manifest(1, _manifest(1).buckets, senders=2)
