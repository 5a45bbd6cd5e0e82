"""calculator (tool use): arithmetic word problems with exact integer answers and a `calculate` tool.

The tool evaluates arithmetic exactly and safely (`slipstream.envs.arith`, no `eval`). The model ends the rollout
with a reply without tool calls holding <answer>number</answer>. Reward: 1.0 when that number equals the answer
exactly, else 0.0; tool use and format are logged as metrics.
"""

import random
import re
from collections.abc import Callable, Sequence
from fractions import Fraction

from slipstream.envs.arith import ExpressionError, format_number, safe_eval
from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, RewardResult, State, Task
from slipstream.envs.multiturn import check_task_counts, split_tasks
from slipstream.envs.tools import Tool, ToolEnv, ToolError, tool_metrics

SYSTEM_PROMPT = (
    "Solve the arithmetic word problem. You have a `calculate` tool that evaluates arithmetic expressions exactly "
    "(numbers, parentheses, + - * / // % **); use it for every computation. When you know the result, reply "
    "without calling a tool and put the final number between <answer> and </answer>."
)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


async def calculate(state: State, expression: str) -> str:
    """The `calculate` tool."""
    try:
        return format_number(safe_eval(expression))
    except ExpressionError as e:
        raise ToolError(str(e)) from None


CALCULATE = Tool(
    name="calculate",
    description="Evaluate an arithmetic expression exactly, e.g. '(1234 * 56) - 789 / 3'.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "Numbers, ( ), + - * / // % **."}},
        "required": ["expression"],
    },
    fn=calculate,
)


def parse_answer(text: str) -> Fraction | None:
    """The number in the last <answer>...</answer> (thousands separators and $ allowed), or None."""
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    cleaned = matches[-1].replace(",", "").replace("$", "").strip()
    try:
        return safe_eval(cleaned) if cleaned else None
    except ExpressionError:
        return None


Problem = tuple[str, int]
_TEMPLATES: list[Callable[[random.Random], Problem]] = []


def _template(fn: Callable[[random.Random], Problem]) -> Callable[[random.Random], Problem]:
    _TEMPLATES.append(fn)
    return fn


@_template
def _warehouse(rng: random.Random) -> Problem:
    a, b = rng.randint(120, 980), rng.randint(12, 96)
    c = rng.randint(100, a * b - 1)
    text = f"A warehouse holds {a} boxes of {b} items each. {c} items are shipped out. How many items remain?"
    return text, a * b - c


@_template
def _train(rng: random.Random) -> Problem:
    a, b, c, d = rng.randint(45, 180), rng.randint(2, 14), rng.randint(45, 180), rng.randint(2, 14)
    text = f"A train runs at {a} km/h for {b} hours, then at {c} km/h for {d} hours. How many km does it cover?"
    return text, a * b + c * d


@_template
def _orchards(rng: random.Random) -> Problem:
    a, b, d, q = rng.randint(40, 160), rng.randint(30, 120), rng.randint(3, 12), rng.randint(50, 400)
    while d * q >= a * b:
        q //= 2
    c = a * b - d * q
    text = (
        f"A farmer plants {a} rows of {b} trees. {c} trees die, and the rest are split equally among {d} orchards. "
        "How many trees does each orchard get?"
    )
    return text, q


@_template
def _profit(rng: random.Random) -> Problem:
    a, b = rng.randint(150, 2500), rng.randint(7, 250)
    c = b + rng.randint(1, 120)
    text = f"A shop buys {a} lamps at {b} dollars each and sells all of them at {c} dollars each. What is the profit?"
    return text, a * (c - b)


@_template
def _tank(rng: random.Random) -> Problem:
    b, c, d, e = rng.randint(11, 90), rng.randint(5, 40), rng.randint(11, 90), rng.randint(5, 40)
    a = b * c + rng.randint(500, 9000)
    text = (
        f"A tank holds {a} liters. It drains {b} liters per minute for {c} minutes, then fills at {d} liters per "
        f"minute for {e} minutes. How many liters does it hold at the end?"
    )
    return text, a - b * c + d * e


@_template
def _powers(rng: random.Random) -> Problem:
    a, b = rng.randint(13, 99), rng.randint(11, 60)
    return f"What is {a} squared plus {b} cubed?", a**2 + b**3


@_template
def _factory(rng: random.Random) -> Problem:
    a, w, d = rng.randint(120, 3000), rng.randint(2, 15), rng.randint(1, 6)
    text = f"A factory makes {a} widgets a day. How many widgets does it make in {w} weeks and {d} days?"
    return text, a * (7 * w + d)


class CalculatorEnv(ToolEnv):
    """Word problems drawn from a few templates with random numbers, deterministic from `seed`."""

    name = "calculator"

    def __init__(
        self,
        num_tasks: int = 1000,
        num_eval_tasks: int = 64,
        max_turns: int = 8,
        seed: int = 0,
        rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S,
    ) -> None:
        super().__init__([CALCULATE], max_turns=max_turns, rollout_timeout_s=rollout_timeout_s)
        sizes = check_task_counts(self.name, num_tasks, num_eval_tasks)
        self._tasks = {split: _make_tasks(split, n, seed) for split, n in sizes.items()}

    def tasks(self, split: str) -> Sequence[Task]:
        return split_tasks(self.name, self._tasks, split)

    async def reward(self, task: Task, state: State) -> RewardResult:
        final = state.get("final_message")
        answer = parse_answer((final or {}).get("content") or "")
        correct = answer is not None and answer == task.answer
        metrics = {
            "correct": float(correct),
            "answered": float(answer is not None),
            "used_tool": float(state.get("num_tool_calls", 0) > 0),
        }
        return RewardResult(value=float(correct), metrics=metrics | tool_metrics(state))


def _make_tasks(split: str, num_tasks: int, seed: int) -> list[Task]:
    rng = random.Random(f"calculator:{split}:{seed}")
    tasks = []
    for i in range(num_tasks):
        text, answer = rng.choice(_TEMPLATES)(rng)
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
        tasks.append(Task(id=f"{split}-{i}", prompt=prompt, answer=answer))
    return tasks
