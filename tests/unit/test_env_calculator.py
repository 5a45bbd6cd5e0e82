"""calculator: the `calculate` tool evaluates arithmetic safely and exactly; exact answers score 1."""

from fractions import Fraction

import pytest

from slipstream.envs.arith import ExpressionError, format_number, safe_eval
from slipstream.envs.calculator import CalculatorEnv, parse_answer
from slipstream.envs.driver_testing import assistant, play


@pytest.fixture
def env():
    return CalculatorEnv(num_tasks=40, seed=4)


def test_tool_use_then_exact_answer_scores_one(env):
    for task in env.tasks("train")[:10]:
        replies = [
            assistant(tool_calls=[("calculate", {"expression": f"{task.answer} * 2 / 2"})]),
            lambda messages: assistant(f"The result is <answer>{messages[-1]['content']}</answer>."),
        ]
        result = play(env, task, replies)
        assert result.reward.value == 1.0, task.prompt[-1]["content"]
        assert result.reward.metrics["used_tool"] == 1.0 and result.reward.metrics["num_tool_errors"] == 0.0
        assert result.messages[3] == {"role": "tool", "tool_call_id": "call_0", "content": str(task.answer)}


def test_wrong_missing_and_formatted_answers(env):
    task = env.tasks("train")[0]
    assert play(env, task, [assistant(f"<answer>{task.answer + 1}</answer>")]).reward.value == 0.0
    assert play(env, task, [assistant(f"It is {task.answer}.")]).reward.metrics["answered"] == 0.0
    assert play(env, task, [assistant(f"<answer>{task.answer:,}</answer>")]).reward.value == 1.0
    # The rollout runs out of turns while still calling tools: no final answer, no reward.
    calls = [assistant(tool_calls=[("calculate", {"expression": "1+1"})])] * env.max_turns
    result = play(env, task, calls)
    assert result.stop_reason == "max_turns" and result.reward.value == 0.0


def test_tool_errors_go_back_to_the_model(env):
    task = env.tasks("train")[0]
    replies = [
        assistant(tool_calls=[("calculate", {"expression": "__import__('os').system('true')"})]),
        assistant(tool_calls=[("calculate", {"expression": "1/0"}), ("calculate", {"expr": "1"})]),
        assistant(f"<answer>{task.answer}</answer>"),
    ]
    result = play(env, task, replies)
    tool_messages = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "is not allowed" in tool_messages[0] and "division by zero" in tool_messages[1]
    assert "missing required argument(s): expression" in tool_messages[2]
    assert result.reward.value == 1.0 and result.reward.metrics["num_tool_errors"] == 3.0


def test_safe_eval_is_exact_and_bounded():
    assert safe_eval("(1234 * 56) - 789 / 3") == Fraction(1234 * 56 * 3 - 789, 3)
    assert safe_eval("0.1 + 0.2") == Fraction(3, 10) and safe_eval("-2 ** 2") == -4 and safe_eval("7 // 2 % 2") == 1
    assert format_number(Fraction(7, 3)) == "2.33333333333 (exactly 7/3)"
    assert format_number(Fraction(-1, 8)) == "-0.125" and format_number(Fraction(42)) == "42"
    for bad in ["2 ** 10 ** 10", "(10 ** 200) ** 200", "abs(-1)", "x", "[1]", "1 if 1 else 0", "'a' * 3", "1 +"]:
        with pytest.raises(ExpressionError):
            safe_eval(bad)
    with pytest.raises(ExpressionError, match="longer"):
        safe_eval("1+" * 300 + "1")
    with pytest.raises(ExpressionError, match="whole-number"):
        safe_eval("2 ** 0.5")


def test_parse_answer_and_tasks():
    assert parse_answer("<answer> $1,234 </answer>") == 1234
    assert parse_answer("<answer>7/2</answer>") == Fraction(7, 2)
    assert parse_answer("<answer>seven</answer>") is None and parse_answer("7") is None
    a, b = CalculatorEnv(num_tasks=30, seed=1), CalculatorEnv(num_tasks=30, seed=1)
    assert [t.prompt for t in a.tasks("train")] == [t.prompt for t in b.tasks("train")]
    assert all(isinstance(t.answer, int) and t.answer > 0 for t in a.tasks("train"))
    assert a.tools[0]["function"]["name"] == "calculate"
