"""Building blocks of multi-turn environments: a base class with the protocol's defaults, the adapter that makes a
single-turn environment look multi-turn to a driver, and a helper for per-split task lists.
"""

from collections.abc import Sequence

from slipstream.envs.base import (
    DEFAULT_ROLLOUT_TIMEOUT_S,
    AnyEnvironment,
    Environment,
    Message,
    MultiTurnEnvironment,
    RewardResult,
    State,
    Task,
    ToolSchema,
    is_multi_turn,
    score,
)

SPLITS = ("train", "eval")


class MultiTurnEnv:
    """Base class of the built-in multi-turn environments: validates the shared knobs and provides no-op
    `setup_state`/`cleanup`. Subclasses implement `tasks`, `env_response` and `reward`."""

    name: str = ""

    def __init__(
        self,
        max_turns: int,
        rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S,
        tools: list[ToolSchema] | None = None,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"{self.name}: max_turns must be >= 1, got {max_turns}")
        if not rollout_timeout_s > 0:
            raise ValueError(f"{self.name}: rollout_timeout_s must be > 0 seconds, got {rollout_timeout_s}")
        self.max_turns = max_turns
        self.rollout_timeout_s = float(rollout_timeout_s)
        self.tools: list[ToolSchema] = list(tools or [])

    async def setup_state(self, task: Task) -> State:
        return {}

    async def cleanup(self, state: State) -> None:
        return None


class SingleTurnAdapter(MultiTurnEnv):
    """A single-turn `Environment` seen through the multi-turn protocol: one model turn, then its reward."""

    def __init__(self, env: Environment, rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S) -> None:
        self.name = env.name
        super().__init__(max_turns=1, rollout_timeout_s=rollout_timeout_s)
        self.env = env

    def tasks(self, split: str) -> Sequence[Task]:
        return self.env.tasks(split)

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        state["completion_text"] = messages[-1].get("content") or ""
        return [], True

    async def reward(self, task: Task, state: State) -> RewardResult:
        return RewardResult(value=await score(self.env, task, state["completion_text"]))


def as_multi_turn(env: AnyEnvironment) -> MultiTurnEnvironment:
    """`env` itself when it is multi-turn, else wrapped in a `SingleTurnAdapter`."""
    if is_multi_turn(env):
        return env  # type: ignore[return-value]
    if not callable(getattr(env, "reward", None)) or not callable(getattr(env, "tasks", None)):
        raise TypeError(f"{type(env).__name__} implements neither the single-turn nor the multi-turn protocol")
    return SingleTurnAdapter(env)  # type: ignore[arg-type]


def split_tasks(env_name: str, tasks_by_split: dict[str, list[Task]], split: str) -> Sequence[Task]:
    """The tasks of `split`, with an error naming the known splits."""
    if split not in tasks_by_split:
        raise ValueError(f"{env_name} has no split {split!r}; splits: {', '.join(tasks_by_split)}")
    return tasks_by_split[split]


def check_task_counts(env_name: str, num_tasks: int, num_eval_tasks: int) -> dict[str, int]:
    """Validated sizes of the train and eval splits."""
    if num_tasks < 1 or num_eval_tasks < 0:
        raise ValueError(f"{env_name} needs num_tasks >= 1 and num_eval_tasks >= 0, got {num_tasks}, {num_eval_tasks}")
    return {"train": num_tasks, "eval": num_eval_tasks}


def last_assistant_text(messages: list[Message]) -> str:
    """Content of the last assistant message ("" when there is none or it has no text)."""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return ""
