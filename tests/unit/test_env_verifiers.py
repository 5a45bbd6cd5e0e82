"""verifiers adapter (optional extra): a verifiers v1 taskset played through Slipstream's protocol.

SKIPPED WHEN THE OPTIONAL `verifiers` PACKAGE IS NOT INSTALLED (and only then): `pip install 'slipstream[verifiers]'`.
"""

import pytest

vf = pytest.importorskip("verifiers.v1", reason="optional extra `verifiers` is not installed")

from slipstream.envs.driver_testing import ScriptedPolicy, assistant, play  # noqa: E402
from slipstream.envs.registry import build_env  # noqa: E402
from slipstream.envs.verifiers_adapter import VerifiersTasksetEnv  # noqa: E402

TASKSET_SOURCE = """
import verifiers.v1 as vf


class EchoData(vf.TaskData):
    answer: str = ""


class EchoTask(vf.Task[EchoData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.5)
    async def mentions(self, task, trace) -> float:
        return float(task.answer in trace.last_reply)

    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class EchoTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        for word in ["alpha", "beta", "gamma"]:
            yield EchoTask(EchoData(prompt=f"Say {word}", answer=word, system_prompt="Be brief."))


class RuntimeTask(EchoTask):
    @vf.reward
    async def in_box(self, runtime) -> float:
        return 1.0


class RuntimeTaskset(vf.Taskset[RuntimeTask, vf.TasksetConfig]):
    def load(self):
        yield RuntimeTask(EchoData(prompt="Say x", answer="x"))
"""


@pytest.fixture
def tasksets(tmp_path, monkeypatch):
    """The example tasksets as an importable module (`echo_taskset`), and as a single-taskset package."""
    (tmp_path / "echo_tasksets.py").write_text(TASKSET_SOURCE)
    (tmp_path / "echo_taskset.py").write_text("from echo_tasksets import EchoTaskset\n\n__all__ = ['EchoTaskset']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import echo_tasksets

    return echo_tasksets


def test_taskset_object_plays_and_scores(tasksets):
    env = VerifiersTasksetEnv(tasksets.EchoTaskset(vf.TasksetConfig()), num_eval_tasks=1)
    assert [t.id for t in env.tasks("train")] == ["train-0", "train-1"] and len(env.tasks("eval")) == 1
    task = env.tasks("train")[0]
    assert task.prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say alpha"}]
    right = play(env, task, [assistant("alpha")])
    assert right.reward.value == 1.5
    assert right.reward.metrics == {"length": 5.0, "reward/exact": 1.0, "reward/mentions": 1.0}
    partial = play(env, task, [assistant("I say alpha")])
    assert partial.reward.value == 0.5
    assert play(env, task, [assistant("beta")]).reward.value == 0.0


def test_taskset_by_id_through_the_registry(tasksets):
    env = build_env("verifiers", taskset="echo_taskset", max_tasks=2)
    assert len(env.tasks("train")) == 2
    task = env.tasks("train")[1]
    assert play(env, task, [assistant("beta")]).reward.value == 1.5


def test_unsupported_tasksets_are_refused(tasksets):
    with pytest.raises(ValueError, match="need a runtime"):
        VerifiersTasksetEnv(tasksets.RuntimeTaskset(vf.TasksetConfig()))
    with pytest.raises(ValueError, match="cannot leave 3 for eval"):
        VerifiersTasksetEnv(tasksets.EchoTaskset(vf.TasksetConfig()), num_eval_tasks=3)
    with pytest.raises(ValueError, match="taskset_args only apply"):
        VerifiersTasksetEnv(tasksets.EchoTaskset(vf.TasksetConfig()), taskset_args={"x": 1})


GAME_SOURCE = """
import verifiers.v1 as vf


class GameTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    pass


class GameEnv(vf.Env[vf.EnvConfig]):
    async def run(self, task, agents):
        ...  # plays the game in its own loop and records the outcome as the trace's reward


class GameTaskset(vf.Taskset[GameTask, vf.TasksetConfig]):
    def load(self):
        yield GameTask(vf.TaskData(prompt="Your move"))


__all__ = ["GameTaskset", "GameEnv"]
"""

SILENT_SOURCE = """
import verifiers.v1 as vf


class SilentTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.metric
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))


class SilentTaskset(vf.Taskset[SilentTask, vf.TasksetConfig]):
    def load(self):
        yield SilentTask(vf.TaskData(prompt="Say x"))
        yield SilentTask(vf.TaskData(prompt="Say y"))


__all__ = ["SilentTaskset"]
"""


@pytest.fixture
def game_modules(tmp_path, monkeypatch):
    (tmp_path / "game_taskset.py").write_text(GAME_SOURCE)
    (tmp_path / "silent_taskset.py").write_text(SILENT_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import game_taskset
    import silent_taskset

    return game_taskset, silent_taskset


def test_an_environment_that_scores_in_its_own_loop_is_refused_not_trained_as_zero(game_modules):
    game, _ = game_modules
    own_loop = "comes with environment GameEnv, which runs its own loop.*would train as a silent 0.0"
    with pytest.raises(ValueError, match=own_loop):
        VerifiersTasksetEnv(game.GameTaskset(vf.TasksetConfig()))
    with pytest.raises(ValueError, match=own_loop):
        build_env("verifiers", taskset="game_taskset")
    with pytest.raises(ValueError, match=r"GameEnv is an environment \(vf.Env\), not a taskset"):
        VerifiersTasksetEnv(object.__new__(game.GameEnv))


def test_a_taskset_without_any_reward_is_refused(game_modules):
    _, silent = game_modules
    with pytest.raises(ValueError, match="SilentTaskset defines no reward .* every rollout would score 0.0"):
        VerifiersTasksetEnv(silent.SilentTaskset(vf.TasksetConfig()))
    with pytest.raises(ValueError, match="defines no reward"):
        build_env("verifiers", taskset="silent_taskset")


def test_a_verifiers_taskset_runs_in_an_env_server_by_default(tasksets, tmp_path, monkeypatch):
    import asyncio
    import os
    import sys

    from slipstream.config.orchestrator import EnvConfig
    from slipstream.envs.hosting import open_environment
    from slipstream.envs.rollout import run_rollout
    from slipstream.envs.server.client import EnvServerClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the env server imports echo_taskset too

    async def main():
        config = EnvConfig(name="verifiers", args={"taskset": "echo_taskset", "num_eval_tasks": 1})
        async with open_environment(config, tmp_path / "run") as env:
            assert isinstance(env, EnvServerClient) and env.process.pid != os.getpid()
            task = env.tasks("train")[0]
            return await run_rollout(env, task, ScriptedPolicy([assistant("alpha")]))

    result = asyncio.run(main())
    assert result.reward.value == 1.5 and result.reward.metrics["reward/exact"] == 1.0
