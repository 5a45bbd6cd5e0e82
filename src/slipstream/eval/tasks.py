"""Sampling and scoring one task for evaluation, with seeded requests: single-turn environments in one request of
`num_samples` completions, multi-turn (tool-using) environments as `num_samples` rollouts through `run_rollout`.

Seeds: a task's base seed comes from the evaluation seed and the task id; sample i, turn t is drawn with
`base + i + t * num_samples` (single-turn: turn 0, which is vLLM's own rule for the n > 1 children of a request).
"""

import asyncio
import hashlib
from collections.abc import Callable

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import AnyEnvironment, Environment, Message, Task, ToolSchema, score
from slipstream.envs.rollout import ModelFn, ModelTurn, RolloutError, run_rollout
from slipstream.eval.results import TaskResult
from slipstream.orchestrator.client import InferenceClient, InferenceError
from slipstream.orchestrator.rollouts import WeightedSemaphore, cache_salt, parse_chat_response, sampling_params


def request_seed(seed: int, task_id: str) -> int:
    """Base seed of a task from the evaluation seed and the task id (independent of task order and batching)."""
    digest = hashlib.blake2b(f"{seed}:{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)  # leaves room for the per-sample and per-turn offsets


async def evaluate_single_turn_task(
    client: InferenceClient,
    env: Environment,
    task: Task,
    num_samples: int,
    sampling: SamplingConfig,
    seed: int | None,
    limiter: WeightedSemaphore,
    policy_version: int = 0,
) -> TaskResult:
    """One request (seeded unless `seed` is None) for `num_samples` completions of `task`, each scored by the env."""
    task_seed = None if seed is None else request_seed(seed, task.id)
    params = sampling_params(sampling) | ({} if task_seed is None else {"seed": task_seed})
    units = await limiter.acquire(num_samples)
    try:
        reply = await client.chat(task.prompt, params, num_samples, cache_salt(policy_version))
    finally:
        await limiter.release(units)
    rollouts = parse_chat_response(reply, task, num_samples, policy_version)
    rewards = await asyncio.gather(*(score(env, task, r.completion_text) for r in rollouts))
    return TaskResult(
        task_id=task.id,
        request_seed=task_seed,
        rewards=list(rewards),
        completions=[r.completion_text for r in rollouts],
        num_completion_tokens=[len(r.completion_token_ids) for r in rollouts],
        finish_reasons=[r.finish_reason for r in rollouts],
        errors=[None] * num_samples,
        reward_metrics=[{} for _ in rollouts],
    )


async def evaluate_multi_turn_task(
    client: InferenceClient,
    env: AnyEnvironment,
    task: Task,
    num_samples: int,
    sampling: SamplingConfig,
    seed: int | None,
    limiter: WeightedSemaphore,
    policy_version: int = 0,
) -> TaskResult:
    """`num_samples` rollouts of `task`; a rollout that fails inside the environment scores 0.0 and is reported."""
    task_seed = None if seed is None else request_seed(seed, task.id)

    def model_for(sample: int) -> ModelFn:
        if task_seed is None:
            return chat_model_fn(client, sampling, limiter, policy_version)
        return chat_model_fn(client, sampling, limiter, policy_version, lambda t: task_seed + sample + t * num_samples)

    outcomes = await asyncio.gather(*(run_rollout(env, task, model_for(i)) for i in range(num_samples)))
    result = TaskResult(task.id, task_seed, [], [], [], [], [], [])
    for outcome in outcomes:
        failed = isinstance(outcome, RolloutError)
        result.rewards.append(0.0 if failed else outcome.reward.value)
        result.completions.append([] if failed else outcome.messages[len(task.prompt) :])
        tokens = 0 if failed else sum(len(turn.completion_token_ids or []) for turn in outcome.turns)
        result.num_completion_tokens.append(tokens)
        result.finish_reasons.append(f"error:{outcome.stage}" if failed else outcome.stop_reason)
        result.errors.append(str(outcome) if failed else None)
        result.reward_metrics.append({} if failed else dict(outcome.reward.metrics))
    return result


def chat_model_fn(
    client: InferenceClient,
    sampling: SamplingConfig,
    limiter: WeightedSemaphore,
    policy_version: int = 0,
    turn_seed: Callable[[int], int] | None = None,
) -> ModelFn:
    """A model function for `run_rollout`: one chat request per turn, turn t (from 0) seeded with `turn_seed(t)`
    (None: unseeded), the environment's tools offered when it has any."""
    num_turns = 0

    async def model(messages: list[Message], tools: list[ToolSchema]) -> ModelTurn:
        nonlocal num_turns
        params = sampling_params(sampling)
        if turn_seed is not None:
            params["seed"] = turn_seed(num_turns)
        num_turns += 1
        if tools:
            params["tools"] = tools
        units = await limiter.acquire(1)
        try:
            reply = await client.chat(messages, params, 1, cache_salt(policy_version))
        finally:
            await limiter.release(units)
        return parse_model_turn(reply)

    return model


def parse_model_turn(reply: dict) -> ModelTurn:
    """The assistant message (content and OpenAI `tool_calls`) and token ids of a one-choice chat reply."""
    choices = reply.get("choices") or []
    if len(choices) != 1:
        raise InferenceError(f"asked for 1 completion, got {len(choices)}: {str(reply)[:300]}")
    choice = choices[0]
    server_message = choice.get("message") or {}
    message: Message = {"role": "assistant", "content": server_message.get("content")}
    if server_message.get("tool_calls"):
        message["tool_calls"] = server_message["tool_calls"]
    return ModelTurn(
        message=message,
        prompt_token_ids=reply.get("prompt_token_ids"),
        completion_token_ids=choice.get("token_ids"),
        finish_reason=choice.get("finish_reason"),
    )
