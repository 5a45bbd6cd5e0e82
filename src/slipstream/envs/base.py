"""Environment protocols: single-turn (one reply, one reward) and multi-turn (the environment answers between
model turns, optionally executing OpenAI-format tool calls).

The driver `slipstream.envs.rollout.run_rollout` plays either kind through the same loop (single-turn environments
are wrapped by `slipstream.envs.multiturn.as_multi_turn`) and defines the rollout result and error types.
"""

import inspect
import math
import numbers
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""One chat message in OpenAI format, e.g. {"role": "user", "content": "..."}; an assistant message may carry
`tool_calls`, a tool result is {"role": "tool", "tool_call_id": ..., "content": ...}."""

State = dict[str, Any]
"""Per-rollout state of a multi-turn environment, created by `setup_state` and owned by the environment."""

ToolSchema = dict[str, Any]
"""One tool in OpenAI chat format: {"type": "function", "function": {"name", "description", "parameters"}}."""

DEFAULT_ROLLOUT_TIMEOUT_S = 3600.0
"""Wall-clock budget of one rollout (model turns + environment work) unless the environment says otherwise."""


@dataclass(frozen=True)
class Task:
    """One prompt of an environment."""

    id: str
    """Stable identifier inside its split (used in logs and for resumable sampling)."""
    prompt: list[Message]
    """Chat messages sent to the model."""
    answer: Any = None
    """Reference answer the reward compares against (environment-specific)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra environment-specific payload."""


@dataclass(frozen=True)
class RewardResult:
    """Reward of one rollout: the scalar that trains, plus named metrics that are only logged."""

    value: float
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """A single-turn environment: one model reply per task, scored by `reward`."""

    name: str

    def tasks(self, split: str) -> Sequence[Task]:
        """Tasks of `split` ("train" or "eval"), in a deterministic order."""
        ...

    def reward(self, task: Task, completion_text: str) -> float | Awaitable[float]:
        """Reward of one completion; may be a coroutine function for slow (remote, sandboxed) checks."""
        ...


@runtime_checkable
class MultiTurnEnvironment(Protocol):
    """An environment that answers between model turns (user feedback, tool results) and scores the whole rollout.

    Driver contract, per rollout: `state = await setup_state(task)`; then up to `max_turns` times: the model
    replies to the conversation (with `tools` offered when non-empty), the reply is appended, and
    `new_messages, done = await env_response(messages, state)` is called; the new messages are appended and the
    loop ends when `done`. Then `await reward(task, state)`, and finally `await cleanup(state)` whatever happened.
    Any exception raised by these methods fails that rollout only (see `RolloutError`).
    """

    name: str
    max_turns: int
    """Most model turns per rollout."""
    tools: list[ToolSchema]
    """Tools offered to the model on every turn (empty for none)."""
    rollout_timeout_s: float
    """Wall-clock budget of one rollout, model turns included (hours are fine)."""

    def tasks(self, split: str) -> Sequence[Task]: ...

    async def setup_state(self, task: Task) -> State:
        """Fresh per-rollout state (e.g. a sandbox, the secret word, the turn schedule). If it raises, it must
        release what it acquired itself: `cleanup` only runs for states that were returned."""
        ...

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        """Answer the model's last message (`messages[-1]`): new messages and whether the rollout is done."""
        ...

    async def reward(self, task: Task, state: State) -> RewardResult:
        """Final reward of the rollout, from what `env_response` recorded in `state`."""
        ...

    async def cleanup(self, state: State) -> None:
        """Release per-rollout resources; called once per rollout, also after errors and cancellation."""
        ...


AnyEnvironment = Environment | MultiTurnEnvironment


@runtime_checkable
class SupervisedEnvironment(Protocol):
    """An environment with work of its own to watch for the whole run (an env server's process: envs/server/)."""

    async def supervise(self) -> None:
        """Runs for the whole run; raises to stop the run (e.g. the env server died and is not restarted)."""
        ...

    def counters(self) -> dict[str, float]:
        """Cumulative counts for the run's metrics."""
        ...


def is_multi_turn(env: object) -> bool:
    """True for environments that implement the multi-turn protocol (checked by method, not by base class)."""
    return all(callable(getattr(env, name, None)) for name in ("setup_state", "env_response", "cleanup"))


class MissingReward(ValueError):
    """An environment gave no usable reward (None, not a number, or not finite): the rollout fails, never trains
    as a silent 0.0."""


def checked_reward(value: object, env_name: str, task_id: str) -> float:
    """`value` as a finite float, or MissingReward naming the environment and task."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise MissingReward(
        f"environment {env_name!r} gave task {task_id} no reward (got {value!r:.100}); a reward must be a finite number"
    )


async def score(env: Environment, task: Task, completion_text: str) -> float:
    """Reward of one completion, awaiting it when the environment's reward is asynchronous; MissingReward when it
    is None or not a finite number."""
    if is_multi_turn(env):
        raise TypeError(
            f"environment {env.name!r} is multi-turn: it has no single-completion reward; drive it with "
            "slipstream.envs.rollout.run_rollout"
        )
    value = env.reward(task, completion_text)
    if inspect.isawaitable(value):
        value = await value
    return checked_reward(value, env.name, task.id)
