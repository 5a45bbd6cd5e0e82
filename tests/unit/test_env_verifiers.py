"""verifiers adapter (optional extra): a verifiers v1 taskset played through Slipstream's protocol.

SKIPPED WHEN THE OPTIONAL `verifiers` PACKAGE IS NOT INSTALLED (and only then): `pip install 'slipstream[verifiers]'`.
"""

import pytest

vf = pytest.importorskip("verifiers.v1", reason="optional extra `verifiers` is not installed")

from slipstream.envs.driver_testing import assistant, play  # noqa: E402
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
