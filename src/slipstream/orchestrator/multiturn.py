"""Multi-turn (and tool-using) rollout groups in the pipeline: a group's `group_size` concurrent rollouts (their
model turns go through slipstream.rollout.turns), and their results as training rollouts (failed ones counted and
logged).
"""

import asyncio
import logging
from collections.abc import Callable

from slipstream.envs.base import AnyEnvironment, MissingReward, Task, score
from slipstream.envs.rollout import MISSING_REWARD, ModelFn, RolloutError, RolloutResult, run_rollout
from slipstream.rollout.record import Rollout, rollout_from_result

log = logging.getLogger(__name__)


async def play_group(
    env: AnyEnvironment, task: Task, group_size: int, model_fn: Callable[[], ModelFn], timeout_s: float | None
) -> list[RolloutResult | RolloutError]:
    """`group_size` concurrent rollouts of `task`. Environment failures come back as RolloutErrors; an error of
    the model function (inference) cancels the other rollouts and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            rollouts = [group.create_task(run_rollout(env, task, model_fn(), timeout_s)) for _ in range(group_size)]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [r.result() for r in rollouts]


async def reward_or_missing(env: AnyEnvironment, task: Task, completion_text: str) -> float | MissingReward:
    """A single-turn reward, or the MissingReward the environment's None or NaN turned into (any other error of the
    environment propagates)."""
    try:
        return await score(env, task, completion_text)
    except MissingReward as e:
        return e


MAX_GROUPS_WITHOUT_SURVIVORS = 16
"""A run stops once this many groups in a row lost every rollout in their environment: it is broken, not flaky."""


class EnvironmentBroken(RuntimeError):
    """Every rollout of many groups in a row failed inside the environment: stop instead of waiting forever."""


class RewardsMissing(EnvironmentBroken):
    """The environment gave no reward to any rollout of a batch's worth of groups in a row: stop, never train on
    rewards that were never computed."""


class RolloutFailures:
    """Counts rollouts that failed inside their environment, by stage, and logs each failure (the first of each
    stage with its traceback). A group needs two surviving rollouts to compare rewards (one if group_size is 1).
    After MAX_GROUPS_WITHOUT_SURVIVORS groups in a row without a surviving rollout the run stops (EnvironmentBroken):
    no batch would ever fill, and nothing is trained on rewards that were never computed."""

    def __init__(self, group_size: int, groups_per_batch: int = MAX_GROUPS_WITHOUT_SURVIVORS) -> None:
        self.min_survivors = min(2, group_size)
        self.groups_per_batch = groups_per_batch
        self.by_stage: dict[str, int] = {}
        self.groups_without_survivors = 0
        self.groups_without_rewards = 0
        """Groups in a row in which no rollout got a reward and some got a missing one (None, NaN)."""
        self.last_error: RolloutError | None = None

    def survivors(
        self, task: Task, outcomes: list[RolloutResult | RolloutError], group_index: int, request_version: int
    ) -> list[Rollout] | None:
        """The group's training rollouts, or None when too few survived (the caller drops the group)."""
        rollouts = []
        for outcome in outcomes:
            if isinstance(outcome, RolloutError):
                self._record(outcome)
            else:
                rollouts.append(rollout_from_result(outcome, group_index, request_version))
        missing = sum(isinstance(o, RolloutError) and o.stage == MISSING_REWARD for o in outcomes)
        return self._tally(task, rollouts, len(outcomes), missing)

    def scored(self, task: Task, rollouts: list[Rollout], rewards: list[float | MissingReward]) -> list[Rollout] | None:
        """Single-turn: set each rollout's reward; those without one are failed rollouts (stage missing_reward).
        The group's rewarded rollouts, or None when too few have a reward (the caller drops the group)."""
        kept = []
        for rollout, reward in zip(rollouts, rewards, strict=True):
            if isinstance(reward, MissingReward):
                self._record(RolloutError(task.id, MISSING_REWARD, f"{type(reward).__name__}: {reward}", 1, 0.0))
            else:
                rollout.reward = reward
                kept.append(rollout)
        return self._tally(task, kept, len(rollouts), len(rollouts) - len(kept))

    def _tally(self, task: Task, rollouts: list[Rollout], num_outcomes: int, num_missing: int) -> list[Rollout] | None:
        self.groups_without_rewards = 0 if rollouts or not num_missing else self.groups_without_rewards + 1
        if self.groups_without_rewards >= self.groups_per_batch:
            raise RewardsMissing(
                f"the environment gave no reward (None or not a finite number) to any rollout of the last "
                f"{self.groups_without_rewards} groups, a batch's worth (last: {self.last_error}); stopping instead "
                "of training on rewards that were never computed. Does the environment score elsewhere (e.g. in a "
                "run loop of its own that Slipstream does not run)? Its reward must return a finite number"
            )
        self.groups_without_survivors = 0 if rollouts else self.groups_without_survivors + 1
        if self.groups_without_survivors >= MAX_GROUPS_WITHOUT_SURVIVORS:
            raise EnvironmentBroken(
                f"the environment failed every rollout of the last {self.groups_without_survivors} groups (last: "
                f"{self.last_error}); failed rollouts by stage: {self.by_stage}. Fix the environment (its first "
                "failure of each stage is logged above with its traceback) and resume the run"
            )
        if len(rollouts) < self.min_survivors:
            log.warning(
                f"group of task {task.id} dropped: {len(rollouts)} of {num_outcomes} rollouts "
                f"survived (at least {self.min_survivors} needed)"
            )
            return None
        return rollouts

    def _record(self, error: RolloutError) -> None:
        self.last_error = error
        first = error.stage not in self.by_stage
        self.by_stage[error.stage] = self.by_stage.get(error.stage, 0) + 1
        log.warning(f"{error} (excluded from training)")
        if first and error.traceback:
            log.warning(f"first {error.stage} failure, traceback:\n{error.traceback.rstrip()}")

    def counters(self) -> dict[str, float]:
        """Cumulative counts of failed rollouts, in total and per stage."""
        counters = {"pipeline/failed_rollouts": float(sum(self.by_stage.values()))}
        counters |= {f"pipeline/failed_rollouts/{stage}": float(n) for stage, n in sorted(self.by_stage.items())}
        return counters
