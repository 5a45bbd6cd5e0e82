"""Multi-turn (and tool-using) rollouts in the pipeline: the model function `run_rollout` calls (one chat request per
turn, n=1, each token stamped with its policy version), the group's token progress for staleness, the group's
`group_size` concurrent rollouts, and their results as training rollouts (failed ones counted and logged).
"""

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.envs.base import AnyEnvironment, Message, MissingReward, Task, ToolSchema, score
from slipstream.envs.multiturn import last_assistant_text
from slipstream.envs.rollout import (
    MISSING_REWARD,
    ModelFn,
    ModelTurn,
    RolloutError,
    RolloutResult,
    StopRollout,
    run_rollout,
)
from slipstream.envs.tokens import build_samples
from slipstream.orchestrator.client import ContextLengthError, InferenceClient, InferenceError
from slipstream.orchestrator.rollouts import Rollout, cache_salt, parse_chat_response
from slipstream.orchestrator.streaming import StreamedChat

CONTEXT_LENGTH = "context_length"
"""Stop reason of a rollout whose next turn no longer fits the model's context window."""


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
    """Sends the model turns of multi-turn rollouts to inference.

    `ready()` waits until no weight update is in progress and returns the served version: a turn's request is
    sent with that version's cache salt, like a new group. `version_now()` stamps streamed tokens.
    """

    client: InferenceClient
    sampling: Mapping[str, Any]
    request_timeout_s: float
    stream: bool
    """Stream each turn (version stamps per token); False: whole replies carrying `token_versions` (simulator)."""
    ready: Callable[[], Awaitable[int]]
    version_now: Callable[[], int]

    def model_fn(self, task: Task, progress: TurnProgress, turn_seed: Callable[[int], int] | None = None) -> ModelFn:
        """The model function of one rollout of `task`; its turns report to the group's `progress`. Turn t (from 0)
        is seeded with `turn_seed(t)` (None: unseeded)."""
        num_turns = 0
        session = uuid.uuid4().hex  # every turn of this rollout reaches the same engine behind a router

        async def model(messages: list[Message], tools: list[ToolSchema]) -> ModelTurn:
            nonlocal num_turns
            version = await self.ready()
            params = dict(self.sampling)
            if turn_seed is not None:
                params["seed"] = turn_seed(num_turns)
            num_turns += 1
            if tools:
                params |= {"tools": tools, "tool_choice": "auto"}
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    send = self._streamed if self.stream else self._whole
                    turn = await send(task, messages, params, version, progress, session)
            except ContextLengthError:
                raise StopRollout(CONTEXT_LENGTH) from None
            except TimeoutError:
                raise InferenceError(
                    f"task {task.id}: no complete reply to a model turn within request_timeout_s = "
                    f"{self.request_timeout_s}s"
                ) from None
            if turn.finish_reason == "abort":
                raise InferenceError(
                    f"task {task.id}: the server aborted a model turn (finish_reason 'abort') though the orchestrator "
                    "did not cancel it; was inference paused with mode=abort, or shut down?"
                )
            return turn

        return model

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

    async def _whole(
        self, task: Task, messages: list[Message], params: dict, version: int, progress: TurnProgress, session: str
    ) -> ModelTurn:
        key = object()
        progress.open(id(key), lambda: version)  # the reply's tokens come from `version` or later
        versions: list[int] = []
        try:
            reply = await self.client.chat(messages, params, 1, cache_salt(version), session)
            (completion,) = parse_chat_response(reply, task, 1, version, require_token_versions=True)
            versions = completion.token_versions
        finally:
            progress.close(id(key), versions)
        server_message = reply["choices"][0].get("message") or {}
        message: Message = {"role": "assistant", "content": server_message.get("content") or ""}
        if server_message.get("tool_calls"):
            message["tool_calls"] = server_message["tool_calls"]
        reasoning = server_message.get("reasoning") or server_message.get("reasoning_content")
        if reasoning:
            message["reasoning_content"] = reasoning
        return ModelTurn(
            message=message,
            prompt_token_ids=completion.prompt_token_ids,
            completion_token_ids=completion.completion_token_ids,
            completion_logprobs=completion.completion_logprobs,
            completion_versions=completion.token_versions,
            finish_reason=completion.finish_reason,
        )


async def play_group(
    env: AnyEnvironment, task: Task, group_size: int, model_fn: Callable[[], ModelFn], timeout_s: float | None
) -> list[RolloutResult | RolloutError]:
    """`group_size` concurrent rollouts of `task`. Environment failures come back as RolloutErrors; an error of
    the model function (inference) cancels the other rollouts and is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            rollouts = [group.create_task(run_rollout(env, task, model_fn(), timeout_s)) for _ in range(group_size)]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None
    return [r.result() for r in rollouts]


def rollout_from_result(result: RolloutResult, group_index: int, request_version: int) -> Rollout:
    """A finished multi-turn rollout as a training rollout: its token-exact samples and its reward."""
    turns = result.turns
    build = build_samples(turns)
    return Rollout(
        task=result.task,
        prompt_token_ids=list(turns[0].prompt_token_ids or []) if turns else [],
        completion_token_ids=[t for turn in turns for t in turn.completion_token_ids or []],
        completion_logprobs=[lp for turn in turns for lp in turn.completion_logprobs or []],
        completion_text=last_assistant_text(result.messages),
        token_versions=[v for turn in turns for v in turn.completion_versions or []],
        request_version=request_version,
        finish_reason=turns[-1].finish_reason if turns else None,
        reward=result.reward.value,
        group_index=group_index,
        samples=build.samples,
        num_turns=len(turns),
        num_prefix_breaks=build.num_prefix_breaks,
        stop_reason=result.stop_reason,
        reward_metrics=dict(result.reward.metrics),
    )


async def reward_or_missing(env: AnyEnvironment, task: Task, completion_text: str) -> float | MissingReward:
    """A single-turn reward, or the MissingReward the environment's None or NaN turned into (any other error of the
    environment propagates)."""
    try:
        return await score(env, task, completion_text)
    except MissingReward as e:
        return e


MAX_GROUPS_WITHOUT_SURVIVORS = 16
"""A run stops once this many groups in a row lost every rollout in their environment: it is broken, not flaky."""


class EnvironmentBroken(RuntimeError):
    """Every rollout of many groups in a row failed inside the environment: stop instead of waiting forever."""


class RewardsMissing(EnvironmentBroken):
    """The environment gave no reward to any rollout of a batch's worth of groups in a row: stop, never train on
    rewards that were never computed."""


class RolloutFailures:
    """Counts rollouts that failed inside their environment, by stage, and logs each failure (the first of each
    stage with its traceback). A group needs two surviving rollouts to compare rewards (one if group_size is 1).
    After MAX_GROUPS_WITHOUT_SURVIVORS groups in a row without a surviving rollout the run stops (EnvironmentBroken):
    no batch would ever fill, and nothing is trained on rewards that were never computed."""

    def __init__(self, group_size: int, groups_per_batch: int = MAX_GROUPS_WITHOUT_SURVIVORS) -> None:
        self.min_survivors = min(2, group_size)
        self.groups_per_batch = groups_per_batch
        self.by_stage: dict[str, int] = {}
        self.groups_without_survivors = 0
        self.groups_without_rewards = 0
        """Groups in a row in which no rollout got a reward and some got a missing one (None, NaN)."""
        self.last_error: RolloutError | None = None

    def survivors(
        self, task: Task, outcomes: list[RolloutResult | RolloutError], group_index: int, request_version: int
    ) -> list[Rollout] | None:
        """The group's training rollouts, or None when too few survived (the caller drops the group)."""
        rollouts = []
        for outcome in outcomes:
            if isinstance(outcome, RolloutError):
                self._record(outcome)
            else:
                rollouts.append(rollout_from_result(outcome, group_index, request_version))
        missing = sum(isinstance(o, RolloutError) and o.stage == MISSING_REWARD for o in outcomes)
        return self._tally(task, rollouts, len(outcomes), missing)

    def scored(self, task: Task, rollouts: list[Rollout], rewards: list[float | MissingReward]) -> list[Rollout] | None:
        """Single-turn: set each rollout's reward; those without one are failed rollouts (stage missing_reward).
        The group's rewarded rollouts, or None when too few have a reward (the caller drops the group)."""
        kept = []
        for rollout, reward in zip(rollouts, rewards, strict=True):
            if isinstance(reward, MissingReward):
                self._record(RolloutError(task.id, MISSING_REWARD, f"{type(reward).__name__}: {reward}", 1, 0.0))
            else:
                rollout.reward = reward
                kept.append(rollout)
        return self._tally(task, kept, len(rollouts), len(rollouts) - len(kept))

    def _tally(self, task: Task, rollouts: list[Rollout], num_outcomes: int, num_missing: int) -> list[Rollout] | None:
        self.groups_without_rewards = 0 if rollouts or not num_missing else self.groups_without_rewards + 1
        if self.groups_without_rewards >= self.groups_per_batch:
            raise RewardsMissing(
                f"the environment gave no reward (None or not a finite number) to any rollout of the last "
                f"{self.groups_without_rewards} groups, a batch's worth (last: {self.last_error}); stopping instead "
                "of training on rewards that were never computed. Does the environment score elsewhere (e.g. in a "
                "run loop of its own that Slipstream does not run)? Its reward must return a finite number"
            )
        self.groups_without_survivors = 0 if rollouts else self.groups_without_survivors + 1
        if self.groups_without_survivors >= MAX_GROUPS_WITHOUT_SURVIVORS:
            raise EnvironmentBroken(
                f"the environment failed every rollout of the last {self.groups_without_survivors} groups (last: "
                f"{self.last_error}); failed rollouts by stage: {self.by_stage}. Fix the environment (its first "
                "failure of each stage is logged above with its traceback) and resume the run"
            )
        if len(rollouts) < self.min_survivors:
            print(
                f"[orchestrator] group of task {task.id} dropped: {len(rollouts)} of {num_outcomes} rollouts "
                f"survived (at least {self.min_survivors} needed)",
                flush=True,
            )
            return None
        return rollouts

    def _record(self, error: RolloutError) -> None:
        self.last_error = error
        first = error.stage not in self.by_stage
        self.by_stage[error.stage] = self.by_stage.get(error.stage, 0) + 1
        print(f"[orchestrator] {error} (excluded from training)", flush=True)
        if first and error.traceback:
            print(f"[orchestrator] first {error.stage} failure, traceback:\n{error.traceback.rstrip()}", flush=True)

    def counters(self) -> dict[str, float]:
        """Cumulative counts of failed rollouts, in total and per stage."""
        counters = {"pipeline/failed_rollouts": float(sum(self.by_stage.values()))}
        counters |= {f"pipeline/failed_rollouts/{stage}": float(n) for stage, n in sorted(self.by_stage.items())}
        return counters
