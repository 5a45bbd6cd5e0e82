"""Multi-turn protocol and rollout driver: turn loop, single-turn adapter, tool calls, per-rollout errors, timeouts."""

import asyncio

import pytest

from slipstream.envs.base import Environment, MultiTurnEnvironment, RewardResult, Task, is_multi_turn, score
from slipstream.envs.driver_testing import ScriptedPolicy, assistant, play
from slipstream.envs.multiturn import MultiTurnEnv, SingleTurnAdapter, as_multi_turn
from slipstream.envs.registry import build_env, known_envs
from slipstream.envs.reverse_text import ReverseTextEnv
from slipstream.envs.rollout import RolloutError, RolloutResult, StopRollout, run_rollout
from slipstream.envs.tools import Tool, ToolEnv, ToolError, validate_arguments

TASK = Task(id="t0", prompt=[{"role": "user", "content": "count with me"}])


class CountingEnv(MultiTurnEnv):
    """Says the next number each turn; done after `stop_after` turns. Can be told to fail in one stage."""

    name = "counting"

    def __init__(self, max_turns=5, stop_after=3, fail_in=None, sleep_s=0.0, timeout_s=60.0):
        super().__init__(max_turns=max_turns, rollout_timeout_s=timeout_s)
        self.stop_after, self.fail_in, self.sleep_s = stop_after, fail_in, sleep_s
        self.cleaned: list[dict] = []

    def tasks(self, split):
        return [TASK]

    async def setup_state(self, task):
        if self.fail_in == "setup_state":
            raise RuntimeError("setup broke")
        return {"seen": []}

    async def env_response(self, messages, state):
        await asyncio.sleep(self.sleep_s)
        state["seen"].append(messages[-1]["content"])
        if self.fail_in == "env_response" and len(state["seen"]) == 2:
            raise KeyError("env bug")
        done = len(state["seen"]) >= self.stop_after
        return ([] if done else [{"role": "user", "content": str(len(state["seen"]))}]), done

    async def reward(self, task, state):
        if self.fail_in == "reward":
            raise ZeroDivisionError("reward bug")
        return RewardResult(value=len(state["seen"]) / 10, metrics={"turns": float(len(state["seen"]))})

    async def cleanup(self, state):
        self.cleaned.append(state)
        if self.fail_in == "cleanup":
            raise OSError("cleanup bug")


def test_turn_loop_ends_when_env_is_done():
    env = CountingEnv(stop_after=3)
    result = play(env, TASK, [assistant(f"reply {i}") for i in range(3)])
    assert isinstance(result, RolloutResult) and result.stop_reason == "env_done"
    assert [m["role"] for m in result.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert result.reward == RewardResult(0.3, {"turns": 3.0})
    assert len(result.turns) == 3 and env.cleaned == [{"seen": ["reply 0", "reply 1", "reply 2"]}]


def test_max_turns_stops_the_rollout_and_the_model_sees_the_conversation():
    env = CountingEnv(max_turns=2, stop_after=10)
    policy = ScriptedPolicy([assistant("a"), assistant("b")])
    result = asyncio.run(run_rollout(env, TASK, policy))
    assert result.stop_reason == "max_turns" and len(result.turns) == 2
    assert policy.seen_messages[1][-2:] == [{"role": "assistant", "content": "a"}, {"role": "user", "content": "1"}]
    assert policy.seen_tools == [[], []]


def test_model_can_stop_a_rollout_normally():
    async def model(messages, tools):
        raise StopRollout("context_full")

    result = asyncio.run(run_rollout(CountingEnv(), TASK, model))
    assert isinstance(result, RolloutResult) and result.stop_reason == "context_full" and result.turns == []


@pytest.mark.parametrize("stage", ["setup_state", "env_response", "reward", "cleanup"])
def test_an_environment_error_fails_that_rollout_only(stage):
    env = CountingEnv(fail_in=stage)

    async def many():
        good = CountingEnv()
        runs = [run_rollout(env, TASK, ScriptedPolicy([assistant("x")] * 3))]
        runs += [run_rollout(good, TASK, ScriptedPolicy([assistant("x")] * 3)) for _ in range(3)]
        return await asyncio.gather(*runs)

    failed, *others = asyncio.run(many())
    expected = {
        "setup_state": "setup broke",
        "env_response": "env bug",
        "reward": "reward bug",
        "cleanup": "cleanup bug",
    }
    assert isinstance(failed, RolloutError) and failed.stage == stage and expected[stage] in failed.error
    assert expected[stage] in failed.traceback
    assert all(isinstance(r, RolloutResult) for r in others)
    assert str(failed).startswith("rollout of task t0 failed in " + stage)
    assert len(env.cleaned) == (0 if stage == "setup_state" else 1)


def test_model_errors_propagate_to_the_caller():
    async def model(messages, tools):
        raise ConnectionError("inference down")

    env = CountingEnv()
    with pytest.raises(ConnectionError):
        asyncio.run(run_rollout(env, TASK, model))
    assert len(env.cleaned) == 1


def test_per_rollout_timeout():
    env = CountingEnv(sleep_s=0.3, timeout_s=0.5)
    result = play(env, TASK, [assistant("x")] * 3)
    assert isinstance(result, RolloutError) and result.stage == "timeout" and "0.5 s budget" in result.error
    assert len(env.cleaned) == 1
    # The caller's budget overrides the environment's.
    assert isinstance(play(env, TASK, [assistant("x")] * 3, timeout_s=30), RolloutResult)


def test_single_turn_envs_work_unchanged_and_through_the_adapter():
    env = build_env("reverse_text", num_tasks=3)
    assert isinstance(env, Environment) and not is_multi_turn(env)
    task = env.tasks("train")[0]
    assert asyncio.run(score(env, task, task.answer)) == 1.0
    adapted = as_multi_turn(env)
    assert isinstance(adapted, SingleTurnAdapter) and isinstance(adapted, MultiTurnEnvironment)
    assert adapted.max_turns == 1 and adapted.tasks("train") is env.tasks("train")
    result = play(env, task, [assistant(f"<reversed_text>{task.answer}</reversed_text>")])
    assert result.reward.value == 1.0 and result.stop_reason == "env_done"
    multi = CountingEnv()
    assert as_multi_turn(multi) is multi
    with pytest.raises(TypeError, match="multi-turn"):
        asyncio.run(score(multi, TASK, "text"))
    with pytest.raises(TypeError, match="neither"):
        as_multi_turn(object())


def test_registry_knows_every_builtin():
    assert {"reverse_text", "alphabet_sort", "wordle", "calculator", "swe_fix", "verifiers"} <= set(known_envs())
    assert isinstance(build_env("alphabet_sort", num_tasks=2), MultiTurnEnvironment)
    with pytest.raises(ValueError, match="orchestrator.env.args"):
        build_env("wordle", bogus=1)
    with pytest.raises(ValueError, match="max_turns"):
        CountingEnv(max_turns=0)
    with pytest.raises(ValueError, match="rollout_timeout_s"):
        CountingEnv(timeout_s=0)
    assert isinstance(ReverseTextEnv(num_tasks=1), Environment)


async def _echo(state, text: str, times: int = 1) -> str:
    if times < 0:
        raise ToolError("times must be >= 0")
    state.setdefault("echoed", []).append(text)
    return text * times


ECHO = Tool(
    "echo",
    "Repeat text.",
    {
        "type": "object",
        "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
        "required": ["text"],
    },
    _echo,
)


class EchoEnv(ToolEnv):
    name = "echo"

    def tasks(self, split):
        return [TASK]

    async def reward(self, task, state):
        return RewardResult(float(state.get("echoed") == ["hi", "yo"]), {"calls": float(state["num_tool_calls"])})


def test_tool_calls_are_executed_and_model_mistakes_are_answered():
    env = EchoEnv([ECHO], max_turns=4)
    bad_json = {"id": "call_9", "type": "function", "function": {"name": "echo", "arguments": "{not json"}}
    replies = [
        assistant(tool_calls=[("echo", {"text": "hi", "times": 2}), ("nope", {})]),
        {**assistant(tool_calls=[("echo", {"times": "x", "text": "a"})]), "tool_calls": [bad_json]},
        assistant(tool_calls=[("echo", {"text": "yo"}), ("echo", {"text": "z", "times": -1})]),
        assistant("done"),
    ]
    policy = ScriptedPolicy(replies)
    result = asyncio.run(run_rollout(env, TASK, policy))
    assert policy.seen_tools[0] == [ECHO.schema]
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert tool_messages[0] == {"role": "tool", "tool_call_id": "call_0", "content": "hihi"}
    assert "unknown tool 'nope'" in tool_messages[1]["content"]
    assert "not valid JSON" in tool_messages[2]["content"] and tool_messages[2]["tool_call_id"] == "call_9"
    assert tool_messages[3]["content"] == "yo" and "times must be >= 0" in tool_messages[4]["content"]
    assert result.reward == RewardResult(1.0, {"calls": 5.0}) and result.stop_reason == "env_done"


def test_argument_validation():
    schema = ECHO.parameters
    assert validate_arguments(schema, {"text": "a"}) is None
    assert "missing" in validate_arguments(schema, {})
    assert "unknown" in validate_arguments(schema, {"text": "a", "x": 1})
    assert "integer" in validate_arguments(schema, {"text": "a", "times": 1.5})
    assert "integer" in validate_arguments(schema, {"text": "a", "times": True})
    assert "JSON object" in validate_arguments(schema, [1])
    with pytest.raises(ValueError, match="unique"):
        EchoEnv([ECHO, ECHO], max_turns=2)
