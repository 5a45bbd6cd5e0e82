"""The receiving side of delta updates (`weights.delta`, issue #40; the wire format in weights/wire/delta.py): each
bucket's header and payload by broadcast, applied onto the receiver's *mirror* of that bucket's previous version and
checked against the checksum of the full new bytes before anything is loaded; a bucket that fails (or that has no base
to apply onto) is flagged in the repair round and arrives again whole.

The loader always gets the whole bucket (views into the mirror), so what the model loads is bit-identical to a full
send by construction. The mirror is needed because vLLM's CPU build repacks linear weights: the previous version's
bytes cannot be read back from the model's parameters. It costs one copy of the published weights per receiving
worker (on its device), kept from one version to the next; it is dropped with the session (a new session's first
version goes whole) and when the bucket plan changes.

GPU, later: where the model's parameters hold the published bytes as they are (bf16 layers, the copy plan of
weights/receive/copy_plan.py), a sparse bucket could be written straight into them (vLLM 0.32's
distributed/weight_transfer/sparse_nccl_engine.py scatters patches through checkpoint_weight_patch.py), without the
mirror; the checksum would then be computed over the parameters' views of the bucket. A repaired bucket arrives after
the rest of the version, out of plan order, which a copy plan's replay (per loader call, in order) refuses: it would
need its own replay path.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slipstream.weights.wire.delta import FULL, HEADER_WORDS, Header, apply, checksum
from slipstream.weights.wire.published import INCOMPLETE_MARKER
from slipstream.weights.wire.stream import Bucket, Manifest, broadcast, element_size, unpack


class DeltaMirror:
    """A receiver's copy of the last version's bytes of each bucket (only buckets that passed their checksum)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buckets: tuple[Bucket, ...] | None = None
        self.flats: dict[int, torch.Tensor] = {}

    def start(self, manifest: Manifest) -> None:
        """Keep the mirror for the plan of the last version; forget it for another plan."""
        if manifest.buckets is not self.buckets and manifest.buckets != self.buckets:
            self.flats, self.buckets = {}, manifest.buckets

    def bucket(self, index: int) -> torch.Tensor:
        """Bucket `index`'s mirror (allocated, uninitialised, at its first full arrival)."""
        assert self.buckets is not None
        flat = self.flats.get(index)
        if flat is None:
            flat = self.flats[index] = torch.empty(self.buckets[index].nbytes, dtype=torch.uint8, device=self.device)
        return flat

    def release(self) -> None:
        self.flats, self.buckets = {}, None


@dataclass
class DeltaStats:
    """What one version's delta stream carried, for the receiver's log."""

    wire_bytes: int = 0
    sparse: int = 0
    full: int = 0
    repaired: int = 0
    """Buckets this receiver flagged in the repair round (a bad checksum, or no base for a sparse bucket)."""

    def to_dict(self) -> dict:
        return {"wire_bytes": self.wire_bytes, "sparse": self.sparse, "full": self.full, "repaired": self.repaired}


def receive_delta(
    group: "dist.ProcessGroup", manifest: Manifest, mirror: DeltaMirror, stats: DeltaStats
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields each bucket's (name, tensor) views into the mirror once it holds the version's bytes (checked), in plan
    order; then, after the repair round, the buckets this receiver flagged. Raises RuntimeError (the engine's
    incomplete-update error) when a bucket sent again whole still fails its checksum."""
    mirror.start(manifest)
    device = mirror.device
    expected: dict[int, tuple[int, int]] = {}
    flagged: list[int] = []
    for i, bucket in enumerate(manifest.buckets):
        size = element_size(bucket.dtype)
        raw = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
        broadcast(group, raw)
        header = Header.parse(raw, bucket.nbytes, size)
        payload = torch.empty(header.payload_bytes(bucket.nbytes, size), dtype=torch.uint8, device=device)
        if payload.numel():
            broadcast(group, payload)
        stats.wire_bytes += raw.numel() * 8 + payload.numel()
        expected[i] = header.sums
        if header.mode:
            stats.sparse += 1
        else:
            stats.full += 1
        base = mirror.bucket(i) if header.mode == FULL else mirror.flats.get(i)
        if base is None or not apply(header, payload, base, size):
            mirror.flats.pop(i, None)  # holds no version now
            flagged.append(i)
            continue
        yield unpack(base, bucket)
    flags = torch.zeros(len(manifest.buckets), dtype=torch.int32, device=device)
    flags[flagged] = 1
    group.allreduce([flags]).wait()  # SUM over the receivers; the sender adds zeros
    for i in flags.nonzero().view(-1).tolist():
        bucket = manifest.buckets[i]
        mine = i in flagged
        target = mirror.bucket(i) if mine else torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        broadcast(group, target)
        stats.wire_bytes += bucket.nbytes
        if not mine:
            continue  # another receiver's repair: this one holds and loaded the bucket already
        stats.repaired += 1
        if tuple(int(v) for v in checksum(target).tolist()) != expected[i]:
            mirror.flats.pop(i, None)
            raise RuntimeError(
                f"slipstream {INCOMPLETE_MARKER}: bucket {i} of version {manifest.step} failed its checksum again "
                "when sent whole in the repair round (the bytes are damaged on the way); inference serves a mix of "
                "versions"
            )
        yield unpack(target, bucket)
