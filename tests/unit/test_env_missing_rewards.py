"""Missing rewards never train as 0.0 (issue #14 item 8): a None or non-finite reward fails its rollout (stage
`missing_reward`, counted), and a batch's worth of groups in a row without any reward stops the run."""

import asyncio
import math

import pytest

from slipstream.envs.base import MissingReward, Task, checked_reward, score
from slipstream.envs.rollout import MISSING_REWARD, RolloutError
from slipstream.orchestrator.multiturn import (
    EnvironmentBroken,
    RewardsMissing,
    RolloutFailures,
    reward_or_missing,
)
from slipstream.rollout.record import Rollout

TASK = Task(id="t0", prompt=[{"role": "user", "content": "hi"}])


class SingleTurn:
    name = "single"

    def __init__(self, value: object) -> None:
        self.value = value

    def tasks(self, split: str) -> list[Task]:
        return [TASK]

    async def reward(self, task: Task, completion_text: str) -> object:
        return self.value


def rollout() -> Rollout:
    return Rollout(TASK, [1], [2], [-1.0], "text", [0], 0)


def missing() -> RolloutError:
    return RolloutError("t0", MISSING_REWARD, "MissingReward: no reward", 1, 0.0)


@pytest.mark.parametrize("value", [None, math.nan, math.inf, "1.0", True])
def test_a_reward_that_is_not_a_finite_number_is_missing(value):
    with pytest.raises(MissingReward, match="environment 'single' gave task t0 no reward"):
        asyncio.run(score(SingleTurn(value), TASK, "x"))
    assert isinstance(asyncio.run(reward_or_missing(SingleTurn(value), TASK, "x")), MissingReward)
    assert checked_reward(0.5, "e", "t") == 0.5 and asyncio.run(score(SingleTurn(0), TASK, "x")) == 0.0


def test_single_turn_rollouts_without_a_reward_are_left_out_and_counted():
    failures = RolloutFailures(group_size=3, groups_per_batch=2)
    rollouts = [rollout(), rollout(), rollout()]
    kept = failures.scored(TASK, rollouts, [1.0, MissingReward("none"), 0.0])
    assert kept == [rollouts[0], rollouts[2]] and [r.reward for r in kept] == [1.0, 0.0]
    assert failures.counters()["pipeline/failed_rollouts/missing_reward"] == 1
    # too few rewarded rollouts: the group is dropped, not trained
    assert failures.scored(TASK, [rollout(), rollout()], [MissingReward("none"), 1.0]) is None


def test_a_batch_worth_of_groups_without_rewards_stops_the_run():
    failures = RolloutFailures(group_size=2, groups_per_batch=3)
    for _ in range(2):
        assert failures.scored(TASK, [rollout(), rollout()], [MissingReward("a"), MissingReward("b")]) is None
    assert failures.scored(TASK, [rollout(), rollout()], [0.0, 1.0]) is not None  # one rewarded group resets it
    for _ in range(2):
        assert failures.survivors(TASK, [missing(), missing()], 0, 0) is None
    with pytest.raises(RewardsMissing, match="no reward .* to any rollout of the last 3 groups, a batch's worth"):
        failures.survivors(TASK, [missing(), missing()], 0, 0)
    assert issubclass(RewardsMissing, EnvironmentBroken)


def test_other_failures_do_not_count_as_missing_rewards():
    failures = RolloutFailures(group_size=2, groups_per_batch=1)
    crashed = RolloutError("t0", "env_response", "RuntimeError: x", 1, 0.0)
    assert failures.survivors(TASK, [crashed, crashed], 0, 0) is None  # a flaky environment, not a missing reward
    assert failures.groups_without_rewards == 0


class EveryOtherMissing(SingleTurn):
    """Rewards 1.0, None, 1.0, None, ...: half the rollouts have no reward."""

    def __init__(self) -> None:
        super().__init__(None)
        self.num_calls = 0

    def tasks(self, split: str) -> list[Task]:
        return [Task(id=f"t{i}", prompt=TASK.prompt) for i in range(4)]

    async def reward(self, task: Task, completion_text: str) -> object:
        self.num_calls += 1
        return 1.0 if self.num_calls % 2 else None


def test_the_orchestrator_trains_only_rewarded_rollouts_and_stops_when_none_are(tmp_path, monkeypatch):
    from tests.unit.test_orch_loop import FakeVLLM, make_config, run_with_trainer, step_metrics

    fields = dict(max_steps=2, batch_size=4, group_size=4, num_trainer_ranks=1)
    monkeypatch.setattr("slipstream.envs.hosting.build_env", lambda name, **args: EveryOtherMissing())
    run_with_trainer(make_config(tmp_path / "half", "", **fields), FakeVLLM(), 1)
    for m in step_metrics(tmp_path / "half", 2):
        assert m["batch/num_rollouts"] == 2 and m["pipeline/failed_rollouts/missing_reward"] >= 2

    never = EveryOtherMissing()
    never.reward = SingleTurn(math.nan).reward  # every reward NaN
    monkeypatch.setattr("slipstream.envs.hosting.build_env", lambda name, **args: never)
    with pytest.raises(RewardsMissing, match="last 1 groups, a batch's worth"):
        run_with_trainer(make_config(tmp_path / "none", "", **fields), FakeVLLM(), 1)
    assert not (tmp_path / "none" / "rollouts").exists() or not any((tmp_path / "none" / "rollouts").iterdir())
