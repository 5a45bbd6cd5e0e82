"""Assembling a weight stream into buckets on the sender: a stream yields each layer's runs of tensors; they are
copied (and cast) straight into reused bucket buffers, and each complete bucket goes to the sinks (safetensors
shards, a broadcast: weights/wire/stream.py) on a sender thread while later layers are gathered."""

import contextlib
import itertools
import queue
import threading
from collections.abc import Iterator
from typing import NamedTuple, Protocol

import torch

from slipstream.weights.wire.stream import Bucket, BucketSink, Manifest


class Run(NamedTuple):
    """Consecutive tensors of a stream: `names` in stream order and their values, either one tensor (`stacked`
    False, one name) or stacked along dim 0 (a layer's experts of one projection). The values may be in any dtype
    (the bucket's dtype is what travels) and are only valid until the stream's next layer is requested."""

    names: list[str]
    tensor: torch.Tensor
    stacked: bool


class LayerStream(Protocol):
    """A weight stream: `layers()` yields, in stream order, each layer's runs (every rank: gathers are collectives)."""

    def layers(self) -> Iterator[list[Run]]: ...


class BucketBuffers:
    """The flat buffers a sender assembles buckets in, kept from one version to the next (the plan is the same every
    step). Each dtype has its own ring of up to `num_slots` buffers: the buckets of one dtype open and complete one
    after the other (plan_buckets), so the k-th bucket of a dtype is written into slot k % slots of its ring once the
    bucket that used the slot before has been sent. Memory: at most `num_slots` buckets per dtype, whatever the model
    size. The typed views of the tensors inside each bucket are made once per plan, so assembling a layer costs one
    fused copy, not a view, a cast and a concatenation per tensor."""

    def __init__(self, num_slots: int = 3) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (one filling while one is sent), got {num_slots}")
        self.num_slots = num_slots
        self.buckets: tuple[Bucket, ...] | None = None
        self.slots: dict[str, list[torch.Tensor]] = {}
        self.offsets: list[list[int]] = []
        self.ring: list[tuple[str, int]] = []
        """Per bucket: (its dtype, its place among that dtype's buckets)."""
        self.ring_size: dict[str, int] = {}
        self.bucket_at: dict[tuple[str, int], int] = {}
        self.views: dict[tuple[int, int, int, bool], torch.Tensor] = {}
        self.cond = threading.Condition()
        self.released: dict[int, torch.cuda.Event | None] = {}
        """Sent buckets -> the CUDA event their send completes at (None off CUDA: the send was synchronous)."""

    def start(self, buckets: tuple[Bucket, ...]) -> None:
        """Begin a version sent with this plan (buffers and views are kept when the plan did not change)."""
        if buckets != self.buckets:
            self.buckets, self.slots, self.views = buckets, {}, {}
            self.offsets = [list(itertools.accumulate((t.nbytes for t in b.tensors), initial=0)) for b in buckets]
            counts: dict[str, int] = {}
            self.ring = []
            for bucket in buckets:
                self.ring.append((bucket.dtype, counts.get(bucket.dtype, 0)))
                counts[bucket.dtype] = counts.get(bucket.dtype, 0) + 1
            self.ring_size = {dtype: min(self.num_slots, n) for dtype, n in counts.items()}
            self.bucket_at = {place: index for index, place in enumerate(self.ring)}
        with self.cond:
            self.released = {}

    def _slot(self, index: int) -> torch.Tensor:
        dtype, k = self.ring[index]
        return self.slots[dtype][k % self.ring_size[dtype]]

    def acquire(self, index: int, device: torch.device) -> None:
        """Wait until bucket `index` may be written (the bucket that used its slot before was released)."""
        assert self.buckets is not None
        dtype, k = self.ring[index]
        if dtype not in self.slots:
            size = max(b.nbytes for b in self.buckets if b.dtype == dtype)
            self.slots[dtype] = [
                torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.ring_size[dtype])
            ]
        if k >= self.ring_size[dtype]:
            before = self.bucket_at[(dtype, k - self.ring_size[dtype])]
            with self.cond:
                self.cond.wait_for(lambda: before in self.released)
                sent = self.released[before]
            if sent is not None:  # the send was only queued on its stream: write after it completes on the GPU
                torch.cuda.current_stream(device).wait_event(sent)

    def release(self, index: int, sent: "torch.cuda.Event | None" = None) -> None:
        """Bucket `index` was sent (on CUDA: queued; `sent` is recorded where the send completes on the GPU)."""
        with self.cond:
            self.released[index] = sent
            self.cond.notify_all()

    def flat(self, index: int) -> torch.Tensor:
        assert self.buckets is not None
        return self._slot(index)[: self.buckets[index].nbytes]

    def view(self, index: int, position: int, count: int, stacked: bool) -> torch.Tensor:
        """Tensors `position .. position + count` of bucket `index`, typed and shaped ([count, *shape] if stacked)."""
        key = (index, position, count, stacked)
        view = self.views.get(key)
        if view is None:
            assert self.buckets is not None
            meta = self.buckets[index].tensors[position]
            start, end = self.offsets[index][position], self.offsets[index][position + count]
            shape = (count, *meta.shape) if stacked else meta.shape
            view = self.views[key] = self._slot(index)[start:end].view(getattr(torch, meta.dtype)).view(shape)
        return view


class BucketAssembler:
    """Copies the streamed runs straight into their buckets' buffers (casting to the bucket's dtype on the way: one
    fused copy per layer) and hands each bucket to the sinks as soon as it is complete, in plan order. Raises if the
    stream disagrees with the plan (a name or shape the receivers do not expect)."""

    def __init__(self, buckets: list[Bucket], sinks: list[BucketSink], buffers: BucketBuffers | None = None) -> None:
        self.buckets, self.sinks = buckets, sinks
        self.buffers = buffers if buffers is not None else BucketBuffers()
        self.buffers.start(tuple(buckets))
        self.expected = {t.name: (i, p, t) for i, b in enumerate(buckets) for p, t in enumerate(b.tensors)}
        self.opened = [False] * len(buckets)
        self.counts = [0] * len(buckets)
        self.next_bucket = 0
        self.num_bytes_sent = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_runs([Run([name], tensor, False)])

    def add_run(self, names: list[str], stacked: torch.Tensor) -> None:
        self.add_runs([Run(names, stacked, True)])

    @torch.no_grad()
    def add_runs(self, runs: list[Run]) -> None:
        """Write `runs` (consecutive in the stream) into their buckets, then send every bucket now complete."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for names, tensor, stacked in runs:
            if stacked and tensor.shape[0] != len(names):
                raise ValueError(f"weight stream: a run of {len(names)} names with {tensor.shape[0]} stacked tensors")
            if not stacked and len(names) != 1:
                raise ValueError(f"weight stream: {len(names)} names for one tensor")
            shape = tuple(tensor.shape[1:] if stacked else tensor.shape)
            start = 0
            while start < len(names):
                index, position = self._take(names[start], shape)
                end = start + 1
                while end < len(names) and self.expected.get(names[end], (None, None))[:2] == (
                    index,
                    position + end - start,
                ):
                    self._take(names[end], shape)
                    end += 1
                if not self.opened[index]:
                    # Send what is complete first: the slot may be waiting for one of those buckets to go out.
                    _copy(dsts, srcs)
                    dsts, srcs = [], []
                    self._flush()
                    self.buffers.acquire(index, tensor.device)
                    self.opened[index] = True
                dsts.append(self.buffers.view(index, position, end - start, stacked))
                srcs.append(tensor[start:end] if stacked and end - start < len(names) else tensor)
                self.counts[index] += end - start
                start = end
        _copy(dsts, srcs)
        self._flush()

    def _take(self, name: str, shape: tuple[int, ...]) -> tuple[int, int]:
        index, position, meta = self.expected.pop(name, (None, None, None))
        if meta is None:
            raise ValueError(f"weight stream: {name!r} is not in the plan, or came twice")
        if shape != meta.shape:
            raise ValueError(f"weight stream: {name!r} has shape {shape} but the plan says {meta}")
        return index, position

    def _flush(self) -> None:
        while self.next_bucket < len(self.buckets):
            i, bucket = self.next_bucket, self.buckets[self.next_bucket]
            if self.counts[i] < len(bucket.tensors):
                return
            for sink in self.sinks:
                sink.send(i, bucket, self.buffers.flat(i))
            self.num_bytes_sent += bucket.nbytes
            self.next_bucket += 1

    def finish(self) -> None:
        if self.expected or self.next_bucket != len(self.buckets):
            missing = sorted(self.expected)[:5]
            raise ValueError(f"weight stream ended before {len(self.expected)} tensor(s) arrived, e.g. {missing}")
        for sink in self.sinks:
            sink.close()


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst <- src for each pair, cast to dst's dtype, in one fused call."""
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def stream_to(
    stream: LayerStream, manifest: Manifest, sinks: list[BucketSink], buffers: BucketBuffers | None = None
) -> None:
    """Iterate the stream's layers (every rank: the gathers are collectives), assemble the buckets in `buffers`
    (kept by the caller from one version to the next) and hand each complete bucket to the sinks on a background
    thread, so sending bucket k overlaps with gathering the layers after it."""
    if not sinks:
        for _ in stream.layers():
            pass
        return
    buffers = buffers if buffers is not None else BucketBuffers()
    jobs: queue.Queue = queue.Queue()
    failure: list[BaseException] = []
    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    # On CUDA the sends run on their own stream, ordered after each bucket's copies by an event (not after
    # everything queued on the copy stream by then, which would hold bucket k's send behind the copies of later
    # buckets that wait for earlier sends): copies of bucket k+1 overlap the send of bucket k on the GPU.
    send_stream = torch.cuda.Stream() if on_cuda else None

    def worker() -> None:
        context = torch.cuda.stream(send_stream) if send_stream is not None else contextlib.nullcontext()
        with context:
            while (job := jobs.get()) is not None:
                index, bucket, flat, ready = job
                sent = None
                try:
                    if not failure:
                        if ready is not None:
                            send_stream.wait_event(ready)
                        for sink in sinks:
                            sink.send(index, bucket, flat)
                        if send_stream is not None:
                            sent = send_stream.record_event()
                except BaseException as e:  # noqa: BLE001 - handed to the producer, which re-raises it
                    failure.append(e)
                finally:
                    buffers.release(index, sent)

    class _Queued:
        def send(self, index: int, bucket, flat) -> None:
            ready = torch.cuda.current_stream(flat.device).record_event() if flat.is_cuda else None
            jobs.put((index, bucket, flat, ready))

        def close(self) -> None:
            pass

    thread = threading.Thread(target=worker, name="slipstream-weight-send", daemon=True)
    thread.start()
    assembler = BucketAssembler(list(manifest.buckets), [_Queued()], buffers)
    try:
        for runs in stream.layers():
            if failure:
                raise failure[0]
            assembler.add_runs(runs)
        assembler.finish()
    finally:
        jobs.put(None)
        thread.join()
    if failure:
        raise failure[0]
    if send_stream is not None:  # the caller's stream sees every send done (sinks close, buffers are rewritten)
        torch.cuda.current_stream().wait_stream(send_stream)
    for sink in sinks:
        sink.close()
