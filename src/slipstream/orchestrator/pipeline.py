"""Continuous rollout pipeline: groups are started as soon as the in-flight limit and the async level allow,
finished groups wait in a buffer, and a batch is assembled from the first finished groups as soon as enough exist.

Weight updates land while requests are in flight (weights.py); every token records the policy version that
produced it, and groups too old for the next batch are cancelled in flight or dropped (ledger.py).
Which groups may start: batch n needs policy >= n - 1 - max_async_level, so with version v served the groups of
batches up to v + 1 + max_async_level are started. With max_async_level >= 1, while the trainer waits for batches
(it was waiting when the last one was taken: inference is the bottleneck), `spare_batches` of spare groups start
too: a batch then takes the first groups to finish and slow ones carry over. With max_async_level = 0 exactly the
current batch's groups start, so every batch is on-policy. The in-flight limit (concurrency) bounds them all,
online evaluation requests included (online_eval.py).

Single-turn environments: one request for `group_size` completions per group. Multi-turn (tool-using)
environments: `group_size` concurrent rollouts through `run_rollout`, one request per model turn (rollout/turns.py);
a rollout that fails inside its environment is counted and left out, and a group with fewer than two survivors is
dropped and counted.

Inference lost mid-run (client.py's InferenceUnavailable): dispatch and new turns wait while the weight relay
recovers; a group whose request failed is generated again from scratch once the served weights are re-established
(`pipeline/regenerated_groups`), with the then served version, so no half-done group is trained.
"""

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Literal

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.base import AnyEnvironment, SupervisedEnvironment, is_multi_turn
from slipstream.envs.rollout import ModelFn
from slipstream.orchestrator.client import InferenceClient, InferenceError, InferenceUnavailable
from slipstream.orchestrator.concurrency import InFlightLimit, parse_server_load
from slipstream.orchestrator.ledger import Group, GroupLedger, Signal
from slipstream.orchestrator.multiturn import RolloutFailures, play_group, reward_or_missing
from slipstream.orchestrator.online_eval import OnlineEvaluator, SharedLimiter
from slipstream.orchestrator.sampler import TaskCursor, TaskSampler, request_seed
from slipstream.orchestrator.state import OrchestratorState
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.record import Rollout, sampling_params
from slipstream.rollout.streaming import StreamedChat
from slipstream.rollout.turns import TurnProgress, TurnRequester, sample_completions
from slipstream.transport.weights import weights_dir

log = logging.getLogger(__name__)


class RolloutPipeline:
    """Keeps rollout groups in flight and hands out batches. Use `async with pipeline.running():`."""

    def __init__(
        self,
        client: InferenceClient,
        env: AnyEnvironment,
        sampler: TaskSampler,
        relay: WeightRelay,
        config: OrchestratorConfig,
    ) -> None:
        self.client, self.env, self.sampler, self.relay, self.config = client, env, sampler, relay, config
        self.group_size = config.group_size
        self.num_spare = config.spare_batches * config.batch_size // config.group_size if config.max_async_level else 0
        self.ledger = GroupLedger(config.batch_size // config.group_size, config.max_off_policy_steps)
        self.cursor = TaskCursor()
        self.limit = InFlightLimit(config.concurrency)
        self.signal = Signal()
        relay.on_change = self.signal.notify
        self.error: BaseException | None = None
        self._limit_was_binding = False
        self._trainer_waited = True
        """Whether the trainer was already waiting when the last batch was taken (it had published the weights of
        the step before): then inference is the bottleneck and spare groups pay off; otherwise they would only wait
        in the buffer and age."""
        self._cancelled: list[asyncio.Task] = []
        self.num_regenerated = 0
        """Groups generated again because inference was lost while their requests were in flight."""
        self.multi_turn = is_multi_turn(env)
        self.failures = RolloutFailures(config.group_size, config.batch_size // config.group_size)
        self.turns = TurnRequester(
            client,
            sampling_params(config.sampling),
            config.request_timeout_s,
            ready=self._turn_version,
            version_now=lambda: relay.served_version,
        )
        self.eval_limiter = SharedLimiter(config.eval.max_share, lambda: self.limit.limit, self.signal)
        self.evaluator = OnlineEvaluator(client, env, config, relay, self.eval_limiter) if config.eval.enabled else None

    @asynccontextmanager
    async def running(self) -> AsyncIterator["RolloutPipeline"]:
        """Run dispatch, the weight watcher, (adaptive) the load poller and (online eval) the evaluator; on exit,
        stop them, cancel the groups still in flight and, after a clean run, let a running evaluation finish. A
        background failure is raised by the next wait, or here."""
        watcher = asyncio.create_task(self._guard(self.relay.watch(lambda: self.ledger.num_batches)))
        background: list[Coroutine[Any, Any, None]] = [self._dispatch_loop()]
        if self.config.concurrency.mode == "adaptive":
            background.append(self._poll_server_load())
        if isinstance(self.env, SupervisedEnvironment):
            background.append(self.env.supervise())  # raises to stop the run (an env server gone for good)
        cancellable = [asyncio.create_task(self._guard(coro)) for coro in background]
        evaluations = None
        if self.evaluator is not None:
            evaluations = asyncio.create_task(self._guard(self.evaluator.run(self._wait)))
        clean = False
        try:
            yield self
            clean = True
        finally:
            await self._shutdown(watcher, cancellable, evaluations, finish_evaluation=clean)
        if self.error is not None:
            raise self.error

    async def next_batch(self, step: int) -> tuple[list[Rollout], dict[str, float]]:
        """Rollouts of batch `step` (group by group) and the pipeline's metrics for it."""
        if step != self.ledger.num_batches + 1:
            raise ValueError(f"batch {step} asked after {self.ledger.num_batches} batches; batches go in order")
        start = time.perf_counter()
        min_version = step - 1 - self.config.max_async_level
        try:
            async with asyncio.timeout(self.config.weights_timeout_s):
                await self._wait(lambda: self.relay.served_version >= min_version)
        except TimeoutError as e:
            raise TimeoutError(
                f"waited {self.config.weights_timeout_s:.0f}s for the trainer to publish "
                f"{weights_dir(self.relay.output_dir, min_version)} (batch {step} needs policy >= {min_version} "
                f"with max_async_level = {self.config.max_async_level}); is the trainer running?"
            ) from e
        gated = time.perf_counter()
        await self._wait(lambda: len(self.ledger.finished) >= self.ledger.groups_per_batch)
        groups = self.ledger.take_batch()
        assert groups is not None  # the wait above guarantees a full batch
        self._trainer_waited = self.relay.served_version >= step - 1
        self._cancel(self.ledger.sweep())
        self.signal.notify()
        metrics = {
            "timing/wait_weights_s": gated - start,
            "timing/generate_s": time.perf_counter() - gated,
            "timing/weight_update_s": 0.0,
            **self.relay.take_metrics(),
            **self.counters(),
            **(self.evaluator.take_metrics() if self.evaluator is not None else {}),
        }
        return [r for g in groups for r in g.rollouts], metrics

    def counters(self) -> dict[str, float]:
        """Cumulative group counts and the current in-flight limit."""
        ledger = self.ledger
        return {
            "pipeline/dispatched_groups": float(ledger.num_dispatched),
            "pipeline/cancelled_groups": float(ledger.num_cancelled),
            "pipeline/dropped_groups": float(ledger.num_dropped),
            "pipeline/failed_groups": float(ledger.num_failed),
            "pipeline/regenerated_groups": float(self.num_regenerated),
            "pipeline/in_flight_groups": float(len(ledger.in_flight)),
            "pipeline/buffered_groups": float(len(ledger.finished)),
            "pipeline/concurrency_limit": float(self.limit.limit),
            "pipeline/concurrency_backoffs": float(self.limit.num_backoffs),
            "pipeline/eval_in_flight": float(self.eval_limiter.in_flight),
            **self.failures.counters(),
            **(self.env.counters() if isinstance(self.env, SupervisedEnvironment) else {}),
        }

    async def _wait(self, predicate: Any) -> None:
        await self.signal.wait_for(lambda: self.error is not None or predicate())
        if self.error is not None:
            raise self.error

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.signal.notify()

    async def _guard(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._fail(e)

    def _dispatch_state(self) -> Literal["go", "limit", "hold"]:
        """go: a group may start; limit: only the in-flight limit holds it back; hold: anything else does."""
        if self.error is not None or not self.relay.accepting:
            return "hold"
        last_allowed = min(self.config.max_steps, self.relay.served_version + 1 + self.config.max_async_level)
        num_spare = self.num_spare if self._trainer_waited else 0
        if self.ledger.quota(last_allowed, num_spare) <= 0:
            return "hold"
        in_flight = self._num_in_flight()
        if self.ledger.in_flight and in_flight + self.group_size > self.limit.limit:
            return "limit"
        return "go"

    def _num_in_flight(self) -> int:
        """Completions in flight: `group_size` per group (a multi-turn group has at most one request per rollout
        in flight) plus evaluation requests."""
        return len(self.ledger.in_flight) * self.group_size + self.eval_limiter.in_flight

    def _may_dispatch(self) -> bool:
        state = self._dispatch_state()
        self._limit_was_binding |= state == "limit"
        return state == "go"

    async def _dispatch_loop(self) -> None:
        while True:
            await self.signal.wait_for(self._may_dispatch)
            self._dispatch()

    def _dispatch(self) -> None:
        position = self.cursor.take()
        group = Group(
            index=self.ledger.num_dispatched,
            task=self.sampler.task_at(position),
            request_version=self.relay.served_version,
            task_index=position,
        )
        self._fresh_progress(group)
        self.ledger.start(group)
        group.handle = asyncio.create_task(self._run_group(group))

    def _fresh_progress(self, group: Group) -> None:
        if self.multi_turn:
            group.stream = TurnProgress()
        elif not self.config.router_replay:  # router replay: whole replies (see slipstream.rollout.replies)
            where = f"{self.client.base_url}/v1/chat/completions (stream, task {group.task.id})"
            group.stream = StreamedChat(self.group_size, lambda: self.relay.served_version, where)

    async def _run_group(self, group: Group) -> None:
        attempt = 0
        while True:
            try:
                play = self._play_multi_turn if self.multi_turn else self._play_single_turn
                rollouts = await play(group)
                break
            except asyncio.CancelledError:
                raise
            except InferenceUnavailable as e:
                attempt += 1
                if attempt > self.config.recovery.max_regenerations_per_group:
                    self._fail(self._gave_up(group, attempt - 1, e))
                    return
                await self._regenerate(group)
            except Exception as e:
                self._fail(e)
                return
        if rollouts is None:
            self.ledger.fail(group)
        else:
            self.ledger.finish(group, rollouts)
        self.signal.notify()

    async def _regenerate(self, group: Group) -> None:
        """Forget what the group generated, wait until inference is back with the served weights, start it over."""
        self.num_regenerated += 1
        for wait in (False, True):  # fresh before the wait too, so the lost tokens do not make the group look old
            if wait:
                await self._wait(lambda: self.relay.accepting)
            group.request_version = self.relay.served_version
            self._fresh_progress(group)

    def _gave_up(self, group: Group, num_regenerations: int, error: InferenceUnavailable) -> InferenceError:
        return InferenceError(
            f"task {group.task.id}: inference was lost again after the group was generated again "
            f"{num_regenerations} times ({error}); raise orchestrator.recovery.max_regenerations_per_group if "
            "inference keeps restarting for another reason than this request"
        )

    async def _play_single_turn(self, group: Group) -> list[Rollout] | None:
        """One request for the group's completions, each scored by the environment; None when too few got a
        reward."""
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                rollouts = await self._generate(group)
        except TimeoutError:
            timeout = self.config.request_timeout_s
            raise InferenceError(
                f"task {group.task.id}: no complete reply within request_timeout_s = {timeout}s"
            ) from None
        rewards = await asyncio.gather(*(reward_or_missing(self.env, group.task, r.completion_text) for r in rollouts))
        for rollout in rollouts:
            rollout.group_index = group.index
        return self.failures.scored(group.task, rollouts, rewards)

    async def _play_multi_turn(self, group: Group) -> list[Rollout] | None:
        """The group's rollouts through the environment; None when fewer than two survived."""
        progress = group.stream
        assert isinstance(progress, TurnProgress)  # set by _dispatch
        samples = itertools.count()  # play_group builds the rollouts' model functions in sample order
        base = self._request_seed(group)

        def model_fn() -> ModelFn:
            sample = next(samples)
            turn_seed = None if base is None else (lambda turn: base + sample + turn * self.group_size)
            return self.turns.model_fn(group.task, progress, turn_seed)

        outcomes = await play_group(self.env, group.task, self.group_size, model_fn, self.config.rollout_timeout_s)
        return self.failures.survivors(group.task, outcomes, group.index, group.request_version)

    async def _turn_version(self) -> int:
        """Wait until no weight update is in progress (new requests carry the new version); the served version."""
        await self._wait(lambda: self.relay.accepting)
        return self.relay.served_version

    async def _generate(self, group: Group) -> list[Rollout]:
        """Send the group's request and parse its completions, each token with its policy version."""
        sampling = sampling_params(self.config.sampling)
        if (seed := self._request_seed(group)) is not None:
            sampling["seed"] = seed  # vLLM seeds sample i with seed + i
        chat = group.stream
        assert chat is None or isinstance(chat, StreamedChat)  # set by _fresh_progress
        return await sample_completions(
            self.client,
            group.task,
            sampling,
            self.group_size,
            group.request_version,
            chat,
            require_routed_experts=self.config.router_replay,
        )

    def _request_seed(self, group: Group) -> int | None:
        """Base seed of the group's requests (None: unseeded), from the run's seed and the task's stream position."""
        return request_seed(self.config.seed, group.task_index) if self.config.seed_requests else None

    def checkpoint_state(self, step: int) -> OrchestratorState:
        """The state to checkpoint right after batch `step` was taken."""
        ledger = self.ledger
        unfinished = [g.task_index for g in (*ledger.in_flight.values(), *ledger.finished)]
        next_index, requeued = self.cursor.snapshot(unfinished)
        return OrchestratorState(
            step=step,
            seed=self.config.seed,
            env_name=self.config.env.name,
            tasks_per_step=self.sampler.tasks_per_step,
            next_task_index=next_index,
            requeued_task_indices=requeued,
            num_dispatched=ledger.num_dispatched,
            num_cancelled=ledger.num_cancelled,
            num_dropped=ledger.num_dropped,
            num_failed=ledger.num_failed,
            num_abandoned=ledger.num_abandoned + len(unfinished),
            failed_rollouts_by_stage=dict(self.failures.by_stage),
        )

    def restore(self, state: OrchestratorState) -> None:
        """Continue from a checkpointed state (before `running()`): the next batch is state.step + 1, groups that
        were unfinished then are generated again first, counters go on from their values."""
        if self.ledger.num_dispatched:
            raise RuntimeError("restore() must come before any group is dispatched")
        ledger = self.ledger
        ledger.num_batches, ledger.num_dispatched = state.step, state.num_dispatched
        ledger.num_cancelled, ledger.num_dropped, ledger.num_failed = (
            state.num_cancelled,
            state.num_dropped,
            state.num_failed,
        )
        ledger.num_abandoned = state.num_abandoned
        self.failures.by_stage = dict(state.failed_rollouts_by_stage)
        self.cursor = TaskCursor(state.next_task_index, state.requeued_task_indices)

    async def _poll_server_load(self) -> None:
        """Adaptive concurrency: read /metrics every poll interval and move the limit (skipped during updates)."""
        where = f"{self.client.base_url}/metrics"
        noted = False
        while True:
            await asyncio.sleep(self.config.concurrency.poll_interval_s)
            if not self.relay.accepting:
                continue
            try:
                text = await self.client.get_text("/metrics")
            except InferenceUnavailable:
                continue  # the relay recovers it
            load = parse_server_load(text, where)
            if load.num_preemptions is None and not noted:
                noted = True
                log.info(f"{where} has no preemption counter; backing off on queueing only")
            if not self.relay.accepting:
                continue
            saturated = self._limit_was_binding or self._dispatch_state() == "limit"
            self._limit_was_binding = False
            self.limit.observe(load, saturated, in_flight=self._num_in_flight())
            self.signal.notify()

    def _cancel(self, groups: list[Group]) -> None:
        """Cancel groups' requests: closing a streamed request's connection makes vLLM abort it."""
        self._cancelled = [task for task in self._cancelled if not task.done()]
        for group in groups:
            group.handle.cancel()
            self._cancelled.append(group.handle)

    async def _shutdown(
        self,
        watcher: asyncio.Task,
        cancellable: list[asyncio.Task],
        evaluations: asyncio.Task | None,
        finish_evaluation: bool,
    ) -> None:
        """Stop dispatch and polling, let the weight watcher finish any update (never leave inference paused),
        cancel the groups still in flight, and let a running evaluation finish (after a clean run) or cancel it."""
        self.relay.stop()
        for task in cancellable:
            task.cancel()
        self._cancel(self.ledger.abandon_all())
        if evaluations is not None:
            if finish_evaluation and self.error is None:
                self.evaluator.stop()  # type: ignore[union-attr]  # evaluations run only with an evaluator
            else:
                evaluations.cancel()
        tasks = [watcher, *cancellable, *self._cancelled, *([evaluations] if evaluations is not None else [])]
        await asyncio.gather(*tasks, return_exceptions=True)
