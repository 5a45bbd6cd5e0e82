"""Discrete-event simulation of one asynchronous RL run: the orchestrator's rules, a simulated server, a trainer.

The bookkeeping is the orchestrator's own: groups move through `orchestrator.ledger.GroupLedger` (quota of
groups that may start, batches taken first-finished-first, cancellation in flight and dropping from the buffer of
groups older than max_off_policy_steps) and the in-flight cap is `orchestrator.concurrency.InFlightLimit`. The
dispatch rule and the batch gate restate `RolloutPipeline._dispatch_state` and `next_batch` (pipeline.py), which
live inside the asyncio pipeline (tests/unit/test_planner_sim.py runs the pipeline's own `_dispatch_state` on the
simulation's state at every event, so the two cannot drift apart unnoticed). The weight relay polls for published
weights every `weights_poll_s`, freezes inference while it loads and holds new requests until the load is checked,
as weights.py does. Time is simulated, so a run of thousands of steps takes seconds.
"""

import heapq
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slipstream.config.orchestrator import ConcurrencyConfig
from slipstream.orchestrator.concurrency import InFlightLimit
from slipstream.orchestrator.ledger import Group, GroupLedger
from slipstream.planner.engine import SimSequence, SimServer
from slipstream.planner.sim_config import PipelineSimConfig, PipelineSimResult

_CHECK = object()
"""Owner of the weight check's request."""


@dataclass(eq=False)
class _Rollout:
    """One rollout's turns; `oldest_version` / `newest_version` are what the ledger reads of a finished rollout."""

    run: "_GroupRun"
    turns_left: int
    versions: Counter = field(default_factory=Counter)
    seq: SimSequence | None = None
    turn_version: int = 0
    """Version served when the current turn was sent."""

    @property
    def oldest_version(self) -> int:
        return min(self.versions)

    @property
    def newest_version(self) -> int:
        return max(self.versions)


@dataclass(eq=False)
class _GroupRun:
    group: Group
    dispatched_at: float
    rollouts: list[_Rollout] = field(default_factory=list)
    num_done: int = 0
    cancelled: bool = False


class _Progress:
    """A group in flight as the ledger sees it (StreamedChat / TurnProgress): the oldest token received so far."""

    def __init__(self, sim: "PipelineSim", run: _GroupRun) -> None:
        self.sim, self.run = sim, run

    @property
    def oldest_version(self) -> int | None:
        stream = self.sim.config.version_tracking == "stream"
        floors = []
        for r in self.run.rollouts:
            if r.versions:
                floors.append(min(r.versions))
            if r.seq is not None and not r.seq.done:
                if not stream:
                    floors.append(r.turn_version)  # a multi-turn request in flight: its send-time version
                elif r.seq.start_a is not None:
                    counts = self.sim.server.log.token_counts(r.seq, self.sim.server.active_a)
                    floors += [counts[0][0]] if counts else []
        return min(floors) if floors else None


class PipelineSim:
    """Run with `PipelineSim(config).run()`."""

    def __init__(self, config: PipelineSimConfig) -> None:
        self.config = c = config
        self.rng = random.Random(c.seed)
        self.poll_rng = random.Random(c.seed + 1)  # apart, so latency draws keep the server's order
        self.server = SimServer(c.capacity)
        self.ledger = GroupLedger(c.batch_size // c.group_size, c.max_off_policy_steps)
        self.limit = InFlightLimit(ConcurrencyConfig(mode="fixed", max=c.in_flight_limit))
        self.num_spare = c.spare_batches * c.batch_size // c.group_size if c.max_async_level else 0
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._counter = 0
        self.served = self.published = 0
        self.updating = False
        self.trainer_waited = True
        self.orch_busy_until = 0.0
        self.parked_poll_at: float | None = None
        self.busy_windows: list[tuple[float, float]] = []
        self.client_free_at = 0.0
        self.next_step = 1
        self.trainer_queue: list[int] = []
        self.trainer_busy = False
        self.trainer_idle_since: float | None = c.startup_s
        self.trainer_idle_s = 0.0
        self.publish_times: list[float] = []
        self.held_turns: list[_Rollout] = []
        self.runs: dict[int, _GroupRun] = {}
        self.group_latencies: list[float] = []
        self.batch_lags: list[tuple[float, int]] = []
        self.lag_hist: Counter = Counter()
        self.num_multi_version = 0

    # event plumbing
    def _at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        self._counter += 1
        heapq.heappush(self._events, (t, self._counter, fn, args))

    def _orch(self, fn: Callable[..., None], *args: Any) -> None:
        """Run orchestrator-side work now, or when its blocking batch write ends."""
        if self.now < self.orch_busy_until:
            self._at(self.orch_busy_until, fn, *args)
        else:
            fn(*args)

    def run(self) -> PipelineSimResult:
        c = self.config
        self._at(c.startup_s, self._poll)  # dispatch starts with it
        max_events = 200 * c.num_steps * (c.batch_size * c.num_turns + 100)
        for _ in range(max_events):
            if len(self.publish_times) >= c.num_steps:
                return self._result()
            t_event = self._events[0][0] if self._events else math.inf
            t_seq = self.server.next_finish()
            if math.isinf(t_event) and math.isinf(t_seq):
                raise RuntimeError(f"simulation stalled at step {self.next_step} (t = {self.now:.3f}s)")
            self.now = min(t_event, t_seq)
            self.server.advance(self.now)
            if t_seq <= t_event:
                for seq in self.server.pop_finished():
                    self._orch(self._accept if seq.owner is _CHECK else self._turn_done, seq.owner)
            else:
                _, _, fn, args = heapq.heappop(self._events)
                fn(*args)
            self._react()
        raise RuntimeError(f"simulation did not finish within {max_events} events (step {self.next_step})")

    def _react(self) -> None:
        if self.now < self.orch_busy_until:
            return
        self._maybe_take_batch()
        while self.now >= self.orch_busy_until and self._dispatch_state() == "go":
            self._dispatch()

    # orchestrator: dispatch (pipeline.py's _dispatch_state) and batches (next_batch)
    @property
    def accepting(self) -> bool:
        return not self.updating

    def _dispatch_state(self) -> str:
        c = self.config
        if not self.accepting:
            return "hold"
        last_allowed = min(c.num_steps, self.served + 1 + c.max_async_level)
        num_spare = self.num_spare if self.trainer_waited else 0
        if self.ledger.quota(last_allowed, num_spare) <= 0:
            return "hold"
        if self.ledger.in_flight and (len(self.ledger.in_flight) + 1) * c.group_size > self.limit.limit:
            return "limit"
        return "go"

    def _dispatch(self) -> None:
        c = self.config
        group = Group(index=self.ledger.num_dispatched, task=None, request_version=self.served, task_index=0)  # type: ignore[arg-type]
        run = _GroupRun(group, self.now)
        run.rollouts = [_Rollout(run, c.num_turns) for _ in range(c.group_size)]
        if c.version_tracking == "stream" or c.num_turns > 1:
            group.stream = _Progress(self, run)
        self.ledger.start(group)
        self.runs[group.index] = run
        arrival = self._request_arrival() if c.num_turns == 1 else None  # one request for the group's n choices
        for rollout in run.rollouts:
            self._send_turn(rollout, arrival)

    def _request_arrival(self) -> float:
        """When a request sent now reaches the server: the client handles one request at a time."""
        c = self.config
        self.client_free_at = max(self.now, self.client_free_at) + c.request_cost_s
        return self.client_free_at + c.request_overhead_s

    def _send_turn(self, rollout: _Rollout, arrival: float | None = None) -> None:
        c = self.config
        tokens = max(1, round(c.completion_tokens.sample(self.rng)))
        work = c.sequence_latency.sample(self.rng) + tokens * c.token_latency_s
        rollout.seq = SimSequence(num_tokens=tokens, work_s=max(work, 1e-9), owner=rollout)
        rollout.turn_version = self.served
        self._at(self._request_arrival() if arrival is None else arrival, self._arrive, rollout.seq)

    def _arrive(self, seq: SimSequence) -> None:
        if not seq.cancelled:
            self.server.submit(seq)

    def _turn_done(self, rollout: _Rollout) -> None:
        run, seq = rollout.run, rollout.seq
        if run.cancelled or seq is None:
            return
        for version, count in self.server.log.token_counts(seq):
            rollout.versions[version] += count
        rollout.seq, rollout.turns_left = None, rollout.turns_left - 1
        if rollout.turns_left > 0:
            self._at(self.now + self.config.env_latency.sample(self.rng), self._orch, self._next_turn, rollout)
            return
        run.num_done += 1
        if run.num_done == len(run.rollouts):
            del self.runs[run.group.index]
            self.group_latencies.append(self.now - run.dispatched_at)
            self.ledger.finish(run.group, run.rollouts)  # type: ignore[arg-type]  # duck-typed rollouts

    def _next_turn(self, rollout: _Rollout) -> None:
        if rollout.run.cancelled:
            return
        if self.accepting:
            self._send_turn(rollout)
        else:
            self.held_turns.append(rollout)

    def _maybe_take_batch(self) -> None:
        c, step = self.config, self.next_step
        if step > c.num_steps or self.served < step - 1 - c.max_async_level:
            return
        groups = self.ledger.take_batch()
        if groups is None:
            return
        self.trainer_waited = self.served >= step - 1
        for group in self.ledger.sweep():
            run = self.runs.pop(group.index)
            run.cancelled = True
            for rollout in run.rollouts:
                if rollout.seq is not None:
                    self.server.cancel(rollout.seq)
        self._record_batch(step, groups)
        self.next_step += 1
        self.orch_busy_until = self.now + c.batch_write_s
        self.busy_windows.append((self.now, self.orch_busy_until))
        self._at(self.orch_busy_until + c.trainer_poll_s / 2, self._batch_visible, step)

    def _record_batch(self, step: int, groups: list[Group]) -> None:
        counts: Counter = Counter()
        oldest = math.inf
        for group in groups:
            for rollout in group.rollouts or []:
                counts.update(rollout.versions)  # type: ignore[attr-defined]  # a _Rollout
                oldest = min(oldest, rollout.oldest_version)
                self.num_multi_version += rollout.oldest_version != rollout.newest_version
        num_tokens = sum(counts.values())
        mean_version = sum(v * n for v, n in counts.items()) / num_tokens
        self.batch_lags.append((step - 1 - mean_version, int(step - 1 - oldest)))
        for version, n in counts.items():
            self.lag_hist[step - 1 - version] += n

    # trainer and weight relay
    def _batch_visible(self, step: int) -> None:
        self.trainer_queue.append(step)
        self._maybe_train()

    def _maybe_train(self) -> None:
        if self.trainer_busy or not self.trainer_queue:
            return
        step = self.trainer_queue.pop(0)
        if self.trainer_idle_since is not None:
            self.trainer_idle_s += self.now - self.trainer_idle_since
            self.trainer_idle_since = None
        self.trainer_busy = True
        self._at(self.now + self.config.train_step_s, self._publish, step)

    def _publish(self, step: int) -> None:
        self.published = step
        self.publish_times.append(self.now)
        self.trainer_busy = False
        self.trainer_idle_since = self.now
        self._maybe_train()
        if self.parked_poll_at is not None:
            self._unpark_poll()

    def _poll(self) -> None:
        if self.now < self.orch_busy_until:
            self._at(self.orch_busy_until, self._poll)
            return
        c = self.config
        if self.published > self.served:
            self.updating = True
            self.server.freeze()
            self._at(self.now + c.weight_update_s, self._unfreeze, self.published)
        else:
            # nothing to load until the trainer publishes: park instead of simulating every empty poll
            self.parked_poll_at, self.busy_windows = self.now + self._poll_interval(), []

    def _unpark_poll(self) -> None:
        """Replay the empty polls since parking (same jitter draws, same deferral past batch writes) up to the
        first one at or after now, and schedule it."""
        t = self.parked_poll_at
        assert t is not None
        while True:
            for start, end in self.busy_windows:
                if start <= t < end:
                    t = end
            if t >= self.now:
                break
            t += self._poll_interval()
        self.parked_poll_at, self.busy_windows = None, []
        self._at(t, self._poll)

    def _poll_interval(self) -> float:
        c = self.config
        return c.weights_poll_s + self.poll_rng.uniform(0.0, c.weights_poll_jitter_s)

    def _unfreeze(self, version: int) -> None:
        """Serve the new version; the probe check is a one-token request that queues for a slot like any other."""
        c = self.config
        self.server.resume(version)
        self.served = version
        check = SimSequence(num_tokens=1, work_s=max(c.sequence_latency.sample(self.rng), 1e-9), owner=_CHECK)
        self._at(self.now + c.weight_check_s, self._arrive, check)

    def _accept(self, _: object = None) -> None:
        self.updating = False
        held, self.held_turns = self.held_turns, []
        for rollout in held:
            self._next_turn(rollout)
        self._at(self.now + self._poll_interval(), self._poll)

    def _result(self) -> PipelineSimResult:
        c = self.config
        seconds = self.publish_times[-1]
        lat = sorted(self.group_latencies) or [0.0]
        steps = [b - a for a, b in zip([c.startup_s, *self.publish_times], self.publish_times, strict=False)]
        return PipelineSimResult(
            steps_per_hour=c.num_steps / seconds * 3600,
            seconds=seconds,
            lag_mean=sum(m for m, _ in self.batch_lags) / len(self.batch_lags),
            lag_max=max(m for _, m in self.batch_lags),
            lag_hist=dict(sorted(self.lag_hist.items())),
            multi_version=self.num_multi_version / (c.num_steps * c.batch_size),
            num_dispatched=self.ledger.num_dispatched,
            num_cancelled=self.ledger.num_cancelled,
            num_dropped=self.ledger.num_dropped,
            trainer_idle=self.trainer_idle_s / seconds,
            inference_busy=self.server.busy_slot_s / (seconds * c.capacity),
            mean_decoding=self.server.busy_slot_s / max(self.server.active_a, 1e-12),
            rollout_latency_p50_s=lat[len(lat) // 2],
            rollout_latency_p99_s=lat[min(len(lat) - 1, int(0.99 * len(lat)))],
            step_s=steps,
        )


def simulate(config: PipelineSimConfig) -> PipelineSimResult:
    """Simulate one run."""
    return PipelineSim(config).run()
