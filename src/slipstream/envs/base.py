"""Environment protocol: a dataset of tasks per split and a reward for a completion of a task.

Single-turn only for now; a multi-turn protocol (tool use, several model turns) will sit beside it.
"""

import inspect
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""One chat message in OpenAI format, e.g. {"role": "user", "content": "..."}."""


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


async def score(env: Environment, task: Task, completion_text: str) -> float:
    """Reward of one completion, awaiting it when the environment's reward is asynchronous."""
    value = env.reward(task, completion_text)
    if inspect.isawaitable(value):
        value = await value
    return float(value)
