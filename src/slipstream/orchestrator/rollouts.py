"""Rollout generation: one chat request per task group, token ids and logprobs taken verbatim from vLLM.

Completion text is used only for rewards; training tokens are never re-tokenized.
"""

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import Environment, Task, score
from slipstream.orchestrator.client import InferenceClient, InferenceError

MISSING_LOGPROB = -9999.0
"""vLLM's placeholder when it has no log-prob for a token (and its clamp of -inf)."""


@dataclass
class Rollout:
    """One sampled completion of a task, with what the trainer needs."""

    task: Task
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    completion_logprobs: list[float]
    """Inference log-prob of each completion token, at the sampling temperature."""
    completion_text: str
    policy_version: int
    """Policy version that generated every token of this rollout."""
    finish_reason: str | None = None
    reward: float = 0.0
    advantage: float = 0.0


class WeightedSemaphore:
    """Bounds the number of completions in flight; a request for `n` completions takes `n` units."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = capacity
        self._cond = asyncio.Condition()

    async def acquire(self, units: int) -> int:
        # A group larger than the capacity runs alone instead of waiting forever.
        units = min(units, self.capacity)
        async with self._cond:
            await self._cond.wait_for(lambda: self._free >= units)
            self._free -= units
        return units

    async def release(self, units: int) -> None:
        async with self._cond:
            self._free += units
            self._cond.notify_all()


def sampling_params(sampling: SamplingConfig) -> dict[str, Any]:
    """Chat-completion sampling fields (vLLM prefers `max_completion_tokens` over the deprecated `max_tokens`)."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_completion_tokens": sampling.max_tokens}


def cache_salt(policy_version: int) -> str:
    """Prefix-cache salt of a policy version, so cached KV never crosses versions."""
    return f"policy-{policy_version}"


def parse_chat_response(reply: dict, task: Task, n: int, policy_version: int) -> list[Rollout]:
    """Turn a chat reply (`return_token_ids` + `logprobs`) into `n` rollouts; malformed replies raise InferenceError."""
    prompt_ids = reply.get("prompt_token_ids")
    choices = reply.get("choices") or []
    if not prompt_ids:
        raise InferenceError(
            f"task {task.id}: chat reply lacks prompt_token_ids; the request must set return_token_ids"
        )
    if len(choices) != n:
        raise InferenceError(f"task {task.id}: asked for {n} completions, got {len(choices)}")
    rollouts = []
    for choice in sorted(choices, key=lambda c: c["index"]):
        token_ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content")
        if token_ids is None or content is None:
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} lacks token_ids or logprobs.content "
                "(a reasoning parser with include_reasoning=false hides token ids; keep include_reasoning on)"
            )
        if len(token_ids) != len(content):
            raise InferenceError(
                f"task {task.id}: choice {choice['index']} has {len(token_ids)} token ids but {len(content)} logprobs"
            )
        logprobs = [float(entry["logprob"]) for entry in content]
        if any(lp <= MISSING_LOGPROB for lp in logprobs):
            raise InferenceError(f"task {task.id}: choice {choice['index']} has tokens without a log-prob from vLLM")
        message = choice.get("message") or {}
        rollouts.append(
            Rollout(
                task=task,
                prompt_token_ids=list(prompt_ids),
                completion_token_ids=list(token_ids),
                completion_logprobs=logprobs,
                completion_text=message.get("content") or "",
                policy_version=policy_version,
                finish_reason=choice.get("finish_reason"),
            )
        )
    return rollouts


async def generate_group(
    client: InferenceClient,
    env: Environment,
    task: Task,
    group_size: int,
    sampling: SamplingConfig,
    policy_version: int,
    limiter: WeightedSemaphore,
) -> list[Rollout]:
    """Sample `group_size` completions of `task` in one request and score them."""
    units = await limiter.acquire(group_size)
    try:
        reply = await client.chat(task.prompt, sampling_params(sampling), group_size, cache_salt(policy_version))
    finally:
        await limiter.release(units)
    rollouts = parse_chat_response(reply, task, group_size, policy_version)
    rewards = await asyncio.gather(*(score(env, task, r.completion_text) for r in rollouts))
    for rollout, reward in zip(rollouts, rewards, strict=True):
        rollout.reward = reward
    return rollouts


async def generate_batch(
    client: InferenceClient,
    env: Environment,
    tasks: Sequence[Task],
    group_size: int,
    sampling: SamplingConfig,
    policy_version: int,
    limiter: WeightedSemaphore,
) -> tuple[list[Rollout], float]:
    """All groups of one step, concurrently; rollouts come back group by group in task order, with the seconds taken."""
    start = time.perf_counter()
    groups = await asyncio.gather(
        *(generate_group(client, env, task, group_size, sampling, policy_version, limiter) for task in tasks)
    )
    return [rollout for group in groups for rollout in group], time.perf_counter() - start
