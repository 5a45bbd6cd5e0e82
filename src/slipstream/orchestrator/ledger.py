"""Bookkeeping of rollout groups, free of I/O: in flight -> finished (buffer) -> taken into a batch, or cancelled
in flight / dropped from the buffer when their oldest token is too old for the next batch, or failed (too few of
its rollouts survived their environment). Counters are exact.

Batch n (1-based) may hold no token older than version n - 1 - max_off_policy_steps. Batches are assembled in
order from the buffer, first finished first, so the next batch is the earliest any group can still join.
"""

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from slipstream.envs.base import Task
from slipstream.rollout.record import Rollout


class TokenProgress(Protocol):
    """A group's generation in progress (a StreamedChat, or the turns of multi-turn rollouts)."""

    @property
    def oldest_version(self) -> int | None:
        """Version of the oldest token received so far; None before the first."""
        ...


@dataclass(eq=False)
class Group:
    """One task's group of rollouts (one request for `group_size` completions, or `group_size` multi-turn
    rollouts)."""

    index: int
    """Dispatch order (0-based)."""
    task: Task
    request_version: int
    """Policy version served when the request was sent (its cache_salt's version)."""
    task_index: int
    """The task's position in the sampler's stream (equal to `index` unless a resumed run generates groups again)."""
    stream: TokenProgress | None = None
    """The streamed tokens so far (a StreamedChat, or the turns of multi-turn rollouts); None for whole replies
    (router replay)."""
    rollouts: list[Rollout] | None = None
    """Set once the group has finished and been scored."""
    handle: asyncio.Task | None = None

    def oldest_version(self) -> int | None:
        """Version of the group's oldest token, or a lower bound of it; None while provably fresh.

        Finished: exact. Streaming: exact for the tokens received, None before the first (tokens to come carry at
        least the version then served). Whole replies (router replay): the request's version, a lower bound, so such a
        group may be cancelled a little early, never late.
        """
        if self.rollouts is not None:
            return min(r.oldest_version for r in self.rollouts)
        if self.stream is not None:
            return self.stream.oldest_version
        return self.request_version


class GroupLedger:
    """Where every dispatched group is, and how many ended where. Not thread-safe (one event loop)."""

    def __init__(self, groups_per_batch: int, max_off_policy_steps: int) -> None:
        self.groups_per_batch = groups_per_batch
        self.max_off_policy_steps = max_off_policy_steps
        self.in_flight: dict[int, Group] = {}
        self.finished: deque[Group] = deque()
        self.num_dispatched = 0
        self.num_batches = 0
        """Batches taken so far; the next one is for step num_batches + 1."""
        self.num_cancelled = 0
        """Groups cancelled in flight because their oldest token became too old."""
        self.num_dropped = 0
        """Finished groups discarded because their oldest token became too old."""
        self.num_abandoned = 0
        """Groups left when the run ended: cancelled in flight, or finished but not needed (not counted as stale)."""
        self.num_failed = 0
        """Groups discarded because fewer than two of their rollouts survived (environment errors)."""

    @property
    def min_version(self) -> int:
        """Oldest token version the next batch (step num_batches + 1) accepts."""
        return self.num_batches - self.max_off_policy_steps

    def quota(self, last_allowed_batch: int, num_spare: int = 0) -> int:
        """How many more groups may start: those batches up to `last_allowed_batch` still need, plus `num_spare`."""
        needed = self.groups_per_batch * (last_allowed_batch - self.num_batches) + num_spare
        return needed - len(self.in_flight) - len(self.finished)

    def start(self, group: Group) -> None:
        if group.index != self.num_dispatched:
            raise ValueError(f"group {group.index} started out of order (expected {self.num_dispatched})")
        self.in_flight[group.index] = group
        self.num_dispatched += 1

    def finish(self, group: Group, rollouts: list[Rollout]) -> bool:
        """Move a group from in flight to the buffer; False (and counted as dropped) if it is already too old."""
        del self.in_flight[group.index]
        group.rollouts, group.stream = rollouts, None
        if group.oldest_version() < self.min_version:
            self.num_dropped += 1
            return False
        self.finished.append(group)
        return True

    def fail(self, group: Group) -> None:
        """Forget a group in flight that cannot train (too few rollouts survived); counted as failed."""
        del self.in_flight[group.index]
        group.stream = None
        self.num_failed += 1

    def sweep(self) -> list[Group]:
        """After a batch was taken: drop too-old finished groups, and return (and forget) too-old groups in
        flight, which the caller cancels."""
        threshold = self.min_version
        kept = deque(g for g in self.finished if g.oldest_version() >= threshold)
        self.num_dropped += len(self.finished) - len(kept)
        self.finished = kept
        stale = [g for g in self.in_flight.values() if (v := g.oldest_version()) is not None and v < threshold]
        for group in stale:
            del self.in_flight[group.index]
        self.num_cancelled += len(stale)
        return stale

    def take_batch(self) -> list[Group] | None:
        """The next batch's groups (the first finished), in dispatch order, or None while fewer than a batch are
        buffered. Dispatch order (not finish order) makes a batch's layout independent of timing.

        The buffer holds only groups fresh enough for it: finish() checks on arrival, sweep() when a batch moves on.
        """
        if len(self.finished) < self.groups_per_batch:
            return None
        groups = sorted((self.finished.popleft() for _ in range(self.groups_per_batch)), key=lambda g: g.index)
        self.num_batches += 1
        return groups

    def abandon_all(self) -> list[Group]:
        """End of run: forget every group left, and return those in flight, which the caller cancels."""
        groups = list(self.in_flight.values())
        self.num_abandoned += len(groups) + len(self.finished)
        self.in_flight.clear()
        self.finished.clear()
        return groups


class Signal:
    """Wakes every waiter whenever some shared state changed; waiters re-check their own condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()
