"""The weight stream: a model's tensors in Hugging Face names, in dtype-grouped buckets, from the trainer to any sink
(safetensors shards on disk, or a broadcast over a torch.distributed group) and back out on the receiving side.

The bucket plan is computed from metadata alone (names, dtypes, shapes in stream order), so sender and receivers
agree on every byte boundary before the first byte moves: a tensor joins the open bucket of its dtype, and a bucket
is closed when the next tensor of that dtype would overflow it (a tensor larger than a bucket travels alone). The
plan's order is the order in which buckets complete, so a sender can ship each bucket as soon as its last tensor
has been gathered while later layers are still being gathered.
"""

import contextlib
import functools
import itertools
import json
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

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
        """Parse and validate a manifest; anything malformed raises ValueError naming the field."""
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            version = data.get("version") if isinstance(data, dict) else data
            raise ValueError(f"weight manifest version {version!r}; this Slipstream reads {MANIFEST_VERSION}")
        step, buckets = data.get("step"), data.get("buckets")
        if not _is_int(step) or step < 0:
            raise ValueError(f"weight manifest: 'step' must be an integer >= 0, got {step!r}")
        if not isinstance(buckets, list):
            raise ValueError(f"weight manifest: 'buckets' must be a list, got {buckets!r:.200}")
        return Manifest(step, tuple(_parse_bucket(b, i) for i, b in enumerate(buckets)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_bucket(data: object, index: int) -> Bucket:
    """One bucket of a manifest's JSON: {"dtype": name, "tensors": [[name, shape], ...]}."""
    where = f"weight manifest: buckets[{index}]"
    if not isinstance(data, dict) or not isinstance(data.get("tensors"), list):
        raise ValueError(f"{where} must be an object with 'dtype' and a 'tensors' list, got {data!r:.200}")
    dtype = data.get("dtype")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"{where}: 'dtype' must name a torch dtype (e.g. 'bfloat16'), got {dtype!r:.100}")
    tensors = []
    for j, entry in enumerate(data["tensors"]):
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
        if not ok or not all(_is_int(size) and size >= 0 for size in entry[1]):
            raise ValueError(f"{where}.tensors[{j}] must be [name, [sizes >= 0]], got {entry!r:.200}")
        tensors.append(TensorMeta(entry[0], dtype, tuple(entry[1])))
    return Bucket(dtype, tuple(tensors))


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


class BucketSink(Protocol):
    """Where a sender's completed buckets go: `flat` holds the bucket's bytes (`unpack` gives its tensors) and may be
    reused for another bucket once `send` returns."""

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None: ...

    def close(self) -> None: ...


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
        self.released: set[int] = set()

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
            self.released = set()

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

    def release(self, index: int) -> None:
        """Bucket `index` was sent."""
        with self.cond:
            self.released.add(index)
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

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None:
        from safetensors.torch import save_file

        name = self.shard_name(index)
        # clone: views of one buffer share storage, which safetensors refuses (and the buffer is reused after send)
        tensors = {n: t.clone() for n, t in unpack(flat.to("cpu"), bucket)}
        save_file(tensors, self.folder / name, metadata={"format": "pt"})
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

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None:
        broadcast(self.group, flat.to(self.device))

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

    def send(self, index: int, bucket, flat) -> None:
        if self.error is not None:
            return
        try:
            self.sink.send(index, bucket, flat)
        except (RuntimeError, OSError) as e:  # torch.distributed reports a lost peer as RuntimeError/DistBackendError
            self.error = e

    def close(self) -> None:
        if self.error is None:
            try:
                self.sink.close()
            except (RuntimeError, OSError) as e:
                self.error = e


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
    cuda_stream = torch.cuda.current_stream() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def worker() -> None:
        context = torch.cuda.stream(cuda_stream) if cuda_stream is not None else contextlib.nullcontext()
        with context:  # the stream the buckets were written on: the sends are ordered after the copies
            while (job := jobs.get()) is not None:
                index, bucket, flat = job
                try:
                    if not failure:
                        for sink in sinks:
                            sink.send(index, bucket, flat)
                except BaseException as e:  # noqa: BLE001 - handed to the producer, which re-raises it
                    failure.append(e)
                finally:
                    buffers.release(index)

    class _Queued:
        def send(self, index: int, bucket, flat) -> None:
            jobs.put((index, bucket, flat))

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
    for sink in sinks:
        sink.close()
