"""Inference as the planner simulates it: `capacity` decode slots served first come first served, every sequence
needing a fixed amount of unpaused decode time with its tokens spread evenly over it. A weight update freezes all
of it (vLLM's pause in keep mode); the policy version switches while frozen, so each token's version follows from
when it was due. Time that passes unfrozen is kept as one shared "active clock", which makes freezes free to apply.
"""

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

_EPS = 1e-9


@dataclass(eq=False)
class SimSequence:
    """One completion (one turn of one rollout) on the simulated server."""

    num_tokens: int
    work_s: float
    """Unpaused decode time (latency + tokens x per-token time)."""
    owner: object = None
    start_a: float | None = None
    """Active-clock time at which it got a slot."""
    cancelled: bool = False
    done: bool = False

    @property
    def interval_s(self) -> float:
        return self.work_s / self.num_tokens

    @property
    def finish_a(self) -> float:
        assert self.start_a is not None
        return self.start_a + self.work_s


@dataclass
class VersionLog:
    """Policy version served as a function of the active clock: switches happen at freezes."""

    switch_a: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=lambda: [0])

    def switch(self, at_a: float, version: int) -> None:
        self.switch_a.append(at_a)
        self.versions.append(version)

    def version_at(self, a: float) -> int:
        """Version of a token due at active time `a` (a token due exactly at a freeze is emitted before it)."""
        return self.versions[bisect.bisect_left(self.switch_a, a - _EPS)]

    def token_counts(self, seq: SimSequence, upto_a: float | None = None) -> list[tuple[int, int]]:
        """(version, number of tokens) of `seq`'s tokens due by active time `upto_a` (default: all), oldest first."""
        assert seq.start_a is not None
        n, dt = seq.num_tokens, seq.interval_s
        if upto_a is not None and dt > 0:
            n = min(n, math.floor((upto_a - seq.start_a) / dt + _EPS))
        if n <= 0:
            return []
        first_a, last_a = seq.start_a + dt, seq.start_a + n * dt
        lo = bisect.bisect_left(self.switch_a, first_a - _EPS)
        hi = bisect.bisect_left(self.switch_a, last_a - _EPS)
        counts, done = [], 0
        for k in range(lo, hi):  # tokens due up to switch k carry the version before it
            upto = min(n, math.floor((self.switch_a[k] - seq.start_a) / dt + _EPS)) if dt > 0 else n
            if upto > done:
                counts.append((self.versions[k], upto - done))
            done = upto
        if n > done:
            counts.append((self.versions[hi], n - done))
        return counts


class SimServer:
    """Decode slots in active time; `advance(now)` must be called before every other method."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.active_a = 0.0
        self.frozen = False
        self.log = VersionLog()
        self.busy_slot_s = 0.0
        """Slot-seconds of wall time spent decoding (for utilisation)."""
        self._now = 0.0
        self._queue: deque[SimSequence] = deque()
        self._running: list[tuple[float, int, SimSequence]] = []
        self._num_running = 0
        self._counter = 0

    def advance(self, now: float) -> None:
        if now < self._now - _EPS:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        if not self.frozen:
            self.active_a += now - self._now
            self.busy_slot_s += (now - self._now) * self._num_running
        self._now = max(now, self._now)

    def submit(self, seq: SimSequence) -> None:
        self._queue.append(seq)
        self._fill()

    def _fill(self) -> None:
        while self._num_running < self.capacity and self._queue:
            seq = self._queue.popleft()
            if seq.cancelled:
                continue
            seq.start_a = self.active_a
            self._counter += 1
            heapq.heappush(self._running, (seq.finish_a, self._counter, seq))
            self._num_running += 1

    def _clean_top(self) -> None:
        while self._running and self._running[0][2].cancelled:
            heapq.heappop(self._running)

    def next_finish(self) -> float:
        """Wall time of the next sequence end (inf while frozen or idle)."""
        self._clean_top()
        if self.frozen or not self._running:
            return math.inf
        return self._now + max(0.0, self._running[0][0] - self.active_a)

    def pop_finished(self) -> list[SimSequence]:
        done = []
        self._clean_top()
        while self._running and self._running[0][0] <= self.active_a + _EPS:
            seq = heapq.heappop(self._running)[2]
            self._num_running -= 1
            seq.done = True
            done.append(seq)
            self._clean_top()
        self._fill()
        return done

    def cancel(self, seq: SimSequence) -> None:
        """Abort a queued or running sequence (its slot frees at once)."""
        if seq.cancelled or seq.done:
            return
        seq.cancelled = True
        if seq.start_a is not None and not seq.done:
            self._num_running -= 1
            self._fill()

    def freeze(self) -> None:
        self.frozen = True

    def resume(self, version: int) -> None:
        """End a freeze, serving `version` from now on."""
        self.log.switch(self.active_a, version)
        self.frozen = False
