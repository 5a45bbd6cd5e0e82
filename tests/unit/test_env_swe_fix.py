"""swe_fix: a scripted oracle that applies the known fix through the tools scores 1.0; doing nothing scores 0.0.

Runs in the bubblewrap sandbox where this machine can isolate; elsewhere it opts out explicitly (the commands are
this test's own, trusted), so the environment's logic is covered either way.
"""

import asyncio
import random
import warnings
from pathlib import Path

import pytest

from slipstream.envs.driver_testing import ScriptedPolicy, assistant, play
from slipstream.envs.rollout import run_rollout
from slipstream.envs.swe_fix import SweFixEnv
from slipstream.envs.swe_fix import env as swe_fix_env
from slipstream.envs.swe_fix.repos import apply_fix, generate_repo, num_templates
from slipstream.sandbox import Isolation, SandboxUnavailable, detect_isolation

ISOLATED = detect_isolation().available


def make_env(**args) -> SweFixEnv:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the unsandboxed opt-out warning, where it applies
        return SweFixEnv(num_tasks=2 * num_templates(), num_eval_tasks=2, allow_unsandboxed=not ISOLATED, **args)


def oracle(task):
    test_command = f"python3 -m unittest {task.info['test_module']}"
    return [
        assistant("Let me look.", tool_calls=[("bash", {"command": f"cat {task.answer['path']}; {test_command}"})]),
        assistant(tool_calls=[("edit_file", task.answer)]),
        assistant(tool_calls=[("bash", {"command": test_command})]),
        assistant("Fixed the bug; the tests pass."),
    ]


@pytest.fixture(scope="module")
def env():
    return make_env()


def test_oracle_scores_one_on_every_template(env):
    tasks = env.tasks("train")[: num_templates()]

    async def all_at_once():
        return await asyncio.gather(*(run_rollout(env, task, ScriptedPolicy(oracle(task))) for task in tasks))

    for task, result in zip(tasks, asyncio.run(all_at_once()), strict=True):
        assert result.reward.value == 1.0, (task.info["repo"], result)
        tool_outputs = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert "FAILED" in tool_outputs[0] and tool_outputs[1] == f"edited {task.answer['path']}"
        assert tool_outputs[2].startswith("exit code: 0") and "OK" in tool_outputs[2]
        assert result.reward.metrics["tests_ran"] == task.info["num_tests"]


def test_do_nothing_scores_zero(env):
    for task in env.tasks("train")[:3]:
        result = play(env, task, [assistant("Looks fine to me.")])
        assert result.reward.value == 0.0 and result.reward.metrics["tests_ran"] == task.info["num_tests"]


def test_write_file_oracle_scores_one(env):
    task = env.tasks("eval")[0]
    fixed = apply_fix(task.info["files"], _fix(task))[task.answer["path"]]
    result = play(
        env,
        task,
        [assistant(tool_calls=[("write_file", {"path": task.answer["path"], "content": fixed})]), assistant("done")],
    )
    assert result.reward.value == 1.0


def test_editing_or_deleting_the_tests_does_not_pay(env):
    task = env.tasks("train")[1]
    test_path = f"{task.info['test_module'].replace('.', '/')}.py"
    fake = "import unittest\n\nclass T(unittest.TestCase):\n    def test(self):\n        pass\n"
    rewrite = [assistant(tool_calls=[("write_file", {"path": test_path, "content": fake})]), assistant("done")]
    assert play(env, task, rewrite).reward.value == 0.0
    delete = [assistant(tool_calls=[("bash", {"command": "rm -rf tests"})]), assistant("done")]
    assert play(env, task, delete).reward.value == 0.0
    sabotage = [assistant(tool_calls=[("bash", {"command": "rm -rf tests && ln -s /usr tests"})]), assistant("done")]
    result = play(env, task, sabotage)
    assert result.reward.value == 0.0 and result.reward.metrics["tests_ran"] == 0.0


def test_file_tool_errors_reach_the_model(env):
    task = env.tasks("train")[0]
    path = task.answer["path"]
    calls = [
        ("edit_file", {"path": path, "old_text": "no such text", "new_text": "x"}),
        ("edit_file", {"path": path, "old_text": "", "new_text": "x"}),
        ("edit_file", {"path": "missing.py", "old_text": "a", "new_text": "b"}),
        ("write_file", {"path": "../escape.py", "content": "x"}),
        ("bash", {"command": "exit 3"}),
    ]
    result = play(env, task, [assistant(tool_calls=calls), assistant("done")])
    outputs = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "occurs 0 times" in outputs[0] and "occurs 0 times" in outputs[1]
    assert "cannot read missing.py" in outputs[2] and "outside the repository" in outputs[3]
    assert outputs[4].startswith("exit code: 3")
    assert result.reward.metrics["num_tool_errors"] == 4.0


def test_each_rollout_gets_a_fresh_repository_that_is_removed_afterwards(env, monkeypatch):
    task = env.tasks("train")[0]
    seen = []
    record = lambda messages: (seen.append(messages), assistant("done"))[1]  # noqa: E731
    original = SweFixEnv.setup_state

    async def spy(self, t):
        state = await original(self, t)
        seen.append(state["workdir"])
        return state

    monkeypatch.setattr(SweFixEnv, "setup_state", spy)
    play(env, task, [assistant(tool_calls=[("bash", {"command": "echo broken > README.md"})]), record])
    play(env, task, [assistant(tool_calls=[("bash", {"command": "cat README.md"})]), record])
    workdirs = [s for s in seen if isinstance(s, Path)]
    assert len(workdirs) == 2 and workdirs[0] != workdirs[1] and not any(p.exists() for p in workdirs)
    assert "broken" not in seen[-1][-1]["content"]


def test_tasks_are_deterministic_and_cover_every_template():
    a, b = make_env(), make_env()
    assert [t.info for t in a.tasks("train")] == [t.info for t in b.tasks("train")]
    assert len({t.info["test_module"] for t in a.tasks("train")}) >= num_templates() - 1
    spec = generate_repo(random.Random(0), 0)
    assert set(spec.test_files) <= set(spec.files) and spec.fix.path in spec.files


def test_refuses_without_isolation_unless_opted_out(monkeypatch):
    monkeypatch.setattr(swe_fix_env, "detect_isolation", lambda: Isolation(False, "test: no namespaces"))
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed"):
        SweFixEnv(num_tasks=1)


def _fix(task):
    from slipstream.envs.swe_fix.repos import Fix

    return Fix(task.answer["path"], task.answer["old_text"], task.answer["new_text"])
