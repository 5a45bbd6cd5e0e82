"""Tool environments: tools in OpenAI chat format, executed by the environment between model turns.

The model's tool calls arrive as `tool_calls` on its assistant message (parsed by vLLM's tool parser); each call
is answered by a `role: tool` message. Mistakes of the model (unknown tool, arguments that are not JSON or do not
fit the schema, a `ToolError` raised by the tool) are answered with an error message and the rollout goes on;
any other exception is a bug of the environment and fails the rollout.
"""

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, Message, State, ToolSchema
from slipstream.envs.multiturn import MultiTurnEnv

ToolFn = Callable[..., Awaitable[str]]
"""`await fn(state, **arguments)` -> the text returned to the model."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


class ToolError(Exception):
    """A tool failed in a way the model should hear about (bad path, no match, invalid expression)."""


@dataclass(frozen=True)
class Tool:
    """One tool: its JSON-schema signature and the coroutine function that runs it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object ({"type": "object", "properties": ..., "required": [...]})."""
    fn: ToolFn

    @property
    def schema(self) -> ToolSchema:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def validate_arguments(parameters: dict[str, Any], arguments: object) -> str | None:
    """Why `arguments` do not fit the `parameters` schema (required keys, unknown keys, primitive types), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties: dict[str, Any] = parameters.get("properties", {})
    missing = [key for key in parameters.get("required", []) if key not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    unknown = [key for key in arguments if key not in properties]
    if unknown:
        return f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties)}"
    for key, value in arguments.items():
        expected = properties[key].get("type")
        types = _JSON_TYPES.get(expected) if isinstance(expected, str) else None
        wrong_bool = isinstance(value, bool) and expected in ("integer", "number")
        if types is not None and (not isinstance(value, types) or wrong_bool):
            return f"argument {key!r} must be of type {expected}, got {type(value).__name__}"
    return None


def parse_arguments(raw: object) -> tuple[dict[str, Any] | None, str | None]:
    """Tool-call arguments (a JSON string, or an already decoded object) -> (arguments, error)."""
    if isinstance(raw, dict):
        return raw, None
    if not isinstance(raw, str):
        return None, f"arguments must be a JSON string, got {type(raw).__name__}"
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as e:
        return None, f"arguments are not valid JSON ({e.msg} at position {e.pos})"
    if not isinstance(value, dict):
        return None, f"arguments must be a JSON object, got {type(value).__name__}"
    return value, None


def tool_message(call_id: str, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


class ToolEnv(MultiTurnEnv):
    """Multi-turn environment whose environment turns are the results of the model's tool calls.

    A model turn without tool calls ends the rollout (it is the final answer, kept in `state["final_message"]`).
    Counters `state["num_tool_calls"]` and `state["num_tool_errors"]` are kept for metrics.
    """

    def __init__(
        self, tools: Sequence[Tool], max_turns: int, rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S
    ) -> None:
        names = [tool.name for tool in tools]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"{self.name}: tool names must be unique and non-empty, got {names}")
        super().__init__(max_turns, rollout_timeout_s, tools=[tool.schema for tool in tools])
        self.tool_fns = {tool.name: tool for tool in tools}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        last = messages[-1]
        calls = last.get("tool_calls") or []
        if not calls:
            state["final_message"] = last
            return [], True
        # Sequential on purpose: a later call may depend on an earlier one (edit a file, then run the tests).
        return [await self.call_tool(call, state) for call in calls], False

    async def call_tool(self, call: dict[str, Any], state: State) -> Message:
        """Run one OpenAI-format tool call; model mistakes become an error result."""
        call_id = call.get("id")
        if not isinstance(call_id, str):
            raise ValueError(f"tool call without an id (the server's tool parser must set one): {call!r:.200}")
        state["num_tool_calls"] = state.get("num_tool_calls", 0) + 1
        function = call.get("function") or {}
        name = function.get("name")
        tool = self.tool_fns.get(name)
        if tool is None:
            return self._failed(state, call_id, f"unknown tool {name!r}; tools: {', '.join(self.tool_fns)}")
        arguments, problem = parse_arguments(function.get("arguments", "{}"))
        problem = problem or validate_arguments(tool.parameters, arguments)
        if problem is not None:
            return self._failed(state, call_id, f"{name}: {problem}")
        try:
            content = await tool.fn(state, **arguments)
        except ToolError as e:
            return self._failed(state, call_id, f"{name}: {e}")
        return tool_message(call_id, content)

    @staticmethod
    def _failed(state: State, call_id: str, error: str) -> Message:
        state["num_tool_errors"] = state.get("num_tool_errors", 0) + 1
        return tool_message(call_id, f"error: {error}")


def tool_metrics(state: State) -> dict[str, float]:
    """Tool-call counters of a rollout as metrics."""
    return {
        "num_tool_calls": float(state.get("num_tool_calls", 0)),
        "num_tool_errors": float(state.get("num_tool_errors", 0)),
    }


def make_tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-format tool call (as vLLM's tool parsers return it)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
