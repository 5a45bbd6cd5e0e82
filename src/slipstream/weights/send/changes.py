"""How much of each published version changed since the version before (`weights.track_changes`): a bucket sink
that compares every bucket with the same bucket of the previous version, element by element on their bytes.

This is what a delta update would carry (issue #40: send per bucket either the whole bucket or the changed elements,
whichever is smaller): `weights/changed_fraction` is the fraction of elements whose bits differ, `weights/delta_bytes`
the bytes such a send would put on the wire (an int32 index and the new value per changed element, or the whole
bucket when that is smaller). The comparison is bitwise, in the published dtype (the bytes inference receives): an
update below that dtype's resolution changes nothing, -0.0 and 0.0 differ, a NaN equals the same NaN.

Memory: one copy of the published weights on the sending rank's device (made at the first version), plus one compare
per bucket on the send thread; the counts stay on the device until the version is sent (no host sync per bucket).
"""

import torch

from slipstream.weights.wire.stream import Bucket, element_size

INDEX_BYTES = 4
"""A sparse send's index per changed element (int32: buckets stay below 2**31 elements)."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChangeTracker:
    """A BucketSink (weights/wire/stream.py) kept from one version to the next: `begin(step, plan)` before each pass
    over a version's buckets, `take()` once the version is sent. A version sent again after a failed attempt is
    compared once per bucket (the buckets of the attempt that failed count, the same bytes again are skipped)."""

    def __init__(self) -> None:
        self.previous: dict[int, torch.Tensor] = {}
        """Bucket index -> its bytes in the last version compared."""
        self.plan: tuple[Bucket, ...] | None = None
        self.step: int | None = None
        self._reset()

    def _reset(self) -> None:
        self.seen: set[int] = set()
        self.changed: list[torch.Tensor] = []
        self.delta: list[torch.Tensor] = []
        self.elements = 0
        self.full_bytes = 0
        self.first = False
        """True when a bucket of this version had no previous version to compare with."""

    def begin(self, step: int, plan: tuple[Bucket, ...]) -> None:
        """Start a pass over version `step`, sent with bucket plan `plan` (a new plan forgets the previous bytes)."""
        if plan != self.plan:
            self.previous, self.plan = {}, plan
        if step != self.step:
            if self.plan is not None and len(self.seen) != len(self.plan):
                self.previous = {}  # the last version was never sent whole: its bytes are not one version's
            self.step = step
            self._reset()

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None:
        if self.step is None or index in self.seen:
            return
        self.seen.add(index)
        size = element_size(bucket.dtype)
        words = flat.view(_WORDS[size])
        before = self.previous.get(index)
        if before is None:  # same plan, same sizes: a new plan cleared `previous` (begin)
            self.previous[index] = words.clone()
            self.first = True
            return
        changed = (words != before).sum()
        self.changed.append(changed)
        self.delta.append(torch.clamp(changed * (INDEX_BYTES + size), max=bucket.nbytes))
        self.elements += words.numel()
        self.full_bytes += bucket.nbytes
        before.copy_(words)

    def close(self) -> None:
        pass

    def take(self) -> dict[str, float]:
        """The version's metrics, once every bucket was compared ({} for the first version, or if some bucket was
        never sent); the next `take` of the same version returns {}."""
        complete = self.plan is not None and len(self.seen) == len(self.plan) and not self.first and self.changed
        metrics = {}
        if complete:
            changed = float(torch.stack(self.changed).sum())
            delta = float(torch.stack(self.delta).sum())
            metrics = {
                "weights/changed_fraction": changed / self.elements,
                "weights/delta_bytes": delta,
                "weights/delta_ratio": delta / self.full_bytes,
            }
        self.changed, self.delta = [], []  # taken: nothing more for this version
        return metrics
