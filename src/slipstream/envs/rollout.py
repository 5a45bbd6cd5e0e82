"""Rollout driver: plays one task of any environment through the multi-turn protocol against a model function.

The model function is the caller's (the orchestrator's vLLM client, or a scripted policy in tests); this module
owns the protocol's rules: turn limit, per-rollout wall-clock timeout, cleanup, and that an exception inside the
environment fails that rollout only, as a `RolloutError` the caller counts and excludes from training.
"""

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from slipstream.envs.base import (
    AnyEnvironment,
    Message,
    MissingReward,
    RewardResult,
    State,
    Task,
    ToolSchema,
    checked_reward,
)
from slipstream.envs.multiturn import as_multi_turn
from slipstream.utils.images import message_image_bytes

logger = logging.getLogger(__name__)

MISSING_REWARD = "missing_reward"
"""`RolloutError.stage` of a rollout whose environment gave no usable reward (None, NaN, not a number)."""


@dataclass
class ModelTurn:
    """One model reply, with the exact tokens inference used (token-in/token-out); token fields are None for
    policies without tokens (scripted tests)."""

    message: Message
    """The assistant message as the server parsed it (`content`, and `tool_calls` in OpenAI format)."""
    prompt_token_ids: list[int] | None = None
    """Token ids of the whole prompt of this turn, as returned by the server (`prompt_token_ids`)."""
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    """Inference log-prob of each completion token, at the sampling temperature."""
    completion_versions: list[int] | None = None
    """Policy version that produced each completion token."""
    finish_reason: str | None = None


ModelFn = Callable[[list[Message], list[ToolSchema]], Awaitable[ModelTurn]]
"""`await model(messages, tools)`: one model reply to the conversation (`tools` is [] when none are offered)."""


class StopRollout(Exception):  # noqa: N818 - a signal, not an error
    """Raised by a model function to end a rollout normally before the turn limit (e.g. the context window is
    full); the rollout is scored as it stands and its `stop_reason` is `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class RolloutResult:
    """A finished rollout: transcript, model turns (with tokens), reward."""

    task: Task
    messages: list[Message]
    """Whole conversation: the task prompt, model replies and environment messages."""
    turns: list[ModelTurn]
    reward: RewardResult
    stop_reason: str
    """"env_done", "max_turns", or the reason of a `StopRollout`."""
    duration_s: float


@dataclass
class RolloutError:
    """A rollout that failed inside its environment or ran out of time: excluded from training, counted."""

    task_id: str
    stage: str
    """"setup_state", "env_response", "reward", "missing_reward" (the reward was None or not finite), "cleanup" or
    "timeout"."""
    error: str
    """Exception type and message."""
    num_turns: int
    duration_s: float
    traceback: str = field(default="", repr=False)

    def __str__(self) -> str:
        return f"rollout of task {self.task_id} failed in {self.stage} after {self.num_turns} turns: {self.error}"


class _EnvFailure(Exception):
    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(stage)
        self.stage = stage
        self.cause = cause


async def _env_call(stage: str, awaitable: Awaitable):
    """Await an environment method, tagging any exception with the stage (cancellation passes through)."""
    try:
        return await awaitable
    except Exception as e:
        raise _EnvFailure(stage, e) from e


def _check_reply(reply: object) -> tuple[list[Message], bool]:
    if not (isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[0], list) and isinstance(reply[1], bool)):
        raise TypeError(f"env_response must return (list of messages, done: bool), got {reply!r:.200}")
    if message_image_bytes(reply[0]):
        raise ValueError(
            "env_response returned a message with an image: images are supported in the task's prompt only (every "
            "training sample of a multi-turn rollout holds the prompt's images; the environment's would not be "
            "matched to their tokens)"
        )
    return reply


@dataclass
class _Progress:
    messages: list[Message]
    turns: list[ModelTurn] = field(default_factory=list)
    state: State | None = None
    stop_reason: str = "max_turns"


async def _play(env, task: Task, model: ModelFn, progress: _Progress) -> RewardResult:
    progress.state = await _env_call("setup_state", env.setup_state(task))
    for _ in range(env.max_turns):
        try:
            turn = await model(list(progress.messages), list(env.tools))
        except StopRollout as stop:
            progress.stop_reason = stop.reason
            break
        progress.turns.append(turn)
        progress.messages.append(turn.message)
        reply = await _env_call("env_response", env.env_response(list(progress.messages), progress.state))
        try:
            new_messages, done = _check_reply(reply)
        except (TypeError, ValueError) as e:  # a malformed reply fails the rollout at that stage, like a raise
            raise _EnvFailure("env_response", e) from e
        progress.messages.extend(new_messages)
        if done:
            progress.stop_reason = "env_done"
            break
    reward = await _env_call("reward", env.reward(task, progress.state))
    if not isinstance(reward, RewardResult):
        raise _EnvFailure("reward", TypeError(f"reward must return a RewardResult, got {reward!r:.200}"))
    try:
        checked_reward(reward.value, env.name, task.id)
    except MissingReward as e:
        # A missing (None) or non-finite reward is a failed rollout, never a silent 0.0 that trains.
        raise _EnvFailure(MISSING_REWARD, e) from None
    return reward


async def run_rollout(
    env: AnyEnvironment, task: Task, model: ModelFn, timeout_s: float | None = None
) -> RolloutResult | RolloutError:
    """Play `task` on `env` (either protocol) with `model`; `timeout_s` overrides the environment's budget.

    Exceptions of the model function (other than `StopRollout`) and cancellation propagate: they are the
    caller's, not the environment's.
    """
    env = as_multi_turn(env)
    budget = env.rollout_timeout_s if timeout_s is None else timeout_s
    start = time.perf_counter()
    progress = _Progress(messages=list(task.prompt))
    outcome: RolloutResult | RolloutError
    cleanup_error: Exception | None = None
    try:
        async with asyncio.timeout(budget) as deadline:
            reward = await _play(env, task, model, progress)
        outcome = RolloutResult(
            task, progress.messages, progress.turns, reward, progress.stop_reason, time.perf_counter() - start
        )
    except _EnvFailure as failure:
        stage = MISSING_REWARD if isinstance(failure.cause, MissingReward) else failure.stage
        outcome = _error(task, stage, failure.cause, progress, start)
    except TimeoutError as e:
        if not deadline.expired():
            raise
        message = TimeoutError(f"rollout exceeded its {budget:g} s budget")
        outcome = _error(task, "timeout", message, progress, start, e)
    finally:
        if progress.state is not None:
            cleanup_error = await _cleanup(env, progress.state)
    if cleanup_error is not None and isinstance(outcome, RolloutResult):
        outcome = _error(task, "cleanup", cleanup_error, progress, start)
    return outcome


async def _cleanup(env, state: State) -> Exception | None:
    try:
        await env.cleanup(state)
    except Exception as e:
        logger.warning("environment %s: cleanup of a rollout failed: %s: %s", env.name, type(e).__name__, e)
        return e
    return None


def _error(
    task: Task,
    stage: str,
    cause: BaseException,
    progress: _Progress,
    start: float,
    traced: BaseException | None = None,
) -> RolloutError:
    tb = "".join(traceback.format_exception(traced or cause))
    return RolloutError(
        task_id=task.id,
        stage=stage,
        error=f"{type(cause).__name__}: {cause}",
        num_turns=len(progress.turns),
        duration_s=time.perf_counter() - start,
        traceback=tb,
    )
