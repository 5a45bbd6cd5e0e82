"""How late an asyncio event loop runs what is ready. Everything of the orchestrator (streamed tokens, weight updates,
the admin calls of a pause) shares one loop, as everything of vLLM's API server does (streamed replies, admin calls),
so work that holds a loop delays the rest, a weight update's pause among them. A task sleeps `interval_s` again and
again and records how much later than asked it woke up: the orchestrator's step metrics carry the worst and the mean
lateness since the step before; the inference server reports its own with each admin reply (inference/auth.py)."""

import asyncio
import time


class LoopLag:
    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._max = self._total = 0.0
        self._count = 0

    async def run(self) -> None:
        """Sample until cancelled."""
        while True:
            start = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag = max(time.perf_counter() - start - self.interval_s, 0.0)
            self._max, self._total, self._count = max(self._max, lag), self._total + lag, self._count + 1

    def take(self) -> tuple[float, float] | None:
        """(worst, mean) lateness in seconds since the last call; None if nothing was sampled."""
        if not self._count:
            return None
        taken = (self._max, self._total / self._count)
        self._max = self._total = 0.0
        self._count = 0
        return taken

    def take_metrics(self, prefix: str) -> dict[str, float]:
        """`<prefix>/loop_lag_max_ms` and `<prefix>/loop_lag_mean_ms` since the last call (none if no sample)."""
        taken = self.take()
        if taken is None:
            return {}
        return {f"{prefix}/loop_lag_max_ms": taken[0] * 1e3, f"{prefix}/loop_lag_mean_ms": taken[1] * 1e3}
