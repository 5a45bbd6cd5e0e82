"""A receiver with n bucket buffers (`weights.receive_buffers`, GroupInit.receive_buffers) posts the receives of the
n - 1 buckets after the one it hands to its loader, never more (a later receive would overwrite a bucket still being
loaded): the policy on a recorded receive, then a real gloo broadcast into receivers of 2, 3 and more buffers than the
plan has buckets, bitwise."""

import threading

import pytest
import torch

from slipstream.weights.receive import bucket_receive
from slipstream.weights.receive.bucket_receive import ReceiveBuffers, receive_buckets
from slipstream.weights.receive.receiver import WeightReceiver
from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
from slipstream.weights.wire.stream import Manifest, TensorMeta, broadcast, plan_buckets
from tests.e2e.helpers import free_port

CPU = torch.device("cpu")


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    """8 layers of 2 KiB and a float32 norm: 9 buckets of the plan below."""
    g = torch.Generator().manual_seed(seed)
    model = {f"layers.{k}.weight": torch.randn(32, 32, generator=g).to(torch.bfloat16) for k in range(8)}
    return model | {"norm": torch.randn(32, generator=g)}


PLAN = tuple(plan_buckets([TensorMeta.of(n, t) for n, t in _model().items()], 2048))


@pytest.mark.parametrize("num_slots", [2, 3, 5, 64])
def test_receives_are_posted_as_far_ahead_as_there_are_free_buffers(monkeypatch, num_slots):
    events: list[tuple[str, int]] = []

    def record(group, manifest, buffers, i):  # a receive that lands at once: bucket i's bytes all i + 1
        events.append(("receive", i))
        buffers.flat(i).fill_(i + 1)
        return []

    monkeypatch.setattr(bucket_receive, "_start", record)
    manifest = Manifest(1, PLAN)
    buffers = ReceiveBuffers(CPU, num_slots=num_slots)
    n = len(PLAN)
    assert n == 9
    for i, pairs in enumerate(receive_buckets(None, manifest, CPU, buffers)):
        received = [j for kind, j in events if kind == "receive"]
        assert received == list(range(min(n, i + num_slots))), (i, events)  # this bucket and the next n - 1
        assert all((t.view(torch.uint8) == i + 1).all() for _, t in pairs), f"bucket {i} was overwritten"
        events.append(("load", i))
    assert len(buffers.slots) == min(num_slots, n)


def test_fewer_than_two_buffers_are_refused():
    with pytest.raises(ValueError, match="weights.receive_buffers"):
        ReceiveBuffers(CPU, num_slots=1)
    with pytest.raises(ValueError, match="receive_buffers must be an integer >= 2"):
        GroupInit("gloo", "127.0.0.1", 1, "s", 2, receive_buffers=1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("receive_buffers", [2, 3, 100])
def test_a_broadcast_arrives_bitwise_whatever_the_buffers(receive_buffers):
    port = free_port()
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=30)
    receiver = WeightReceiver(CPU)
    init = GroupInit("gloo", "127.0.0.1", port, "s1", 2, timeout_s=30, receive_buffers=receive_buffers)
    join = threading.Thread(target=receiver.join, args=(init,))
    join.start()
    group = open_group(store, init, 0, CPU)
    join.join()
    version = _model(seed=3)
    got: dict[str, torch.Tensor] = {}

    def send() -> None:
        for bucket in PLAN:
            broadcast(group, torch.cat([version[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors]))

    sender = threading.Thread(target=send)
    try:
        sender.start()
        stats = receiver.receive(
            {"step": 1, "manifest": Manifest(1, PLAN).to_dict()},
            lambda pairs: got.update({n: t.clone() for n, t in pairs}),
        )
        sender.join(timeout=60)
        assert stats.num_tensors == len(version) and not sender.is_alive()
        assert len(receiver.buffers.slots) == min(receive_buffers, len(PLAN))
    finally:
        receiver.shutdown()
        close_group(group)
    assert got.keys() == version.keys()
    assert all(torch.equal(got[n].view(torch.uint8), version[n].view(torch.uint8)) for n in version)
