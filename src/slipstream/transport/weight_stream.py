"""The weight stream: a model's tensors in Hugging Face names, in dtype-grouped buckets, from the trainer to any sink
(safetensors shards on disk, or a broadcast over a torch.distributed group) and back out on the receiving side.

The bucket plan is computed from metadata alone (names, dtypes, shapes in stream order), so sender and receivers
agree on every byte boundary before the first byte moves: a tensor joins the open bucket of its dtype, and a bucket
is closed when the next tensor of that dtype would overflow it (a tensor larger than a bucket travels alone). The
plan's order is the order in which buckets complete, so a sender can ship each bucket as soon as its last tensor
has been gathered while later layers are still being gathered.
"""

import functools
import json
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of the stream: HF name, dtype name (`bfloat16`), full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * element_size(self.dtype)

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> "TensorMeta":
        return TensorMeta(name, dtype_name(tensor.dtype), tuple(tensor.shape))


@functools.cache
def element_size(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Bucket:
    """Tensors of one dtype that travel as one flat buffer, in this order."""

    dtype: str
    tensors: tuple[TensorMeta, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class Manifest:
    """What one weight version's stream holds: its step and bucket plan (JSON on the wire and on disk)."""

    step: int
    buckets: tuple[Bucket, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "version": MANIFEST_VERSION,
            "step": self.step,
            "buckets": [
                {"dtype": b.dtype, "tensors": [[t.name, list(t.shape)] for t in b.tensors]} for b in self.buckets
            ],
        }

    @staticmethod
    def from_dict(data: dict) -> "Manifest":
        if data.get("version") != MANIFEST_VERSION:
            raise ValueError(
                f"weight manifest version {data.get('version')!r}; this Slipstream reads {MANIFEST_VERSION}"
            )
        buckets = tuple(
            Bucket(b["dtype"], tuple(TensorMeta(name, b["dtype"], tuple(shape)) for name, shape in b["tensors"]))
            for b in data["buckets"]
        )
        return Manifest(int(data["step"]), buckets)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Buckets for tensors arriving in this order (see the module docstring), in the order they complete."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte (got {bucket_bytes})")
    closed: list[Bucket] = []
    open_: dict[str, list[TensorMeta]] = {}
    for meta in metas:
        current = open_.setdefault(meta.dtype, [])
        if current and sum(t.nbytes for t in current) + meta.nbytes > bucket_bytes:
            closed.append(Bucket(meta.dtype, tuple(current)))
            current = open_[meta.dtype] = []
        current.append(meta)
    closed += [Bucket(dtype, tuple(ts)) for dtype, ts in open_.items() if ts]
    return closed


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer holding the tensors' bytes back to back. Tensors that already lie back to back in one
    storage (the experts of a stacked [E, ...] tensor) are taken as one run, so a layer's experts cost one copy."""
    runs: list[torch.Tensor] = []
    storage, start, end = None, 0, 0
    for t in tensors:
        t = t.contiguous()
        offset, size = t.storage_offset() * t.element_size(), t.numel() * t.element_size()
        if storage is not None and t.untyped_storage().data_ptr() == storage.data_ptr() and offset == end:
            end += size
            continue
        if storage is not None:
            runs.append(_byte_view(storage, start, end, t.device))
        storage, start, end = t.untyped_storage(), offset, offset + size
    if storage is not None:
        runs.append(_byte_view(storage, start, end, tensors[-1].device))
    return runs[0] if len(runs) == 1 else torch.cat(runs)


def _byte_view(storage: torch.UntypedStorage, start: int, end: int, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, start, (end - start,), (1,))


def unpack(flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` (uint8) for each tensor of `bucket`."""
    out, offset = [], 0
    for meta in bucket.tensors:
        size = meta.nbytes
        tensor = flat[offset : offset + size].view(getattr(torch, meta.dtype)).view(meta.shape)
        out.append((meta.name, tensor))
        offset += size
    if offset != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} bytes but its tensors take {offset}")
    return out


class RunStream(Protocol):
    """A weight stream: `runs()` yields (names, stacked) for consecutive tensors of the stream stacked along dim 0
    (single tensors as runs of one), in stream order."""

    def runs(self) -> Iterator[tuple[list[str], torch.Tensor]]: ...


class BucketSink(Protocol):
    """Where a sender's completed buckets go. `segments` hold the bucket's tensors in order, stacked: segment i has
    shape [n_i, *shape] and covers the next n_i tensors (a layer's experts travel as one segment)."""

    def send(self, index: int, bucket: Bucket, segments: list[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


class BucketAssembler:
    """Collects the streamed tensors (runs of consecutive tensors stacked along a first dim) and hands each bucket to
    the sinks as soon as it is complete, in plan order. Raises if the stream disagrees with the plan (a name, dtype
    or shape the receivers do not expect)."""

    def __init__(self, buckets: list[Bucket], sinks: list[BucketSink]) -> None:
        self.buckets, self.sinks = buckets, sinks
        self.expected = {t.name: (i, t) for i, b in enumerate(buckets) for t in b.tensors}
        self.segments: list[list[torch.Tensor]] = [[] for _ in buckets]
        self.counts = [0] * len(buckets)
        self.next_bucket = 0
        self.num_bytes_sent = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_run([name], tensor.unsqueeze(0))

    def add_run(self, names: list[str], stacked: torch.Tensor) -> None:
        """Tensors `names`, consecutive in the stream, stacked along dim 0 of `stacked`."""
        if stacked.shape[0] != len(names):
            raise ValueError(f"weight stream: a run of {len(names)} names with {stacked.shape[0]} stacked tensors")
        shape, dtype = tuple(stacked.shape[1:]), dtype_name(stacked.dtype)
        start = 0
        while start < len(names):
            index = self._take(names[start], shape, dtype)
            end = start + 1
            while end < len(names) and self.expected.get(names[end], (None,))[0] == index:
                self._take(names[end], shape, dtype)
                end += 1
            self.segments[index].append(stacked[start:end] if end - start < len(names) else stacked)
            self.counts[index] += end - start
            start = end
        self._flush()

    def _take(self, name: str, shape: tuple[int, ...], dtype: str) -> int:
        index, meta = self.expected.pop(name, (None, None))
        if meta is None:
            raise ValueError(f"weight stream: {name!r} is not in the plan, or came twice")
        if shape != meta.shape or dtype != meta.dtype:
            raise ValueError(f"weight stream: {name!r} is {TensorMeta(name, dtype, shape)} but the plan says {meta}")
        return index

    def _flush(self) -> None:
        while self.next_bucket < len(self.buckets):
            i, bucket = self.next_bucket, self.buckets[self.next_bucket]
            if self.counts[i] < len(bucket.tensors):
                return
            segments, self.segments[i] = self.segments[i], []
            for sink in self.sinks:
                sink.send(i, bucket, segments)
            self.num_bytes_sent += bucket.nbytes
            self.next_bucket += 1

    def finish(self) -> None:
        if self.expected or self.next_bucket != len(self.buckets):
            missing = sorted(self.expected)[:5]
            raise ValueError(f"weight stream ended before {len(self.expected)} tensor(s) arrived, e.g. {missing}")
        for sink in self.sinks:
            sink.close()


class SafetensorsSink:
    """Writes each bucket as one safetensors shard `model-0000i-of-0000n.safetensors` of `folder`, then the index
    (`model.safetensors.index.json`), the layout Hugging Face and vLLM load; a single bucket is `model.safetensors`
    without an index, as save_pretrained writes it."""

    def __init__(self, folder: Path, num_buckets: int) -> None:
        self.folder, self.num_buckets = Path(folder), num_buckets
        self.weight_map: dict[str, str] = {}
        self.total_bytes = 0

    def shard_name(self, index: int) -> str:
        if self.num_buckets == 1:
            return "model.safetensors"
        return f"model-{index + 1:05d}-of-{self.num_buckets:05d}.safetensors"

    def send(self, index: int, bucket: Bucket, segments: list[torch.Tensor]) -> None:
        from safetensors.torch import save_file

        name = self.shard_name(index)
        tensors = [x for segment in segments for x in segment.unbind(0)]
        # clone: exported tensors can be views sharing storage (unstacked experts), which safetensors refuses
        save_file(
            {t.name: x.detach().to("cpu").contiguous().clone() for t, x in zip(bucket.tensors, tensors, strict=True)},
            self.folder / name,
            metadata={"format": "pt"},
        )
        self.weight_map.update({t.name: name for t in bucket.tensors})
        self.total_bytes += bucket.nbytes

    def close(self) -> None:
        if self.num_buckets == 1:
            return
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class BroadcastSink:
    """Broadcasts each bucket as one flat buffer from rank 0 of `group` (a torch ProcessGroup: NCCL or gloo)."""

    def __init__(self, group: "torch.distributed.ProcessGroup", device: torch.device) -> None:
        self.group, self.device = group, device

    def send(self, index: int, bucket: Bucket, segments: list[torch.Tensor]) -> None:
        flat = pack([t.to(self.device) for t in segments])
        broadcast(self.group, flat)

    def close(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def broadcast(group: "torch.distributed.ProcessGroup", tensor: torch.Tensor) -> None:
    """Broadcast `tensor` in place from rank 0 of `group` and wait for it."""
    start_broadcast(group, tensor).wait()


def start_broadcast(group: "torch.distributed.ProcessGroup", tensor: torch.Tensor):
    """Start broadcasting `tensor` in place from rank 0 of `group`; returns the work to wait on."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([tensor], opts)


def receive_buckets(
    group: "torch.distributed.ProcessGroup", manifest: Manifest, device: torch.device
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiving side of BroadcastSink: yields each bucket's (name, tensor) views, in plan order. The next
    bucket is already being received while the caller loads this one (two buckets of memory); a bucket's views are
    valid until the one after next is requested."""
    buckets = list(manifest.buckets)
    if not buckets:
        return

    def start(bucket: Bucket):
        flat = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        return flat, start_broadcast(group, flat)

    pending = start(buckets[0])
    for i, bucket in enumerate(buckets):
        flat, work = pending
        work.wait()
        if i + 1 < len(buckets):
            pending = start(buckets[i + 1])
        yield unpack(flat, bucket)


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the safetensors files of `folder`, file by file."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)


class TolerantSink:
    """A sink whose failure (a receiver that died) is recorded instead of raised, so this rank keeps gathering in
    lockstep with its peers; nothing more is sent after a failure."""

    def __init__(self, sink: BucketSink) -> None:
        self.sink = sink
        self.error: BaseException | None = None

    def send(self, index: int, bucket, segments) -> None:
        if self.error is not None:
            return
        try:
            self.sink.send(index, bucket, segments)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as RuntimeError/DistBackendError
            self.error = e

    def close(self) -> None:
        if self.error is None:
            try:
                self.sink.close()
            except (RuntimeError, OSError) as e:
                self.error = e


def stream_to(stream: "RunStream", manifest: Manifest, sinks: list[BucketSink]) -> None:
    """Iterate the stream's runs (every rank: the gathers are collectives) and hand each complete bucket to the sinks
    on a background thread, so sending bucket k overlaps with gathering the layers after it."""
    if not sinks:
        for _ in stream.runs():
            pass
        return
    jobs: queue.Queue = queue.Queue(maxsize=2)
    failure: list[BaseException] = []

    def worker() -> None:
        while (job := jobs.get()) is not None:
            if failure:
                continue
            try:
                for sink in sinks:
                    sink.send(*job)
            except BaseException as e:  # noqa: BLE001 - handed to the producer, which re-raises it
                failure.append(e)

    class _Queued:
        def send(self, index: int, bucket, segments) -> None:
            jobs.put((index, bucket, segments))

        def close(self) -> None:
            pass

    thread = threading.Thread(target=worker, name="slipstream-weight-send", daemon=True)
    thread.start()
    assembler = BucketAssembler(list(manifest.buckets), [_Queued()])
    try:
        for names, stacked in stream.runs():
            if failure:
                raise failure[0]
            assembler.add_run(names, stacked)
        assembler.finish()
    finally:
        jobs.put(None)
        thread.join()
    if failure:
        raise failure[0]
    for sink in sinks:
        sink.close()
