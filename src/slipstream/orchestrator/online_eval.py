"""Online evaluation: the served policy on the environment's held-out split before training, every `eval.interval`
policy versions and at the end, beside rollouts and within a share of the in-flight limit (see OnlineEvalConfig).

Evaluation samples never enter training batches: they go through `slipstream.eval.evaluate`, not the ledger.
An evaluation interrupted because inference was lost is counted (`eval/num_interrupted`) and run again once the
weight relay has re-established the served weights.
"""

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.base import AnyEnvironment
from slipstream.eval.evaluate import evaluate
from slipstream.eval.results import EVAL_METRIC_PREFIX, EvalResult
from slipstream.eval.run import format_summary
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.ledger import Signal
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.client import InferenceUnavailable
from slipstream.rundir import RunDir
from slipstream.utils.fs import append_line

log = logging.getLogger(__name__)

"""One line per online evaluation, relative to the run directory."""


class SharedLimiter:
    """Bounds evaluation completions in flight to `share` of the pipeline's in-flight limit (at least 1).

    A CompletionLimiter (slipstream.rollout.limiter), what `evaluate` calls; the pipeline counts `in_flight` against its
    limit, and a release wakes it (`signal`).
    """

    def __init__(self, share: float, limit: Callable[[], int], signal: Signal) -> None:
        self.share = share
        self.limit = limit
        self.signal = signal
        self.in_flight = 0

    @property
    def capacity(self) -> int:
        return max(1, int(self.share * self.limit()))

    async def acquire(self, units: int) -> int:
        # A request larger than the capacity runs alone instead of waiting forever.
        await self.signal.wait_for(lambda: self.in_flight == 0 or self.in_flight + units <= self.capacity)
        self.in_flight += units
        return units

    async def release(self, units: int) -> None:
        self.in_flight -= units
        self.signal.notify()


class OnlineEvaluator:
    """Runs the evaluations of a training run. Their metrics wait in a queue: each batch takes the oldest
    (`take_metrics()`), so every evaluation that ends before the last batch lands in one batch's metrics."""

    def __init__(
        self,
        client: InferenceClient,
        env: AnyEnvironment,
        config: OrchestratorConfig,
        relay: WeightRelay,
        limiter: SharedLimiter,
    ) -> None:
        self.client, self.env, self.relay, self.limiter = client, env, relay, limiter
        self.config = config.eval
        self.sampling = config.eval.sampling or config.sampling
        self.path = RunDir(config.output_dir).online_eval_path
        self.last_version: int | None = None
        """Version of the last evaluation started (finished or timed out)."""
        self.num_timeouts = 0
        self.num_interrupted = 0
        """Evaluations cut short because inference was lost (each is run again)."""
        self.pending_metrics: deque[dict[str, float]] = deque()
        self._stopping = False
        if not env.tasks(self.config.split):
            raise ValueError(
                f"environment {env.name!r} has no tasks in split {self.config.split!r} for online evaluation; "
                "give it some (e.g. orchestrator.env.args.num_eval_tasks) or set orchestrator.eval.interval = 0"
            )

    def due(self, version: int) -> bool:
        """Whether `version` is the first served at or past the next evaluation point."""
        interval = self.config.interval
        return self.last_version is None or version // interval > self.last_version // interval

    async def run(self, wait: Callable[[Callable[[], bool]], Awaitable[None]]) -> None:
        """Background loop: evaluate each due version once it is served (no update in progress), until stop()."""
        while not self._stopping:
            await wait(lambda: self._stopping or (self._may_start() and self.due(self.relay.served_version)))
            if not self._stopping:
                await self.evaluate()

    def _may_start(self) -> bool:
        """No update in progress (nor staged: weights.no_stall), inference available, and (colocated) not the
        trainer's turn on the GPU."""
        turns = self.relay.turns
        return self.relay.accepting and not self.relay.staging and (turns is None or not turns.trainer_turn)

    def stop(self) -> None:
        """The last batch is written: finish the running evaluation, with the whole in-flight limit (no rollouts
        run any more), and start no other."""
        self._stopping = True
        self.limiter.share = 1.0
        self.limiter.signal.notify()

    async def final(self, version: int) -> EvalResult | None:
        """After the last batch: evaluate the final policy (if not done yet) with the whole in-flight limit."""
        if self.last_version == version:
            return None
        if self.relay.served_version != version:
            raise RuntimeError(f"the final evaluation needs policy {version} served, not {self.relay.served_version}")
        self.limiter.share = 1.0
        while True:
            await self.relay.ensure_available()
            num_interrupted = self.num_interrupted
            result = await self.evaluate()
            if self.num_interrupted == num_interrupted:
                return result

    async def evaluate(self) -> EvalResult | None:
        """Evaluate the served policy, holding it fixed; None if it took longer than eval.timeout_s."""
        async with self.relay.hold() as version:
            previous, self.last_version = self.last_version, version
            try:
                async with asyncio.timeout(self.config.timeout_s):
                    result = await self._evaluate(version)
            except TimeoutError:
                self.num_timeouts += 1
                self.pending_metrics.append({f"{EVAL_METRIC_PREFIX}num_timeouts": float(self.num_timeouts)})
                log.warning(
                    f"online evaluation of policy v{version} cancelled after eval.timeout_s = "
                    f"{self.config.timeout_s:g}s; lower eval.num_tasks or eval.num_samples, or raise the timeout"
                )
                return None
            except InferenceUnavailable as e:
                self.num_interrupted += 1
                self.last_version = previous  # evaluate this version again once inference is back
                self.pending_metrics.append({f"{EVAL_METRIC_PREFIX}num_interrupted": float(self.num_interrupted)})
                log.warning(f"online evaluation of policy v{version} interrupted ({e}); it runs again")
                return None
            except asyncio.CancelledError:
                log.info(f"online evaluation of policy v{version} cancelled")
                raise
        self._record(version, result)
        return result

    async def _evaluate(self, version: int) -> EvalResult:
        return await evaluate(
            self.client,
            self.env,
            self.config.split,
            self.config.num_samples,
            self.sampling,
            None,  # unseeded: seeded requests crash a CPU vLLM build with chunked prefill (see OnlineEvalConfig)
            self.limiter,
            num_tasks=self.config.num_tasks,
            pass_threshold=self.config.pass_threshold,
            policy_version=version,
        )

    def _record(self, version: int, result: EvalResult) -> None:
        metrics = result.metrics() | {f"{EVAL_METRIC_PREFIX}policy_version": float(version)}
        if self.num_timeouts:
            metrics[f"{EVAL_METRIC_PREFIX}num_timeouts"] = float(self.num_timeouts)
        self.pending_metrics.append(metrics)
        summary = {k: v for k, v in result.to_dict().items() if k != "tasks"}
        append_line(self.path, json.dumps({"step": version, "time": time.time(), **summary}))
        log.info(f"online eval of policy v{version}: {format_summary(result)}")

    def take_metrics(self) -> dict[str, float]:
        """Metrics of the oldest evaluation not yet in a batch ({} if none)."""
        return self.pending_metrics.popleft() if self.pending_metrics else {}
