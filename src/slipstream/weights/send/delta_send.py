"""The sending side of delta updates (`weights.delta`, issue #40): a bucket sink that broadcasts each bucket from rank 0
of the session's group delta-encoded against the same bucket of the version sent before (weights/wire/delta.py: a
header, then the changed elements or the whole bucket, whichever is smaller), then runs the repair round.

A version goes whole (every bucket FULL, changes still counted) on any doubt about what the receivers hold: the first
version, a new session (a restarted or reconnected receiver), a new bucket plan, a previous attempt that failed or did
not send every bucket, and every `weights.delta.full_every`-th version. A receiver that still finds a bucket wrong (its
checksum) flags it in the repair round and gets it whole; the version is loaded bit-identical either way.

Memory: one copy of the published weights on rank 0's device (the bytes of the version last sent), made at the first
version, plus the payloads of the sparse buckets in flight (at most `IN_FLIGHT` buckets' worth).

Host syncs: encoding a bucket reads its number of changed elements and its checksum on the host, and the repair round
reads the receivers' flags. On CUDA (NCCL) the broadcasts are only queued on NCCL's stream, and nothing the encoder
runs waits for them, so those syncs never wait for a receiver, except where this sender must: when more than
`IN_FLIGHT` buckets are in flight, and for the repair round's flags. There it waits through the caller's `waiter`
(weights/send/send_watch.py), which aborts the group when the orchestrator takes the version in another session (its
receiver died) instead of hanging on it. A full bucket goes from the sender's kept copy of its bytes (which nothing
writes until every send of the version completed), not from the gather's buffer, which the next bucket reuses. On CPU
(gloo) every broadcast completes before the next bucket is encoded.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream.weights.wire.delta import FULL, HEADER_WORDS, encode
from slipstream.weights.wire.stream import Bucket, element_size, start_broadcast

IN_FLIGHT = 2
"""CUDA: buckets whose broadcasts may be queued at once before the sender waits for the oldest."""

Waiter = Callable[[Callable[[], bool]], BaseException | None]
"""Waits until the given poll is true; returns an error (after aborting the group) if the receivers are lost."""


class DeltaSender:
    """A BucketSink (weights/wire/stream.py) kept from one version to the next. Call order per attempt to send a
    version: `begin(step, plan, group, session)`, `send` per bucket in plan order, `close` (the repair round), then
    `take()` for the version's metrics once it is sent. An exception from `send` or `close` forgets the previous
    version (the next attempt goes whole)."""

    def __init__(self, full_every: int, device: torch.device) -> None:
        if full_every < 1:
            raise ValueError(f"weights.delta.full_every must be >= 1, got {full_every}")
        self.full_every, self.device = full_every, device
        self.queue_sends = device.type == "cuda"
        """Queue the broadcasts and wait only where needed (CUDA: NCCL's stream); False: wait for each (gloo)."""
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

    def begin(
        self,
        step: int,
        plan: tuple[Bucket, ...],
        group: "dist.ProcessGroup",
        session: str,
        waiter: Waiter | None = None,
    ) -> None:
        """Start an attempt to send version `step` with `plan` to the receivers of `session` on `group`. `waiter`: how
        a CUDA sender waits for its broadcasts (see the module docstring; None: plainly)."""
        if plan != self.plan or session != self.session or not self._done:
            self.previous = {}  # a new receiving side, or the attempt before never completed its repair round
        self.plan, self.session, self.group = plan, session, group
        self.full = not self.previous or self.since_full + 1 >= self.full_every
        self._sent, self._done = set(), False
        self._waiter = waiter
        self._inflight: list[list[tuple[object, torch.Tensor]]] = []
        """CUDA: per bucket in flight, its broadcasts' works and the tensors they read (kept alive until done)."""
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
            if old is None:
                kept = self.previous[index] = flat.clone()
            else:
                kept = old.copy_(flat)
            payload = kept if encoded.header.mode == FULL else encoded.payload
            sends = [encoded.header.to_tensor(self.device)]
            if payload.numel():
                sends.append(payload.to(self.device))
            self._start(sends)
            self._drain(IN_FLIGHT)
        except BaseException:
            self.previous = {}  # some receivers may hold this bucket's new bytes, others not
            raise
        self._sent.add(index)
        m = self.metrics
        m["weights/delta_bytes_sent"] += HEADER_WORDS * 8 + encoded.payload.numel()
        m["weights/delta_sparse_buckets" if encoded.header.mode else "weights/delta_full_buckets"] += 1
        if encoded.changed is not None:
            self._changed += encoded.changed
            self._compared += flat.numel() // size

    def _start(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast `tensors` in order: queued as one bucket in flight (`queue_sends`), else waiting for each."""
        assert self.group is not None
        works = [(start_broadcast(self.group, t), t) for t in tensors]
        if self.queue_sends:
            self._inflight.append(works)
        else:
            for work, _ in works:
                work.wait()

    def _drain(self, keep: int) -> None:
        """Wait until at most `keep` buckets' broadcasts are in flight."""
        while len(self._inflight) > keep:
            for work, _ in self._inflight.pop(0):
                self._wait(work)

    def _wait(self, work) -> None:
        """Wait for one collective's work: through the waiter when sends are queued (it aborts on lost receivers),
        then plainly (on CUDA: the current stream waits for it)."""
        if self.queue_sends and self._waiter is not None:
            error = self._waiter(work.is_completed)
            if error is not None:
                raise error
        work.wait()

    def close(self) -> None:
        """The repair round: every bucket a receiver flagged goes again, whole."""
        assert self.plan is not None and self.group is not None
        try:
            if len(self._sent) != len(self.plan):
                raise RuntimeError(f"delta send: {len(self._sent)} of {len(self.plan)} buckets were sent")
            flags = torch.zeros(len(self.plan), dtype=torch.int32, device=self.device)
            self._wait(self.group.allreduce([flags]))  # SUM: per bucket, the receivers that need it whole
            self._drain(0)
            for index in flags.nonzero().view(-1).tolist():
                self._start([self.previous[index]])
                self._drain(IN_FLIGHT)
                self.metrics["weights/delta_bytes_sent"] += self.plan[index].nbytes
                self.metrics["weights/delta_resent_buckets"] += 1
            self._drain(0)
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
