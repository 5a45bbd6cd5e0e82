"""Turns on a shared GPU (deployment.colocate): vLLM and the trainer never compute at once.

The orchestrator owns the turns. Inference's turn: vLLM is awake and generates. Once a batch is complete, `to_trainer`
holds back new requests (rollouts and evaluations), waits for those in flight, puts vLLM to sleep (`/sleep`: level 1
frees the KV cache and moves the weights to CPU memory, 2 frees both, 0 only stops scheduling) and only then is the
batch written, so the trainer starts on a free GPU. The trainer trains, returns its cached memory and publishes the
version. The weight relay then wakes vLLM (`wake`, before it loads the version) and, once that version is served and
verified, `to_inference` ends the trainer's turn: requests go out again.

Batch n therefore always waits for version n - 1 (the pipeline's gate); max_async_level still decides which groups
may start in a turn (the data's staleness), not whether two things share the GPU. The first turn sleeps at level 1
at most: the weight check calibrates at the first load against the weights vLLM started with, which level 2 would
discard.
"""

import logging
import time
from collections.abc import Awaitable, Callable

from slipstream.config.orchestrator import ColocateConfig
from slipstream.orchestrator.client import InferenceClient

log = logging.getLogger(__name__)


class GpuTurns:
    """Whose turn it is on the shared GPU, and vLLM's sleep state. The pipeline reads `trainer_turn` (dispatch
    holds while it is true) and calls `to_trainer`; the weight relay calls `wake` and `to_inference`."""

    def __init__(self, client: InferenceClient, config: ColocateConfig, on_change: Callable[[], None]) -> None:
        self.client = client
        self.level = config.sleep_level
        self.on_change = on_change
        self.trainer_turn = False
        """True from the moment a batch is complete until the trainer's version for it is served."""
        self.until_version = 0
        """The version that ends the trainer's turn (the step whose batch it was handed)."""
        self.asleep_at: int | None = None
        """The level vLLM sleeps at, None while awake."""
        self.num_turns = 0
        self._metrics: dict[str, float] = {}
        self._turn_start = 0.0

    async def to_trainer(self, step: int, idle: Callable[[], Awaitable[None]]) -> None:
        """Hand the GPU over for batch `step`: hold requests back, wait until none is in flight (`idle`), sleep."""
        self.trainer_turn, self.until_version = True, step
        self.on_change()  # dispatch and evaluations see the turn at once
        start = time.perf_counter()
        await idle()
        drained = time.perf_counter()
        level = min(self.level, 1) if self.num_turns == 0 else self.level
        if self.asleep_at is None:
            await self.client.sleep(level)
            self.asleep_at = level
        slept = time.perf_counter()
        self.num_turns += 1
        self._turn_start = slept
        self._add("colocate/drain_s", drained - start)
        self._add("colocate/sleep_s", slept - drained)
        self._metrics["colocate/sleep_level"] = float(level)
        log.debug(f"batch {step}: GPU to the trainer (vLLM asleep at level {level} after {slept - drained:.2f}s)")

    async def wake(self) -> None:
        """Before a version is loaded: wake vLLM whole (its weights, then its KV cache for the probe check and the next
        requests), unless it is awake."""
        if self.asleep_at is None:
            return
        start = time.perf_counter()
        if self.asleep_at == 0:
            await self.client.wake_up(["scheduling"])
        else:
            await self.client.wake_up(["weights"])  # vLLM's order: the weights' memory first, then the cache's
            await self.client.wake_up(["kv_cache"])
        self.asleep_at = None
        self._add("colocate/wake_s", time.perf_counter() - start)
        if self._turn_start:
            self._add("colocate/trainer_turn_s", start - self._turn_start)
            self._turn_start = 0.0

    def to_inference(self, version: int) -> None:
        """`version` is served: the trainer's turn ends once it is the version the turn was for."""
        if self.trainer_turn and version >= self.until_version:
            self.trainer_turn = False
            self.on_change()

    def woke_elsewhere(self) -> None:
        """vLLM was restarted (a new server starts awake)."""
        self.asleep_at = None

    def take_metrics(self) -> dict[str, float]:
        metrics, self._metrics = self._metrics, {}
        return metrics

    def _add(self, key: str, seconds: float) -> None:
        self._metrics[key] = self._metrics.get(key, 0.0) + seconds
