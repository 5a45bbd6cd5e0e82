"""The weight stream's bucket plan, packing and assembly: buckets group one dtype, close when the next tensor would
overflow them and complete in plan order; packed bytes round-trip; a stream that disagrees with its plan is refused."""

import pytest
import torch

from slipstream.transport.weight_stream import (
    BucketAssembler,
    Manifest,
    TensorMeta,
    pack,
    plan_buckets,
    unpack,
)


def _meta(name: str, dtype: str, *shape: int) -> TensorMeta:
    return TensorMeta(name, dtype, tuple(shape))


def test_buckets_group_one_dtype_and_close_in_completion_order():
    metas = [
        _meta("a", "bfloat16", 10),  # 20 bytes
        _meta("n", "float32", 2),  # 8 bytes
        _meta("b", "bfloat16", 10),
        _meta("c", "bfloat16", 30),  # 60 bytes: larger than a bucket, travels alone
        _meta("d", "bfloat16", 5),
    ]
    buckets = plan_buckets(metas, bucket_bytes=40)
    assert [[t.name for t in b.tensors] for b in buckets] == [["a", "b"], ["c"], ["d"], ["n"]]
    assert [b.dtype for b in buckets] == ["bfloat16", "bfloat16", "bfloat16", "float32"]
    assert [b.nbytes for b in buckets] == [40, 60, 10, 8]
    manifest = Manifest(3, tuple(buckets))
    assert Manifest.from_dict(manifest.to_dict()) == manifest and manifest.nbytes == 118
    with pytest.raises(ValueError, match="manifest version"):
        Manifest.from_dict({**manifest.to_dict(), "version": 99})


def test_pack_takes_back_to_back_slices_as_one_run_and_round_trips():
    stacked = torch.arange(24, dtype=torch.bfloat16).view(4, 6)
    other = torch.randn(3, dtype=torch.bfloat16)
    flat = pack([stacked[0:2], stacked[2:4], other])
    assert flat.dtype == torch.uint8 and flat.numel() == (24 + 3) * 2
    bucket = plan_buckets([_meta(f"e{i}", "bfloat16", 6) for i in range(4)] + [_meta("o", "bfloat16", 3)], 1 << 20)[0]
    got = dict(unpack(flat, bucket))
    assert all(torch.equal(got[f"e{i}"], stacked[i]) for i in range(4)) and torch.equal(got["o"], other)


def test_assembler_sends_each_bucket_once_complete_and_refuses_a_stream_off_the_plan():
    metas = [_meta(f"x{i}", "float32", 2) for i in range(4)]
    buckets = plan_buckets(metas, bucket_bytes=16)  # two tensors a bucket
    sent: list[tuple[int, list[torch.Tensor]]] = []

    class Sink:
        def send(self, index, bucket, segments):
            sent.append((index, segments))

        def close(self):
            sent.append((-1, []))

    asm = BucketAssembler(buckets, [Sink()])
    asm.add("x0", torch.zeros(2))
    assert sent == []
    asm.add_run(["x1", "x2"], torch.ones(2, 2))  # a run that spans two buckets is split between them
    assert [i for i, _ in sent] == [0]
    asm.add("x3", torch.zeros(2))
    asm.finish()
    assert [i for i, _ in sent] == [0, 1, -1] and [s.shape[0] for s in sent[1][1]] == [1, 1]
    with pytest.raises(ValueError, match="not in the plan, or came twice"):
        BucketAssembler(buckets, []).add("nope", torch.zeros(2))
    with pytest.raises(ValueError, match="but the plan says"):
        BucketAssembler(buckets, []).add("x0", torch.zeros(3))
    with pytest.raises(ValueError, match="but the plan says"):
        BucketAssembler(buckets, []).add("x0", torch.zeros(2, dtype=torch.bfloat16))
    short = BucketAssembler(buckets, [])
    short.add("x0", torch.zeros(2))
    with pytest.raises(ValueError, match="ended before 3 tensor"):
        short.finish()
