"""Sampling and scoring one task for evaluation through the rollout package's model-turn path (slipstream.rollout):
single-turn environments in one request of `num_samples` completions, multi-turn (tool-using) environments as
`num_samples` rollouts through `run_rollout`, every request streamed like the orchestrator's.

Seeds: a task's base seed comes from the evaluation seed and the task id; sample i, turn t is drawn with
`base + i + t * num_samples` (single-turn: turn 0, which is vLLM's own rule for the n > 1 children of a request).
A single-turn prompt that does not fit the context window fails its samples (reported, scored 0); a multi-turn
rollout whose next turn does not fit ends there (stop reason `context_length`) and is scored as it stands.
"""

import asyncio
import hashlib

from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import AnyEnvironment, Environment, Task, score
from slipstream.envs.rollout import ModelFn, RolloutError, run_rollout
from slipstream.eval.results import TaskResult
from slipstream.rollout.client import ContextLengthError, GenerationClient
from slipstream.rollout.limiter import CompletionLimiter
from slipstream.rollout.record import sampling_params
from slipstream.rollout.streaming import StreamedChat
from slipstream.rollout.turns import CONTEXT_LENGTH, TurnRequester, sample_completions


def request_seed(seed: int, task_id: str) -> int:
    """Base seed of a task from the evaluation seed and the task id (independent of task order and batching)."""
    digest = hashlib.blake2b(f"{seed}:{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << 31)  # leaves room for the per-sample and per-turn offsets


async def evaluate_single_turn_task(
    client: GenerationClient,
    env: Environment,
    task: Task,
    num_samples: int,
    sampling: SamplingConfig,
    seed: int | None,
    limiter: CompletionLimiter,
    policy_version: int = 0,
) -> TaskResult:
    """One request (seeded unless `seed` is None) for `num_samples` completions of `task`, each scored by the env."""
    task_seed = None if seed is None else request_seed(seed, task.id)
    params = sampling_params(sampling) | ({} if task_seed is None else {"seed": task_seed})
    where = f"{client.base_url}/v1/chat/completions (stream, eval task {task.id})"
    chat = StreamedChat(num_samples, lambda: policy_version, where)
    units = await limiter.acquire(num_samples)
    try:
        rollouts = await sample_completions(client, task, params, num_samples, policy_version, chat)
    except ContextLengthError as e:
        return _prompt_too_long(task, task_seed, num_samples, e)
    finally:
        await limiter.release(units)
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


def _prompt_too_long(task: Task, task_seed: int | None, num_samples: int, error: ContextLengthError) -> TaskResult:
    """The result of a task whose prompt leaves no room in the context window: every sample failed, scored 0."""
    return TaskResult(
        task_id=task.id,
        request_seed=task_seed,
        rewards=[0.0] * num_samples,
        completions=[""] * num_samples,
        num_completion_tokens=[0] * num_samples,
        finish_reasons=[f"error:{CONTEXT_LENGTH}"] * num_samples,
        errors=[f"{CONTEXT_LENGTH}: {error}"] * num_samples,
        reward_metrics=[{} for _ in range(num_samples)],
    )


async def evaluate_multi_turn_task(
    client: GenerationClient,
    env: AnyEnvironment,
    task: Task,
    num_samples: int,
    sampling: SamplingConfig,
    seed: int | None,
    limiter: CompletionLimiter,
    policy_version: int = 0,
) -> TaskResult:
    """`num_samples` rollouts of `task`; a rollout that fails inside the environment scores 0.0 and is reported."""
    task_seed = None if seed is None else request_seed(seed, task.id)
    turns = fixed_policy_turns(client, sampling, limiter, policy_version)

    def model_for(sample: int) -> ModelFn:
        if task_seed is None:
            return turns.model_fn(task)
        return turns.model_fn(task, turn_seed=lambda t: task_seed + sample + t * num_samples)

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


def fixed_policy_turns(
    client: GenerationClient, sampling: SamplingConfig, limiter: CompletionLimiter, policy_version: int
) -> TurnRequester:
    """Model turns of an evaluation: the served policy is held at `policy_version` (its tokens and cache salt),
    each turn within `limiter` and the client's request timeout."""

    async def ready() -> int:
        return policy_version

    return TurnRequester(
        client, sampling_params(sampling), client.request_timeout_s, ready, lambda: policy_version, limiter
    )
