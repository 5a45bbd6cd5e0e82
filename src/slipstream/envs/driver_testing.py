"""Scripted policies for tests: play an environment through the real rollout driver without an LLM."""

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from slipstream.envs.base import AnyEnvironment, Message, Task, ToolSchema
from slipstream.envs.rollout import ModelTurn, RolloutError, RolloutResult, run_rollout
from slipstream.envs.tools import make_tool_call

Reply = Message | Callable[[list[Message]], Message]
"""A scripted reply: a fixed assistant message, or a function of the conversation so far."""


def assistant(content: str = "", tool_calls: Sequence[tuple[str, dict[str, Any]]] = ()) -> Message:
    """An assistant message; `tool_calls` are (tool name, arguments) pairs, given ids call_0, call_1, ..."""
    message: Message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [make_tool_call(f"call_{i}", name, args) for i, (name, args) in enumerate(tool_calls)]
    return message


class ScriptedPolicy:
    """A model function (see `slipstream.envs.rollout.ModelFn`) replying from a script, one entry per turn.

    It records what it was shown: `seen_messages[k]` and `seen_tools[k]` are the conversation and tools of turn k.
    Running out of script is an error (the environment asked for more turns than the test expected).
    """

    def __init__(self, replies: Sequence[Reply]) -> None:
        self.replies = list(replies)
        self.seen_messages: list[list[Message]] = []
        self.seen_tools: list[list[ToolSchema]] = []

    async def __call__(self, messages: list[Message], tools: list[ToolSchema]) -> ModelTurn:
        turn = len(self.seen_messages)
        if turn >= len(self.replies):
            raise RuntimeError(f"scripted policy has {len(self.replies)} replies but the environment asked for more")
        self.seen_messages.append(messages)
        self.seen_tools.append(tools)
        reply = self.replies[turn]
        message = reply(messages) if callable(reply) else reply
        return ModelTurn(message=dict(message), finish_reason="tool_calls" if message.get("tool_calls") else "stop")


def play(
    env: AnyEnvironment, task: Task, replies: Sequence[Reply], timeout_s: float | None = None
) -> RolloutResult | RolloutError:
    """Play `task` with a scripted policy through `run_rollout` (blocking)."""
    return asyncio.run(run_rollout(env, task, ScriptedPolicy(replies), timeout_s=timeout_s))
