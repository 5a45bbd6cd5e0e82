"""The sending side of delta updates (`weights.delta`, issue #40): a bucket sink that broadcasts each bucket from rank 0
of the session's group delta-encoded against the same bucket of the version sent before (weights/wire/delta.py: a
header, then the changed elements or the whole bucket, whichever is smaller), then runs the repair round.

A version goes whole (every bucket FULL, changes still counted) on any doubt about what the receivers hold: the first
version, a new session (a restarted or reconnected receiver), a new bucket plan, a previous attempt that failed or did
not send every bucket, and every `weights.delta.full_every`-th version. A receiver that still finds a bucket wrong (its
checksum) flags it in the repair round and gets it whole; the version is loaded bit-identical either way.

Memory: one copy of the published weights on rank 0's device (the bytes of the version last sent), made at the first
version, plus each sparse bucket's payload while it is sent. Host syncs: one per bucket (its number of changed
elements sizes the payload) and the repair round's flags: on CUDA that would stall the pipelined send and, unlike
send/send_watch.py, hang on a dead receiver (NCCL is not served yet: issue #40's GPU half).
"""

import torch
import torch.distributed as dist

from slipstream.weights.wire.delta import HEADER_WORDS, encode
from slipstream.weights.wire.stream import Bucket, broadcast, element_size


class DeltaSender:
    """A BucketSink (weights/wire/stream.py) kept from one version to the next. Call order per attempt to send a
    version: `begin(step, plan, group, session)`, `send` per bucket in plan order, `close` (the repair round), then
    `take()` for the version's metrics once it is sent. An exception from `send` or `close` forgets the previous
    version (the next attempt goes whole)."""

    def __init__(self, full_every: int, device: torch.device) -> None:
        if full_every < 1:
            raise ValueError(f"weights.delta.full_every must be >= 1, got {full_every}")
        self.full_every, self.device = full_every, device
        self.previous: dict[int, torch.Tensor] = {}
        """Bucket index -> its bytes in the version last sent whole to `session` (every bucket or none)."""
        self.plan: tuple[Bucket, ...] | None = None
        self.session: str | None = None
        self.group: dist.ProcessGroup | None = None
        self.since_full = 0
        """Versions sent since the last one that went whole."""
        self.full = True
        self.metrics: dict[str, float] = {}
        self._sent: set[int] = set()
        self._done = True
        """The attempt begun last sent every bucket and its repair round (True before the first: nothing to forget)."""
        self._taken = True

    def begin(self, step: int, plan: tuple[Bucket, ...], group: "dist.ProcessGroup", session: str) -> None:
        """Start an attempt to send version `step` with `plan` to the receivers of `session` on `group`."""
        if plan != self.plan or session != self.session or not self._done:
            self.previous = {}  # a new receiving side, or the attempt before never completed its repair round
        self.plan, self.session, self.group = plan, session, group
        self.full = not self.previous or self.since_full + 1 >= self.full_every
        self._sent, self._done = set(), False
        self._changed = self._compared = 0
        self.metrics = {
            "weights/delta_bytes_sent": 0.0,
            "weights/full_bytes": float(sum(b.nbytes for b in plan)),
            "weights/delta_sparse_buckets": 0.0,
            "weights/delta_full_buckets": 0.0,
            "weights/delta_resent_buckets": 0.0,
            "weights/delta_full_version": float(self.full),
        }
        self._taken = False

    def send(self, index: int, bucket: Bucket, flat: torch.Tensor) -> None:
        assert self.group is not None, "begin() first"
        size = element_size(bucket.dtype)
        old = self.previous.get(index)
        try:
            encoded = encode(flat, old, size, full=self.full)
            broadcast(self.group, encoded.header.to_tensor(self.device))
            if encoded.payload.numel():
                broadcast(self.group, encoded.payload.to(self.device))
        except BaseException:
            self.previous = {}  # some receivers may hold this bucket's new bytes, others not
            raise
        if old is None:
            self.previous[index] = flat.clone()
        else:
            old.copy_(flat)
        self._sent.add(index)
        m = self.metrics
        m["weights/delta_bytes_sent"] += HEADER_WORDS * 8 + encoded.payload.numel()
        m["weights/delta_sparse_buckets" if encoded.header.mode else "weights/delta_full_buckets"] += 1
        if encoded.changed is not None:
            self._changed += encoded.changed
            self._compared += flat.numel() // size

    def close(self) -> None:
        """The repair round: every bucket a receiver flagged goes again, whole."""
        assert self.plan is not None and self.group is not None
        try:
            if len(self._sent) != len(self.plan):
                raise RuntimeError(f"delta send: {len(self._sent)} of {len(self.plan)} buckets were sent")
            flags = torch.zeros(len(self.plan), dtype=torch.int32, device=self.device)
            self.group.allreduce([flags]).wait()  # SUM: per bucket, the receivers that need it whole
            for index in flags.nonzero().view(-1).tolist():
                broadcast(self.group, self.previous[index].to(self.device))
                self.metrics["weights/delta_bytes_sent"] += self.plan[index].nbytes
                self.metrics["weights/delta_resent_buckets"] += 1
        except BaseException:
            self.previous = {}
            raise
        self.since_full = 0 if self.full else self.since_full + 1
        self._done = True

    def take(self) -> dict[str, float]:
        """The last version's metrics, once ({} afterwards, and for an attempt that failed)."""
        if self._taken or not self._done:
            return {}
        self._taken = True
        m = dict(self.metrics)
        if self._compared:
            m["weights/changed_fraction"] = self._changed / self._compared
        m["weights/delta_ratio"] = m["weights/delta_bytes_sent"] / max(m["weights/full_bytes"], 1.0)
        return m
