"""Delta updates over a real gloo broadcast (threads of one process): weights/send/delta_send.py's DeltaSender sends
versions to two WeightReceivers (the receive code of Slipstream's vLLM engine); every version they load is bitwise the
version sent, a corrupted delta or a stale mirror is repaired whole within the same update, and a full version goes
out first, every `full_every` versions, and at a new session."""

import threading
import time
from collections.abc import Callable

import pytest
import torch

from slipstream.weights.receive.receiver import ReceiveStats, WeightReceiver
from slipstream.weights.send import delta_send
from slipstream.weights.send.delta_send import IN_FLIGHT, DeltaSender
from slipstream.weights.send.send_watch import SessionSuperseded
from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
from slipstream.weights.wire.delta import SPARSE, Encoded
from slipstream.weights.wire.stream import Bucket, Manifest, TensorMeta
from tests.e2e.helpers import free_port

NUM_RECEIVERS = 2


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "q": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "norm": torch.randn(32, generator=g),  # float32: a bucket of its own
        "k": torch.randn(16, 32, generator=g).to(torch.bfloat16),
    }


PLAN = (
    Bucket("bfloat16", (TensorMeta("embed", "bfloat16", (64, 32)),)),
    Bucket("bfloat16", (TensorMeta("q", "bfloat16", (32, 32)), TensorMeta("k", "bfloat16", (16, 32)))),
    Bucket("float32", (TensorMeta("norm", "float32", (32,)),)),
)


def _step(model: dict[str, torch.Tensor], seed: int, fraction: float = 0.02) -> dict[str, torch.Tensor]:
    """The next version: about `fraction` of the elements change (an optimizer step in bf16 touches a few)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        out[name] = torch.where(mask, (t.float() + 0.5).to(t.dtype), t)
    return out


def _flat(model: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
    return torch.cat([model[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors])


class Session:
    """The sender's group and NUM_RECEIVERS receivers joined to it, each receiver in a thread per version."""

    def __init__(self, store, port: int, name: str, receivers: list[WeightReceiver]) -> None:
        init = GroupInit("gloo", "127.0.0.1", port, name, NUM_RECEIVERS + 1, timeout_s=60)
        joins = [threading.Thread(target=r.join, args=(init,)) for r in receivers]
        for t in joins:
            t.start()
        self.group = open_group(store, init, 0, torch.device("cpu"))
        for t in joins:
            t.join()
        self.name, self.receivers = name, receivers

    def send(
        self, sender: DeltaSender, step: int, model: dict, waiter=None, reuse: bool = False
    ) -> tuple[dict, list[dict], list[ReceiveStats]]:
        """Version `step` = `model`: (sender metrics, what each receiver loaded, each receiver's stats). `reuse`: every
        bucket passes through one buffer, overwritten as soon as `send` returns (as the gather reuses its buffers)."""
        manifest = Manifest(step, PLAN, delta=True)
        got: list[dict] = [{} for _ in self.receivers]
        stats: list[ReceiveStats | BaseException | None] = [None] * len(self.receivers)

        def receive(k: int) -> None:
            def load(pairs):
                got[k].update({n: t.clone() for n, t in pairs})

            try:
                stats[k] = self.receivers[k].receive({"step": step, "manifest": manifest.to_dict()}, load)
            except BaseException as e:  # noqa: BLE001 - handed to the test's thread
                stats[k] = e

        threads = [threading.Thread(target=receive, args=(k,)) for k in range(len(self.receivers))]
        for t in threads:
            t.start()
        sender.begin(step, PLAN, self.group, self.name, waiter)
        buffer = torch.empty(max(b.nbytes for b in PLAN), dtype=torch.uint8)
        for i, bucket in enumerate(PLAN):
            flat = _flat(model, bucket)
            if reuse:
                flat = buffer[: flat.numel()].copy_(flat)
            sender.send(i, bucket, flat)
            if reuse:
                buffer.fill_(0xFF)  # the next gather writes into it
        sender.close()
        for t in threads:
            t.join(timeout=60)
        for s in stats:
            if isinstance(s, BaseException):
                raise s
        return sender.take(), got, stats  # type: ignore[return-value]


@pytest.fixture
def transfer():
    port = free_port()
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=60)
    receivers = [WeightReceiver(torch.device("cpu"), rank_in_receivers=k) for k in range(NUM_RECEIVERS)]
    sessions: list[Session] = []

    def session(name: str) -> Session:
        sessions.append(Session(store, port, name, receivers))
        return sessions[-1]

    yield session
    for r in receivers:
        r.shutdown()
    for s in sessions:
        close_group(s.group)


def _assert_loaded(got: list[dict], model: dict) -> None:
    for loaded in got:
        assert loaded.keys() == model.keys()
        for name, t in model.items():
            assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.timeout(120)
def test_versions_arrive_bitwise_as_deltas_with_a_full_one_every_k(transfer):
    session = transfer("s1")
    sender = DeltaSender(full_every=3, device=torch.device("cpu"))
    model = _model()
    full_bytes = sum(b.nbytes for b in PLAN)
    modes = []
    for step in range(1, 6):
        if step > 1:
            model = _step(model, seed=step)
        metrics, got, stats = session.send(sender, step, model)
        _assert_loaded(got, model)
        assert metrics["weights/full_bytes"] == full_bytes
        assert metrics["weights/delta_resent_buckets"] == 0 and all(s.delta.repaired == 0 for s in stats)
        assert all(s.delta.wire_bytes == metrics["weights/delta_bytes_sent"] for s in stats)
        modes.append(metrics["weights/delta_full_version"])
        if metrics["weights/delta_full_version"]:
            assert metrics["weights/delta_full_buckets"] == len(PLAN)
        else:
            assert metrics["weights/delta_sparse_buckets"] == len(PLAN)
            assert metrics["weights/delta_bytes_sent"] < full_bytes / 4  # 2% changed: ~6% of the bytes
        if step > 1:
            assert 0.005 < metrics["weights/changed_fraction"] < 0.05
    assert modes == [1.0, 0.0, 0.0, 1.0, 0.0]  # the first version, then every third
    assert sender.take() == {}  # taken once


def _corrupting(step: int, bucket_index: int, where: str) -> Callable:
    """delta_send.encode, but the payload of one bucket of `step` is damaged after its checksum was taken."""
    encode = delta_send.encode
    calls = {"n": 0}

    def damaged(new, old, size, full=False) -> Encoded:
        encoded = encode(new, old, size, full=full)
        index = calls["n"] % len(PLAN)
        calls["n"] += 1
        if calls["n"] > (step - 1) * len(PLAN) and index == bucket_index and calls["n"] <= step * len(PLAN):
            assert encoded.header.mode == SPARSE and encoded.header.count > 2
            payload = encoded.payload.clone()
            if where == "value":
                payload[-1] ^= 0x01
            else:
                indices = payload[: encoded.header.count * 4].view(torch.int32)
                indices[0], indices[1] = indices[1].clone(), indices[0].clone()
            return Encoded(encoded.header, payload, encoded.changed)
        return encoded

    return damaged


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["value", "indices"])
def test_a_corrupted_delta_is_never_loaded_and_goes_again_whole(transfer, monkeypatch, where):
    session = transfer("s1")
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    monkeypatch.setattr(delta_send, "encode", _corrupting(step=2, bucket_index=1, where=where))
    v1 = _model()
    session.send(sender, 1, v1)
    v2 = _step(v1, seed=2)
    loads: list[list[str]] = []
    receiver = session.receivers[0]
    real_receive = receiver.receive

    def watched(info, load, direct=None):  # the order of receiver 0's loader calls
        return real_receive(info, lambda pairs: (loads.append([n for n, _ in pairs]), load(pairs)), direct)

    monkeypatch.setattr(receiver, "receive", watched)
    metrics, got, stats = session.send(sender, 2, v2)
    _assert_loaded(got, v2)  # bit-identical to a full send of version 2
    assert loads == [["embed"], ["norm"], ["q", "k"]]  # bucket 1 only after the repair round, whole
    assert metrics["weights/delta_resent_buckets"] == 1 and all(s.delta.repaired == 1 for s in stats)
    assert metrics["weights/delta_bytes_sent"] == stats[0].delta.wire_bytes
    # the mirrors hold version 2 again: version 3 goes as a delta and arrives whole
    v3 = _step(v2, seed=3)
    metrics, got, stats = session.send(sender, 3, v3)
    _assert_loaded(got, v3)
    assert metrics["weights/delta_sparse_buckets"] == len(PLAN) and metrics["weights/delta_resent_buckets"] == 0


@pytest.mark.timeout(120)
def test_a_stale_mirror_on_one_receiver_is_repaired_for_that_receiver(transfer):
    session = transfer("s1")
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    v1 = _model()
    session.send(sender, 1, v1)
    session.receivers[1].mirror.flats[0][5] ^= 0x10  # receiver 1's copy of bucket 0 is not version 1 any more
    del session.receivers[0].mirror.flats[2]  # receiver 0 lost bucket 2's copy: nothing to apply a delta onto
    v2 = _step(v1, seed=2)
    metrics, got, stats = session.send(sender, 2, v2)
    _assert_loaded(got, v2)
    assert metrics["weights/delta_resent_buckets"] == 2
    assert [s.delta.repaired for s in stats] == [1, 1]


@pytest.mark.timeout(120)
def test_a_new_session_starts_with_a_full_version(transfer):
    first = transfer("s1")
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    v1 = _model()
    first.send(sender, 1, v1)
    v2 = _step(v1, seed=2)
    assert first.send(sender, 2, v2)[0]["weights/delta_full_version"] == 0.0
    second = transfer("s2")  # the receivers joined a new session (a restart): their mirrors are gone
    assert all(not r.mirror.flats for r in second.receivers)
    v3 = _step(v2, seed=3)
    metrics, got, _ = second.send(sender, 3, v3)
    assert metrics["weights/delta_full_version"] == 1.0 and metrics["weights/delta_resent_buckets"] == 0
    _assert_loaded(got, v3)


def _alone() -> "torch.distributed.ProcessGroup":
    """A gloo group of the sender alone: its broadcasts and all-reduces complete at once (the sender's bookkeeping)."""
    import datetime

    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, datetime.timedelta(seconds=10))


def _send_all(
    sender: DeltaSender, step: int, model: dict, group, session: str, plan=PLAN, close=True, waiter=None
) -> dict:
    sender.begin(step, plan, group, session, waiter)
    for i, bucket in enumerate(plan):
        sender.send(i, bucket, _flat(model, bucket))
    if close:
        sender.close()
    return sender.take()


def test_an_attempt_that_never_completed_or_a_new_plan_makes_the_next_version_whole():
    group = _alone()
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    v1 = _model()
    v2 = _step(v1, seed=2)
    assert _send_all(sender, 1, v1, group, "s")["weights/delta_full_version"] == 1.0
    assert _send_all(sender, 2, v2, group, "s")["weights/delta_full_version"] == 0.0
    v3 = _step(v2, seed=3)
    assert _send_all(sender, 3, v3, group, "s", close=False) == {}  # the attempt failed before its repair round
    assert _send_all(sender, 3, v3, group, "s")["weights/delta_full_version"] == 1.0  # sent again: whole
    v4 = _step(v3, seed=4)
    assert _send_all(sender, 4, v4, group, "s")["weights/delta_full_version"] == 0.0
    plan = (PLAN[1], PLAN[0], PLAN[2])  # another bucket plan
    assert _send_all(sender, 5, _step(v4, seed=5), group, "s", plan=plan)["weights/delta_full_version"] == 1.0
    with pytest.raises(RuntimeError, match="2 of 3 buckets were sent"):
        sender.begin(6, PLAN, group, "s")
        for i in (0, 1):
            sender.send(i, PLAN[i], _flat(v4, PLAN[i]))
        sender.close()
    assert sender.previous == {} and sender.take() == {}
    with pytest.raises(ValueError, match="full_every must be >= 1"):
        DeltaSender(full_every=0, device=torch.device("cpu"))


def _polling(calls: list) -> Callable:
    """A waiter (send_watch.SendWatch's role) that polls until the work is done, counting its calls."""

    def wait(done: Callable[[], bool]) -> None:
        calls.append(1)
        while not done():
            time.sleep(0.001)

    return wait


@pytest.mark.timeout(120)
def test_queued_sends_from_a_reused_buffer_arrive_bitwise_and_wait_through_the_waiter(transfer):
    """What a CUDA sender does (broadcasts queued; it waits only beyond IN_FLIGHT buckets and for the repair round's
    flags, through the waiter), over gloo, whose works run on the group's own thread: the bytes that go out are the
    sender's kept copy, never the caller's buffer, which the next bucket overwrites before the broadcast ran."""
    session = transfer("s1")
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    sender.queue_sends = True
    model = _model()
    for step in range(1, 4):
        if step > 1:
            model = _step(model, seed=step)
        calls: list = []
        metrics, got, stats = session.send(sender, step, model, waiter=_polling(calls), reuse=True)
        _assert_loaded(got, model)
        assert metrics["weights/delta_resent_buckets"] == 0 and all(s.delta.repaired == 0 for s in stats)
        assert metrics["weights/delta_full_version"] == float(step == 1)
        # every work is waited for through the waiter: each bucket's header and payload (a sparse bucket with no
        # change has none), and the flags
        assert len(PLAN) + 1 <= len(calls) <= 2 * len(PLAN) + 1
        if step == 1:
            assert len(calls) == 2 * len(PLAN) + 1 and IN_FLIGHT < len(PLAN)


def test_a_waiter_that_finds_the_receivers_lost_fails_the_attempt_and_the_next_goes_whole():
    group = _alone()
    sender = DeltaSender(full_every=10, device=torch.device("cpu"))
    sender.queue_sends = True
    v1 = _model()
    v2 = _step(v1, seed=2)
    assert _send_all(sender, 1, v1, group, "s", waiter=_polling([]))["weights/delta_full_version"] == 1.0

    def lost(done: Callable[[], bool]) -> BaseException:
        return SessionSuperseded("inference took the weights of step 2 in session t")

    with pytest.raises(SessionSuperseded):
        _send_all(sender, 2, v2, group, "s", waiter=lost)  # at the first wait: the bucket beyond IN_FLIGHT
    assert sender.previous == {} and sender.take() == {}
    assert _send_all(sender, 2, v2, group, "s", waiter=_polling([]))["weights/delta_full_version"] == 1.0
