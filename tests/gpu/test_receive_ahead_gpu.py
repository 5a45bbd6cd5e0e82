"""On a CUDA GPU: a receiver posting its receives ahead (`weights.receive_buffers`, weights/receive/bucket_receive.py)
never lets a receive overwrite a buffer whose bucket the caller's stream has not loaded yet, with one sender and with
two senders' pieces (laid out whole by one copy), into the reused buffers and into staging's (a buffer per bucket,
few wire buffers).

The receives are simulated on the receive stream receive_buckets queues them from (a short GPU delay, then a copy of
the bucket's bytes into its buffer), so one GPU runs them; NCCL itself needs two. The caller's loads hold its stream
far longer (a GPU delay before each copy out), so a receive that did not wait for the loads of its buffer's last
bucket lands in the middle of them and the copy reads a later bucket. The control runs the same receives off the
receive stream (ignoring the buffers' free events) and must see exactly that.

Not run in CI (marked gpu)."""

import math

import pytest
import torch

from slipstream.weights.receive import bucket_receive
from slipstream.weights.receive.bucket_receive import ReceiveBuffers, receive_buckets
from slipstream.weights.wire.collective import Lanes
from slipstream.weights.wire.stream import Bucket, Manifest, TensorMeta, plan_buckets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")
RECEIVE_CYCLES = 20_000
"""GPU clock cycles before each simulated receive lands (~10 us)."""
LOAD_CYCLES = 2_000_000
"""Cycles the caller's stream waits before it copies a bucket out (~1 ms): far longer than a receive."""
NUM_TENSORS = 12


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{k}.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16) for k in range(NUM_TENSORS)}


def _manifest(senders: int) -> Manifest:
    """One tensor a bucket (12 buckets); with 2 senders each holds half of every tensor's rows."""
    metas = [TensorMeta.of(n, t) for n, t in _tensors().items()]
    if senders == 1:
        return Manifest(1, tuple(plan_buckets(metas, 64 * 32 * 2)))
    return Manifest(1, tuple(Bucket("bfloat16", (m,), ((32, 32),)) for m in metas), senders=2)


def _wire(bucket: Bucket, senders: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bucket's bytes as they arrive: the tensors whole (one sender), or every sender's rows in its piece."""
    if senders == 1:
        return torch.cat([tensors[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors])
    wire = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    for rank in range(senders):
        for meta, (offset, nbytes), split in zip(bucket.tensors, bucket.layout.own[rank], bucket.rows, strict=True):
            t = tensors[meta.name]
            rows = t.reshape(t.shape[0], math.prod(t.shape[1:]))[sum(split[:rank]) : sum(split[: rank + 1])]
            wire[offset : offset + nbytes] = rows.reshape(-1).view(torch.uint8)
    return wire


class _Work:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


def _receive_all(senders: int, buffers: ReceiveBuffers, off_stream: bool) -> dict[str, torch.Tensor]:
    tensors = _tensors()
    manifest = _manifest(senders)
    wires = [_wire(b, senders, tensors).to(CUDA) for b in manifest.buckets]
    side = torch.cuda.Stream()

    def receive(group, manifest, buffers, i):  # on the receive stream, as a broadcast would be queued
        stream = side if off_stream else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(RECEIVE_CYCLES)
            (buffers.flat(i) if senders == 1 else buffers.wire(i)).copy_(wires[i])
            event = torch.cuda.Event()
            event.record()
        return [_Work(event)]

    got: dict[str, torch.Tensor] = {}
    original = bucket_receive._start
    bucket_receive._start = receive
    try:
        group = Lanes((None,) * senders) if senders > 1 else None
        for pairs in receive_buckets(group, manifest, CUDA, buffers):
            torch.cuda._sleep(LOAD_CYCLES)  # the caller's loads: its stream is busy long after the host moved on
            got.update({n: t.clone() for n, t in pairs})
    finally:
        bucket_receive._start = original
    torch.cuda.synchronize()
    return got


def _wrong(got: dict[str, torch.Tensor]) -> list[str]:
    return [n for n, t in _tensors().items() if not torch.equal(got[n].cpu().view(torch.uint8), t.view(torch.uint8))]


@pytest.mark.parametrize("senders", [1, 2])
@pytest.mark.parametrize("buffers", ["2", "3", "5", "staging"])
def test_receives_posted_ahead_never_overwrite_a_bucket_before_its_loads(senders, buffers):
    into = ReceiveBuffers(CUDA, keep_all=True) if buffers == "staging" else ReceiveBuffers(CUDA, num_slots=int(buffers))
    assert _wrong(_receive_all(senders, into, off_stream=False)) == []


@pytest.mark.parametrize("senders", [1, 2])
def test_control_receives_that_ignore_the_free_buffers_overwrite_them(senders):
    """The detector works: the same receives queued off the receive stream overwrite buckets not yet loaded."""
    assert len(_wrong(_receive_all(senders, ReceiveBuffers(CUDA, num_slots=2), off_stream=True))) > 0
