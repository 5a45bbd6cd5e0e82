"""Adapter for the optional `verifiers` package (v1 API, extra `verifiers`): a verifiers *taskset* played through
Slipstream's protocol, so the orchestrator keeps token-in/token-out and verifiers supplies tasks and scoring.

Supported: tasksets whose tasks open with a prompt and are scored from the transcript (`@vf.reward`, `@vf.metric`,
plugged judges) in one model turn. Not supported, refused with an error at construction: tool servers (toolsets),
tasks that need a container, signals that need a runtime, tasksets without any reward, and environments (`vf.Env`)
that run and score in a loop of their own (e.g. TextArena games): their reward would otherwise train as 0.0.
Verifiers' own rollout machinery (harness programs calling the model through its interception server) is not used:
it owns the model loop and its tokens. The orchestrator runs this adapter in an env server by default (envs/server/).
"""

import inspect
import sys
from collections.abc import Sequence
from typing import Any

try:
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.envs.single_agent import SingleAgentEnv
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.utils.loaders import environment_class
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "the verifiers adapter needs the optional `verifiers` package (v1 API): pip install 'slipstream[verifiers]'"
    ) from e

from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, Message, RewardResult, State, Task
from slipstream.envs.multiturn import MultiTurnEnv, split_tasks

OWN_LOOP_HINT = (
    "Slipstream drives the model turns itself (token-in/token-out) and does not run a verifiers environment's own "
    "loop, so rewards recorded there would never reach training (they would train as a silent 0.0). Use a taskset "
    "whose tasks score the transcript (@vf.reward or judges), or write the game as a Slipstream multi-turn "
    "environment (docs/environments.md)"
)


def load_taskset(taskset: "str | vf.Taskset", taskset_args: dict[str, Any]) -> "vf.Taskset":
    """A taskset object as given, or the installed taskset package `taskset` built with `taskset_args`; refused
    when its environment runs (and scores in) a loop of its own."""
    if isinstance(taskset, vf.Env):
        raise ValueError(
            f"verifiers: {type(taskset).__name__} is an environment (vf.Env), not a taskset. {OWN_LOOP_HINT}"
        )
    if not isinstance(taskset, str):
        if taskset_args:
            raise ValueError("verifiers: taskset_args only apply when the taskset is given by id")
        refuse_own_loop(type(taskset).__name__, _module_envs(sys.modules.get(type(taskset).__module__)))
        return taskset
    refuse_own_loop(taskset, [environment_class(taskset)])
    config_type = vf.taskset_config_type(taskset)
    return vf.load_taskset(config_type(id=taskset, **taskset_args))


def _module_envs(module: Any) -> list[type]:
    """The vf.Env subclasses a taskset's module defines or exports (a package pairs its taskset with its Env)."""
    return [obj for obj in vars(module or object()).values() if isinstance(obj, type) and issubclass(obj, vf.Env)]


def refuse_own_loop(name: str, env_classes: list[type]) -> None:
    """Refuse a taskset paired with an environment whose `run` is its own (a game loop such as TextArena's)."""
    own = [cls.__name__ for cls in env_classes if cls.run is not SingleAgentEnv.run and cls is not vf.Env]
    if own:
        raise ValueError(
            f"verifiers taskset {name} comes with environment {', '.join(own)}, which runs its own loop. "
            f"{OWN_LOOP_HINT}"
        )


def _needs_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def check_supported(taskset: "vf.Taskset", task: "vf.Task") -> None:
    """Refuse what a single chat turn cannot serve (rather than scoring it silently wrong)."""
    name = type(taskset).__name__
    if type(taskset).toolsets(taskset.config) or type(task).toolsets(task.config):
        raise ValueError(f"verifiers taskset {name} uses tool servers (toolsets); the adapter does not support them")
    if type(task).NEEDS_CONTAINER:
        raise ValueError(f"verifiers taskset {name} needs a container; the adapter does not support that")
    signals = [*task.hooks("reward"), *(j.score for j in task.plugged_judges())]
    needing = [getattr(fn, "__name__", repr(fn)) for fn in [*signals, *task.hooks("metric")] if _needs_runtime(fn)]
    if needing:
        raise ValueError(f"verifiers taskset {name}: signals {needing} need a runtime; the adapter has none")
    if not signals:
        raise ValueError(
            f"verifiers taskset {name} defines no reward (no @vf.reward, no judge): every rollout would score 0.0. "
            f"If its environment scores in a loop of its own: {OWN_LOOP_HINT}"
        )
    if task.data.prompt is None:
        raise ValueError(f"verifiers taskset {name} has tasks without a prompt; the adapter needs one")


def to_chat(data: "vf.TaskData") -> list[Message]:
    """A verifiers task's opening messages in OpenAI chat format."""
    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]
    return messages


def to_vf_message(message: Message) -> "vf.Message":
    role = message.get("role")
    if role == "system":
        return vf.SystemMessage(content=message.get("content") or "")
    if role == "user":
        return vf.UserMessage(content=message.get("content") or "")
    if role == "tool":
        return vf.ToolMessage(tool_call_id=message["tool_call_id"], content=message.get("content") or "")
    if role == "assistant":
        calls = [
            vf.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"].get("arguments") or "{}")
            for c in message.get("tool_calls") or []
        ]
        return vf.AssistantMessage(
            content=message.get("content"),
            reasoning_content=message.get("reasoning_content"),
            tool_calls=calls or None,
        )
    raise ValueError(f"verifiers adapter: message with unknown role {role!r}")


def build_trace(task: "vf.Task", messages: list[Message], num_prompt_messages: int) -> "Trace":
    """A verifiers trace of the conversation (a single chain; model replies marked as sampled)."""
    nodes = [
        MessageNode(parent=i - 1 if i else None, message=to_vf_message(m), sampled=i >= num_prompt_messages)
        for i, m in enumerate(messages)
    ]
    trace_task = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
    return Trace(task=trace_task, agent=AgentInfo(config=AgentConfig()), nodes=nodes)


class VerifiersTasksetEnv(MultiTurnEnv):
    """A verifiers taskset as an environment: the last `num_eval_tasks` tasks form the eval split."""

    name = "verifiers"

    def __init__(
        self,
        taskset: "str | vf.Taskset",
        taskset_args: dict[str, Any] | None = None,
        num_eval_tasks: int = 0,
        max_tasks: int | None = None,
        rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S,
    ) -> None:
        super().__init__(max_turns=1, rollout_timeout_s=rollout_timeout_s)
        source = load_taskset(taskset, dict(taskset_args or {}))
        if max_tasks is not None:
            source = source.take(max_tasks)
        if not source.bounded:
            raise ValueError(f"verifiers taskset {type(source).__name__} is infinite; set max_tasks")
        vf_tasks = list(source)
        if len(vf_tasks) <= num_eval_tasks or num_eval_tasks < 0:
            raise ValueError(
                f"verifiers: {len(vf_tasks)} tasks cannot leave {num_eval_tasks} for eval and some to train"
            )
        for vf_task in vf_tasks:
            check_supported(source, vf_task)
        cut = len(vf_tasks) - num_eval_tasks
        self._vf_tasks: dict[str, vf.Task] = {}
        self._tasks: dict[str, list[Task]] = {"train": [], "eval": []}
        for split, chunk in (("train", vf_tasks[:cut]), ("eval", vf_tasks[cut:])):
            for i, vf_task in enumerate(chunk):
                task = Task(id=f"{split}-{i}", prompt=to_chat(vf_task.data), info={"key": vf_task.key})
                self._vf_tasks[task.id] = vf_task
                self._tasks[split].append(task)

    def tasks(self, split: str) -> Sequence[Task]:
        return split_tasks(self.name, self._tasks, split)

    async def setup_state(self, task: Task) -> State:
        return {"num_prompt_messages": len(task.prompt)}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        state["messages"] = list(messages)
        return [], True

    async def reward(self, task: Task, state: State) -> RewardResult:
        vf_task = self._vf_tasks[task.id]
        trace = build_trace(vf_task, state["messages"], state["num_prompt_messages"])
        await vf_task.score(trace)
        metrics = {name: float(value) for name, value in trace.metrics.items() if value is not None}
        metrics |= {f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None}
        return RewardResult(value=float(trace.reward), metrics=metrics)
