"""Model turns against inference, the one path of training rollouts, online evaluation and `slipstream eval`:
single-turn groups (one request for `n` completions) and the turns of multi-turn, tool-using rollouts (one request
per turn, n=1), each streamed so every token is stamped with the policy version served when it arrived.

Stop handling lives here: a turn whose prompt no longer fits the model's context window ends its rollout normally
(stop reason `context_length`, scored as it stands), a turn past its timeout or aborted by the server raises.
"""

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.envs.base import Message, Task, ToolSchema
from slipstream.envs.rollout import ModelFn, ModelTurn, StopRollout
from slipstream.rollout.client import ContextLengthError, GenerationClient, InferenceError
from slipstream.rollout.limiter import CompletionLimiter
from slipstream.rollout.record import Rollout, cache_salt
from slipstream.rollout.replies import parse_chat_response
from slipstream.rollout.streaming import StreamedChat

CONTEXT_LENGTH = "context_length"
"""Stop reason of a rollout whose next turn no longer fits the model's context window."""


def check_not_aborted(task: Task, finish_reasons: list[str | None]) -> None:
    """An `abort` the orchestrator did not cause (it cancels by closing the connection) is an error."""
    if "abort" in finish_reasons:
        raise InferenceError(
            f"task {task.id}: the server aborted a request (finish_reason 'abort') though the orchestrator did not "
            "cancel it; was inference paused with mode=abort, or shut down?"
        )


async def sample_completions(
    client: GenerationClient,
    task: Task,
    params: Mapping[str, Any],
    n: int,
    version: int,
    chat: StreamedChat | None,
    require_routed_experts: bool = False,
) -> list[Rollout]:
    """One request for `n` completions of a single-turn task, sent with `version`'s cache salt: streamed into `chat`
    (tokens stamped as they arrive), or with `chat` None as one whole reply (router replay: vLLM sends routed experts
    only there; tokens stamped with `version`). A prompt that fills the context window raises ContextLengthError."""
    salt = cache_salt(version)
    if chat is not None:
        if chat.n != n:
            raise ValueError(f"a stream of {chat.n} choices cannot take a request for {n} completions")
        async for chunk in client.stream_chat(task.prompt, params, n, salt):
            chat.add(chunk)
        rollouts = chat.rollouts(task, version)
    else:
        reply = await client.chat(task.prompt, params, n, salt)
        rollouts = parse_chat_response(reply, task, n, version, require_routed_experts=require_routed_experts)
    check_not_aborted(task, [r.finish_reason for r in rollouts])
    return rollouts


class TurnProgress:
    """Oldest token version over every turn of a group's rollouts, requests in flight included (the ledger reads
    it to cancel groups whose tokens became too old)."""

    def __init__(self) -> None:
        self._oldest_done: int | None = None
        self._open: dict[int, Callable[[], int | None]] = {}

    @property
    def oldest_version(self) -> int | None:
        floors = [self._oldest_done, *(floor() for floor in self._open.values())]
        known = [v for v in floors if v is not None]
        return min(known) if known else None

    def open(self, key: int, floor: Callable[[], int | None]) -> None:
        """A request started; `floor()` bounds its tokens' versions from below (None: no token yet)."""
        self._open[key] = floor

    def close(self, key: int, versions: list[int]) -> None:
        """A request ended with tokens of `versions` (empty if it failed)."""
        del self._open[key]
        if versions:
            oldest = min(versions)
            self._oldest_done = oldest if self._oldest_done is None else min(self._oldest_done, oldest)


@dataclass
class TurnRequester:
    """Sends the model turns of multi-turn rollouts to inference, one streamed request per turn.

    `ready()` waits until the turn may be sent (no weight update in progress) and returns the served version: the
    request carries that version's cache salt, like a new group. `version_now()` stamps streamed tokens. `limiter`
    (None: none) bounds the turns in flight, one unit each.
    """

    client: GenerationClient
    sampling: Mapping[str, Any]
    request_timeout_s: float
    ready: Callable[[], Awaitable[int]]
    version_now: Callable[[], int]
    limiter: CompletionLimiter | None = None

    def model_fn(
        self, task: Task, progress: TurnProgress | None = None, turn_seed: Callable[[int], int] | None = None
    ) -> ModelFn:
        """The model function of one rollout of `task`; its turns report to the group's `progress` (None: nobody
        watches). Turn t (from 0) is seeded with `turn_seed(t)` (None: unseeded)."""
        num_turns = 0
        session = uuid.uuid4().hex  # every turn of this rollout reaches the same engine behind a router
        progress = progress or TurnProgress()

        async def model(messages: list[Message], tools: list[ToolSchema]) -> ModelTurn:
            nonlocal num_turns
            params = dict(self.sampling)
            if turn_seed is not None:
                params["seed"] = turn_seed(num_turns)
            num_turns += 1
            if tools:
                params |= {"tools": tools, "tool_choice": "auto"}
            units = 0 if self.limiter is None else await self.limiter.acquire(1)
            try:
                return await self._turn(task, messages, params, progress, session)
            finally:
                if self.limiter is not None:
                    await self.limiter.release(units)

        return model

    async def _turn(
        self, task: Task, messages: list[Message], params: dict, progress: TurnProgress, session: str
    ) -> ModelTurn:
        """One model turn: context-length stop, timeout and abort handling around the streamed request."""
        version = await self.ready()
        try:
            async with asyncio.timeout(self.request_timeout_s):
                turn = await self._streamed(task, messages, params, version, progress, session)
        except ContextLengthError:
            raise StopRollout(CONTEXT_LENGTH) from None
        except TimeoutError:
            raise InferenceError(
                f"task {task.id}: no complete reply to a model turn within request_timeout_s = "
                f"{self.request_timeout_s}s"
            ) from None
        check_not_aborted(task, [turn.finish_reason])
        return turn

    async def _streamed(
        self, task: Task, messages: list[Message], params: dict, version: int, progress: TurnProgress, session: str
    ) -> ModelTurn:
        where = f"{self.client.base_url}/v1/chat/completions (stream, task {task.id})"
        chat = StreamedChat(1, self.version_now, where)
        progress.open(id(chat), lambda: chat.oldest_version)
        turn: ModelTurn | None = None
        try:
            async for chunk in self.client.stream_chat(messages, params, 1, cache_salt(version), session):
                chat.add(chunk)
            turn = chat.model_turn(task.id)
        finally:
            progress.close(id(chat), turn.completion_versions if turn is not None else [])
        return turn
