"""Wire types of the env server protocol (msgpack through msgspec, versioned; never pickle).

One request, one reply, matched by `id`. The orchestrator drives rollouts; the server only answers the environment
protocol's calls (`info`, `setup_state`, `env_response`, `reward`, `cleanup`), so model tokens never cross.
"""

from typing import Any

import msgspec

WIRE_VERSION = 1
"""Bumped on any incompatible change; a server answers a request of another version with an error."""

METHODS = ("info", "setup_state", "env_response", "reward", "cleanup")


class Request(msgspec.Struct, frozen=True):
    id: int
    method: str
    args: dict[str, Any] = {}
    version: int = WIRE_VERSION


class Reply(msgspec.Struct, frozen=True):
    id: int
    ok: bool
    result: Any = None
    error: str = ""
    """Exception type and message of a failed call (its traceback is in the server's log)."""
    version: int = WIRE_VERSION


class WireTask(msgspec.Struct, frozen=True):
    id: str
    prompt: list[dict[str, Any]]
    answer: Any = None
    info: dict[str, Any] = {}


class EnvInfo(msgspec.Struct, frozen=True):
    """What the client needs to stand in for the environment: its protocol attributes and its tasks."""

    name: str
    max_turns: int
    tools: list[dict[str, Any]]
    rollout_timeout_s: float
    tasks: dict[str, list[WireTask]]
    """Tasks by split ("train", "eval"); a split the environment lacks is absent."""
    pid: int


class WireReward(msgspec.Struct, frozen=True):
    value: Any
    """The reward as the environment returned it: the driver refuses a missing (None) or non-finite one."""
    metrics: dict[str, float] = {}


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)


def convert(result: Any, kind: type) -> Any:
    """A reply's `result` as the wire type `kind` (raises msgspec.ValidationError on a malformed result)."""
    return msgspec.convert(result, kind)


def to_builtins(value: Any, where: str) -> Any:
    """`value` as msgpack-encodable builtins, with an error naming `where` when it cannot cross processes."""
    try:
        return msgspec.to_builtins(value)
    except (TypeError, msgspec.EncodeError) as e:
        raise TypeError(f"{where} cannot be sent between processes (msgpack): {e}") from e
