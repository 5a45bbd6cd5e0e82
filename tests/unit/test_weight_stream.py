"""The weight stream's bucket plan and assembly: buckets group one dtype, close when the next tensor would overflow
them and complete in plan order; tensors are cast into reused bucket buffers and round-trip; a slot is rewritten only
after the bucket before it was sent; a stream that disagrees with its plan is refused."""

import threading

import pytest
import torch

from slipstream.weights.wire.bucket_assembly import BucketAssembler, BucketBuffers, Run, stream_to
from slipstream.weights.wire.stream import Manifest, TensorMeta, plan_buckets, plan_pipelined, unpack


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


def test_assembler_casts_runs_into_reused_buffers_and_round_trips():
    metas = [_meta(f"e{i}", "bfloat16", 2, 3) for i in range(4)] + [_meta("o", "bfloat16", 3)]
    buckets = plan_buckets(metas, bucket_bytes=2 * 12 + 6)  # e0 e1 | e2 e3 o: a run of four spans two buckets
    sent: list[tuple[int, dict[str, torch.Tensor], int]] = []

    class Sink:
        def send(self, index, bucket, flat):
            sent.append((index, {n: t.clone() for n, t in unpack(flat, bucket)}, flat.data_ptr()))

        def close(self):
            pass

    buffers = BucketBuffers(num_slots=2)
    for version in range(2):  # the second version reuses the first one's buffers
        stacked = torch.randn(4, 2, 3) + version  # float32 values: cast to the plan's bfloat16 on the way in
        other = torch.randn(3)
        asm = BucketAssembler(buckets, [Sink()], buffers)
        asm.add_run([f"e{i}" for i in range(4)], stacked)
        asm.add("o", other)
        asm.finish()
        got = {n: t for _, tensors, _ in sent[-2:] for n, t in tensors.items()}
        assert all(torch.equal(got[f"e{i}"], stacked[i].bfloat16()) for i in range(4))
        assert torch.equal(got["o"], other.bfloat16()) and got["o"].dtype == torch.bfloat16
    assert [i for i, _, _ in sent] == [0, 1, 0, 1]
    assert len({ptr for _, _, ptr in sent}) == 2  # two slots, reused
    with pytest.raises(ValueError, match="num_slots"):
        BucketBuffers(num_slots=1)


def test_assembler_sends_each_bucket_once_complete_and_refuses_a_stream_off_the_plan():
    metas = [_meta(f"x{i}", "float32", 2) for i in range(4)]
    buckets = plan_buckets(metas, bucket_bytes=16)  # two tensors a bucket
    sent: list[tuple[int, list[float]]] = []

    class Sink:
        def send(self, index, bucket, flat):
            sent.append((index, flat.view(torch.float32).tolist()))

        def close(self):
            sent.append((-1, []))

    buffers = BucketBuffers(num_slots=2)
    asm = BucketAssembler(buckets, [Sink()], buffers)
    asm.add("x0", torch.zeros(2))
    assert sent == []
    asm.add_run(["x1", "x2"], torch.ones(2, 2))  # a run that spans two buckets is split between them
    assert sent == [(0, [0.0, 0.0, 1.0, 1.0])]
    asm.add("x3", torch.full((2,), 3.0))
    asm.finish()
    assert sent[1:] == [(1, [1.0, 1.0, 3.0, 3.0]), (-1, [])]
    with pytest.raises(ValueError, match="not in the plan, or came twice"):
        BucketAssembler(buckets, []).add("nope", torch.zeros(2))
    with pytest.raises(ValueError, match="but the plan says"):
        BucketAssembler(buckets, []).add("x0", torch.zeros(3))
    with pytest.raises(ValueError, match="2 stacked tensors"):
        BucketAssembler(buckets, []).add_run(["x0"], torch.zeros(2, 2))
    short = BucketAssembler(buckets, [])
    short.add("x0", torch.zeros(2))
    with pytest.raises(ValueError, match="ended before 3 tensor"):
        short.finish()


def test_slots_wait_for_the_bucket_sent_before():
    """With two slots, bucket 2 reuses bucket 0's buffer: writing it waits until bucket 0 was released."""
    metas = [_meta(f"x{i}", "float32", 2) for i in range(3)]
    buckets = plan_buckets(metas, bucket_bytes=8)
    buffers = BucketBuffers(num_slots=2)
    asm = BucketAssembler(buckets, [], buffers)
    asm.add("x0", torch.zeros(2))
    asm.add("x1", torch.zeros(2))
    done = threading.Event()
    writer = threading.Thread(target=lambda: (asm.add("x2", torch.zeros(2)), done.set()))
    writer.start()
    assert not done.wait(0.2)
    buffers.release(0)
    assert done.wait(5)
    writer.join()


def test_stream_to_sends_every_bucket_through_the_sender_thread():
    metas = [_meta(f"l{k}.w", "bfloat16", 4) for k in range(5)]
    buckets = plan_buckets(metas, bucket_bytes=16)  # two layers a bucket, three buckets, two slots
    values = [torch.randn(4) for _ in range(5)]

    class Stream:
        def layers(self):
            for k, v in enumerate(values):
                yield [Run([f"l{k}.w"], v, False)]

    got: dict[str, torch.Tensor] = {}

    class Sink:
        def send(self, index, bucket, flat):
            got.update({n: t.clone() for n, t in unpack(flat, bucket)})

        def close(self):
            pass

    stream_to(Stream(), Manifest(1, tuple(buckets)), [Sink()], BucketBuffers(num_slots=2))
    assert all(torch.equal(got[f"l{k}.w"], values[k].bfloat16()) for k in range(5))


def test_a_layer_spanning_more_buckets_than_slots_is_sent_as_it_goes():
    """One layer's runs fill five buckets with two slots: completed buckets go out before a slot is reused."""
    metas = [_meta(f"x{i}", "float32", 2) for i in range(5)]
    buckets = plan_buckets(metas, bucket_bytes=8)
    values = torch.arange(10, dtype=torch.float32).view(5, 2)

    class Stream:
        def layers(self):
            yield [Run([f"x{i}"], values[i], False) for i in range(5)]

    got: list[list[float]] = []

    class Sink:
        def send(self, index, bucket, flat):
            got.append(flat.view(torch.float32).tolist())

        def close(self):
            pass

    stream_to(Stream(), Manifest(1, tuple(buckets)), [Sink()], BucketBuffers(num_slots=2))
    assert got == values.tolist()


def test_each_dtype_has_its_own_ring_of_slots():
    """A bf16 model with a few float32 tensors (GLM's selection bias): buckets of both dtypes interleave, each dtype
    reuses at most num_slots buffers (never one per bucket), and every value arrives."""
    metas = []
    for k in range(6):
        metas += [_meta(f"l{k}.w", "bfloat16", 8), _meta(f"l{k}.bias", "float32", 2)]
    buckets = plan_buckets(metas, bucket_bytes=16)  # one bf16 tensor, two fp32 tensors a bucket
    assert {b.dtype for b in buckets} == {"bfloat16", "float32"} and len(buckets) == 9
    values = {m.name: torch.randn(m.shape) for m in metas}

    class Stream:
        def layers(self):
            for k in range(6):
                yield [Run([f"l{k}.w"], values[f"l{k}.w"], False), Run([f"l{k}.bias"], values[f"l{k}.bias"], False)]

    got: dict[str, torch.Tensor] = {}
    pointers: dict[str, set[int]] = {"bfloat16": set(), "float32": set()}

    class Sink:
        def send(self, index, bucket, flat):
            pointers[bucket.dtype].add(flat.data_ptr())
            got.update({n: t.clone() for n, t in unpack(flat, bucket)})

        def close(self):
            pass

    buffers = BucketBuffers(num_slots=2)
    for _ in range(2):  # the second version reuses the first one's buffers
        stream_to(Stream(), Manifest(1, tuple(buckets)), [Sink()], buffers)
    assert len(pointers["bfloat16"]) == 2 and len(pointers["float32"]) == 2
    for name, value in values.items():
        want = value if name.endswith("bias") else value.bfloat16()
        assert torch.equal(got[name], want), name


def test_unpack_gives_shaped_views_of_the_buffer_and_refuses_a_wrong_size():
    """A bucket's tensors are views of its flat bytes, in plan order and shape (zero-size tensors included); a buffer
    of another size than the plan says is refused."""
    from slipstream.weights.wire.stream import Bucket

    tensors = {"w": torch.randn(3, 4), "empty": torch.empty(0, 5), "b": torch.randn(7), "s": torch.randn(())}
    bucket = Bucket("float32", tuple(TensorMeta.of(n, t) for n, t in tensors.items()))
    flat = torch.cat([t.reshape(-1) for t in tensors.values()]).view(torch.uint8)
    views = unpack(flat, bucket)
    assert [n for n, _ in views] == list(tensors)
    for (name, view), want in zip(views, tensors.values(), strict=True):
        assert view.shape == want.shape and view.dtype == torch.float32 and torch.equal(view, want), name
    views[0][1].fill_(1.0)  # a view: writes reach the buffer
    assert torch.equal(flat[:48].view(torch.float32), torch.ones(12))
    with pytest.raises(ValueError, match="bucket of 4 bytes but its tensors take"):
        unpack(flat[:4], bucket)
    assert unpack(torch.empty(0, dtype=torch.uint8), Bucket("bfloat16", ())) == []


def test_a_plan_parsed_before_is_reused_only_when_it_is_the_same():
    """Receivers parse every version's manifest; the same plan (the usual case) is taken from the last parse, with
    the new step; a plan that differs in any name, shape or dtype is parsed and validated anew."""
    import json

    metas = [_meta(f"w{i}", "bfloat16", 4, i + 1) for i in range(50)] + [_meta("n", "float32", 3)]
    plan = tuple(plan_buckets(metas, bucket_bytes=256))
    first = Manifest.from_dict(json.loads(Manifest(1, plan).to_json()))
    again = Manifest.from_dict(json.loads(Manifest(2, plan).to_json()))
    assert again == Manifest(2, plan) and first == Manifest(1, plan)
    assert again.buckets is first.buckets  # reused, not re-parsed
    changed = json.loads(Manifest(3, plan).to_json())
    changed["buckets"][0]["tensors"][1][1] = [4, 9]  # one shape differs
    parsed = Manifest.from_dict(changed)
    assert parsed.buckets is not first.buckets and parsed.buckets[0].tensors[1].shape == (4, 9)
    bad = json.loads(Manifest(4, plan).to_json())
    bad["buckets"][0]["tensors"][0][1] = [4, -1]
    with pytest.raises(ValueError, match=r"buckets\[0\]\.tensors\[0\]"):
        Manifest.from_dict(bad)
    with pytest.raises(ValueError, match="'step'"):
        Manifest.from_dict(json.loads(Manifest(2, plan).to_json()) | {"step": -1})


def test_pipelined_buckets_ramp_up_and_down_with_large_tensors_mid_stream():
    metas = [TensorMeta("embed", "float32", (40,))]  # 160 bytes: more than a quarter of a bucket
    metas += [TensorMeta(f"t{i}", "float32", (4,)) for i in range(60)]  # 16 bytes each
    metas += [TensorMeta("norm", "bfloat16", (4,)), TensorMeta("head", "float32", (32,))]  # 8 and 128 bytes
    buckets = plan_pipelined(metas, bucket_bytes=256, edge_bytes=16)
    f32 = [b for b in buckets if b.dtype == "float32"]
    # up from 16 bytes, doubling; then at most half of what is left, down to 16 bytes
    assert [b.nbytes for b in f32] == [16, 32, 64, 128, 240, 160, 256, 176, 80, 48, 16, 16, 16]
    # the large tensors go where half of the others' bytes are behind them (after t29), in their order
    assert [t.name for t in f32[5].tensors] == ["embed"] and [t.name for t in f32[6].tensors[:2]] == ["head", "t30"]
    assert f32[4].tensors[-1].name == "t29"
    assert [b.tensors for b in buckets if b.dtype == "bfloat16"] == [(metas[-2],)]  # each dtype apart
    names = [t.name for b in f32 for t in b.tensors if t.name.startswith("t")]
    assert names == [f"t{i}" for i in range(60)]  # the others keep their order
    assert sorted(t.name for b in buckets for t in b.tensors) == sorted(m.name for m in metas)  # each once
    alone = plan_pipelined([TensorMeta("big", "float32", (100,))], bucket_bytes=64, edge_bytes=16)
    assert [b.nbytes for b in alone] == [400]  # larger than a bucket: alone
    with pytest.raises(ValueError, match="bucket sizes"):
        plan_pipelined(metas, 256, 0)
