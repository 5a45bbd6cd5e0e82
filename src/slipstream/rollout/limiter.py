"""Bound on model completions in flight, shared by a rollout's requests (evaluation, tests)."""

import asyncio
from typing import Protocol


class CompletionLimiter(Protocol):
    """What a model-turn path needs of an in-flight bound: `acquire(n)` (returns the units taken), `release`."""

    async def acquire(self, units: int) -> int: ...

    async def release(self, units: int) -> None: ...


class WeightedSemaphore:
    """Bounds the number of completions in flight; a request for `n` completions takes `n` units."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._cond = asyncio.Condition()

    async def acquire(self, units: int) -> int:
        # A group larger than the capacity runs alone instead of waiting forever.
        units = min(units, self.capacity)
        async with self._cond:
            await self._cond.wait_for(lambda: self._free >= units)
            self._free -= units
        return units

    async def release(self, units: int) -> None:
        async with self._cond:
            self._free += units
            self._cond.notify_all()
