"""The weight stream: a model's tensors in Hugging Face names, in dtype-grouped buckets, from the trainer to any sink
(safetensors shards on disk, or a broadcast over a torch.distributed group) and back out on the receiving side.

The bucket plan is computed from metadata alone (names, dtypes, shapes in stream order), so sender and receivers
agree on every byte boundary before the first byte moves: a tensor joins the open bucket of its dtype, and a bucket
is closed when the next tensor of that dtype would overflow it (a tensor larger than a bucket travels alone). The
plan's order is the order in which buckets complete, so a sender can ship each bucket as soon as its last tensor
has been gathered while later layers are still being gathered.
"""

import bisect
import functools
import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from slipstream.weights.wire.pieces import PieceLayout, piece_layout, row_count

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of the stream: HF name, dtype name (`bfloat16`), full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @functools.cached_property
    def nbytes(self) -> int:  # cached: the stream asks for it per tensor, several times per version
        return math.prod(self.shape) * element_size(self.dtype)

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
    rows: tuple[tuple[int, ...], ...] | None = None
    """Sent by several trainer ranks, each its own rows (weights/wire/pieces.py): rows[j][q] = rows of tensor j that
    sender q holds. None: one sender sends every tensor whole."""

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def senders(self) -> int:
        return len(self.rows[0]) if self.rows else 1

    @functools.cached_property
    def layout(self) -> PieceLayout:
        """Where each sender's rows travel (one sender: one piece, the tensors whole)."""
        rows = self.rows if self.rows is not None else tuple((row_count(t.shape),) for t in self.tensors)
        return piece_layout([t.shape for t in self.tensors], element_size(self.dtype), rows)


@dataclass(frozen=True)
class Manifest:
    """What one weight version's stream holds: its step and bucket plan (JSON on the wire and on disk)."""

    step: int
    buckets: tuple[Bucket, ...]
    senders: int = 1
    """Trainer ranks that send (ranks 0 .. senders - 1 of the transfer group; receivers follow). With more than one,
    every bucket has a rows table saying which rows of each tensor each of them sends (weights/wire/pieces.py)."""
    delta: bool = False
    """Every bucket travels delta-encoded (weights/wire/delta.py: a header, then the changed elements or the whole
    bucket), and a repair round follows the last bucket."""

    def __post_init__(self) -> None:
        for i, bucket in enumerate(self.buckets):
            if bucket.senders != self.senders or (self.senders > 1) != (bucket.rows is not None):
                raise ValueError(
                    f"weight manifest: buckets[{i}] is split among {bucket.senders} sender(s) ("
                    f"{'a' if bucket.rows is not None else 'no'} rows table), the manifest has {self.senders}"
                )
        if self.delta and self.senders > 1:
            raise ValueError("weight manifest: delta-encoded buckets come from one sender")

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def to_dict(self) -> dict:
        data: dict = {
            "version": MANIFEST_VERSION,
            "step": self.step,
            "buckets": [_bucket_dict(b) for b in self.buckets],
        }
        if self.senders > 1:
            data["senders"] = self.senders
        if self.delta:
            data["delta"] = True
        return data

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
        senders = data.get("senders", 1)
        if not _is_int(senders) or senders < 1:
            raise ValueError(f"weight manifest: 'senders' must be an integer >= 1, got {senders!r:.100}")
        delta = data.get("delta", False)
        if not isinstance(delta, bool) or (delta and senders > 1):
            raise ValueError(f"weight manifest: 'delta' must be true or false (one sender only), got {delta!r:.100}")
        last = _LAST_PARSED
        if last is not None and senders == last[2] and buckets == last[0]:  # one C-level comparison: the plan rarely
            return Manifest(step, last[1], senders, delta)  # changes between versions
        parsed = Manifest(step, tuple(_parse_bucket(b, i, senders) for i, b in enumerate(buckets)), senders, delta)
        _remember(parsed)
        return parsed

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


_LAST_PARSED: tuple[list, tuple["Bucket", ...], int] | None = None
"""The last plan parsed, in its canonical JSON form (built here, never handed out) and parsed: every version of a
run sends the same plan, and validating it tensor by tensor took 11.5 ms per version for the 3,147 tensors of an
8-layer Qwen3-30B-A3B slice on a slow CPU, on the receivers' side of the transfer."""


def _remember(manifest: "Manifest") -> None:
    global _LAST_PARSED
    _LAST_PARSED = (manifest.to_dict()["buckets"], manifest.buckets, manifest.senders)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bucket_dict(bucket: Bucket) -> dict:
    data: dict = {"dtype": bucket.dtype, "tensors": [[t.name, list(t.shape)] for t in bucket.tensors]}
    if bucket.rows is not None:
        data["rows"] = [list(r) for r in bucket.rows]
    return data


def _parse_bucket(data: object, index: int, senders: int = 1) -> Bucket:
    """One bucket of a manifest's JSON: {"dtype": name, "tensors": [[name, shape], ...]}, and with several senders
    "rows": [[rows of sender 0, rows of sender 1, ...] per tensor]."""
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
    if senders == 1:
        if "rows" in data:
            raise ValueError(f"{where}: a 'rows' table but the manifest has one sender")
        return Bucket(dtype, tuple(tensors))
    rows = data.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, list) and all(_is_int(n) for n in r) for r in rows):
        raise ValueError(f"{where}: 'rows' must list, per tensor, the rows each of {senders} senders holds")
    bucket = Bucket(dtype, tuple(tensors), tuple(tuple(r) for r in rows))
    try:
        bucket.layout  # noqa: B018 - validates the table against the shapes
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return bucket


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


def plan_pipelined(metas: Iterable[TensorMeta], bucket_bytes: int, edge_bytes: int) -> list[Bucket]:
    """Buckets for a sender that may send tensors in any order (each trainer rank already holds its rows:
    weights/send/piece_send.py), shaped for the pipeline: the sender casts the first bucket before anything moves and
    the receivers load the last one after everything arrived, so the first buckets ramp up from `edge_bytes` (each at
    most twice the one before, up to `bucket_bytes`) and the last ones ramp down to it (each at most half of what is
    left). Tensors larger than a quarter of a bucket (embeddings, LM heads) move to the middle of the stream, where
    buckets are full size; the others keep their order. Each dtype is planned apart, in the order its first tensor
    comes."""
    if bucket_bytes < 1 or edge_bytes < 1:
        raise ValueError(f"bucket sizes must be >= 1 byte (got bucket {bucket_bytes}, edge {edge_bytes})")
    by_dtype: dict[str, list[TensorMeta]] = {}
    for meta in metas:
        by_dtype.setdefault(meta.dtype, []).append(meta)
    out: list[Bucket] = []
    for dtype, ts in by_dtype.items():
        ordered = _large_mid_stream(ts, bucket_bytes // 4)
        remaining = sum(t.nbytes for t in ordered)
        current: list[TensorMeta] = []
        size = count = 0
        for meta in ordered:
            limit = min(bucket_bytes, edge_bytes << min(count, 40), max(edge_bytes, (remaining + size) // 2))
            if current and size + meta.nbytes > limit:
                out.append(Bucket(dtype, tuple(current)))
                current, size, count = [], 0, count + 1
            current.append(meta)
            size += meta.nbytes
            remaining -= meta.nbytes
        if current:
            out.append(Bucket(dtype, tuple(current)))
    return out


def _large_mid_stream(ts: list[TensorMeta], large: int) -> list[TensorMeta]:
    """`ts` with its tensors of more than `large` bytes moved, in their order, to where half of the others' bytes are
    behind them."""
    rest = [t for t in ts if t.nbytes <= large]
    behind = list(itertools.accumulate((t.nbytes for t in rest), initial=0))[:-1]
    middle = bisect.bisect_left(behind, sum(t.nbytes for t in rest) / 2)
    return rest[:middle] + [t for t in ts if t.nbytes > large] + rest[middle:]


def unpack(flat: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views into `flat` (uint8) for each tensor of `bucket`: one split of the buffer seen in the bucket's dtype, then
    a shaped view per tensor (a slice per tensor cost ~15 us of host time each: 45 ms for a MoE layer stack's 3,147
    tensors on a slow CPU, on the receiving side of every version)."""
    nbytes = bucket.nbytes
    if nbytes != flat.numel():
        raise ValueError(f"bucket of {flat.numel()} bytes but its tensors take {nbytes}")
    if not bucket.tensors:
        return []
    typed = flat.view(getattr(torch, bucket.dtype))
    pieces = typed.split([math.prod(meta.shape) for meta in bucket.tensors])
    return [(meta.name, piece.view(meta.shape)) for meta, piece in zip(bucket.tensors, pieces, strict=True)]


class BucketSink(Protocol):
    """Where a sender's completed buckets go: `flat` holds the bucket's bytes (`unpack` gives its tensors) and may be
    reused for another bucket once `send` returns."""

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None: ...

    def close(self) -> None: ...


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
    """Broadcasts each bucket as one flat buffer from rank 0 of `group` (a torch ProcessGroup: NCCL or gloo). On CUDA
    the broadcasts are queued (the current stream waits for them); `close` waits for them on the host unless
    `synchronize` is false (the caller waits in its own way: weights/send/send_watch.py)."""

    def __init__(self, group: "torch.distributed.ProcessGroup", device: torch.device, synchronize: bool = True) -> None:
        self.group, self.device, self.synchronize = group, device, synchronize

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None:
        broadcast(self.group, flat.to(self.device))

    def close(self) -> None:
        if self.device.type == "cuda" and self.synchronize:
            torch.cuda.current_stream(self.device).synchronize()


def broadcast(group: "torch.distributed.ProcessGroup", tensor: torch.Tensor, root: int = 0) -> None:
    """Broadcast `tensor` in place from rank `root` of `group` and wait for it."""
    start_broadcast(group, tensor, root).wait()


def start_broadcast(group: "torch.distributed.ProcessGroup", tensor: torch.Tensor, root: int = 0):
    """Start broadcasting `tensor` in place from rank `root` of `group`; returns the work to wait on."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return group.broadcast([tensor], opts)


def start_pieces(lanes, wire: torch.Tensor, layout: PieceLayout) -> list:
    """Start the broadcasts of a bucket sent by several senders (`lanes`: weights.wire.collective.Lanes): sender q's
    piece from rank 0 of lane q, into its place in `wire` (uint8, the layout's size), on every lane this member is in
    (a receiver: all; a sender: its own). Returns the works to wait on. Each lane has its own communicator, so on CUDA
    the pieces travel side by side (each on its lane's NCCL stream)."""
    works = []
    for lane, start, size in zip(lanes.groups, layout.piece_starts, layout.piece_bytes, strict=True):
        if lane is not None and size:
            works.append(start_broadcast(lane, wire[start : start + size]))
    return works


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
