"""Orchestrator main loop: per step, refresh weights if needed, generate and score rollouts, write batches.

With max_async_level >= 1 batch n+1 is generated while the trainer trains step n: the loop only waits for
weights when the served policy would be too stale for the next batch.
"""

import asyncio

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.registry import build_env
from slipstream.orchestrator.advantages import compute_advantages, count_zero_advantage_groups
from slipstream.orchestrator.batching import build_training_batches, write_training_batches
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.metrics import progress_line, rollout_metrics
from slipstream.orchestrator.rollouts import Rollout, WeightedSemaphore, generate_batch
from slipstream.orchestrator.sampler import TaskSampler
from slipstream.orchestrator.weights import WeightRelay


def run_orchestrator(config: OrchestratorConfig) -> None:
    """Run the orchestrator for `config.max_steps` steps (blocking; drives asyncio internally)."""
    asyncio.run(orchestrate(config))


async def orchestrate(config: OrchestratorConfig) -> None:
    async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
        await client.wait_healthy(config.health_timeout_s)
        env = build_env(config.env.name, **config.env.args)
        sampler = TaskSampler(env.tasks("train"), config.batch_size // config.group_size, config.seed)
        relay = WeightRelay(client, config)
        limiter = WeightedSemaphore(config.max_concurrent_requests)
        for step in range(1, config.max_steps + 1):
            metrics = await relay.maybe_update_weights(step)
            rollouts, metrics["timing/generate_s"] = await generate_batch(
                client,
                env,
                sampler.tasks_for_step(step),
                config.group_size,
                config.sampling,
                relay.served_version,
                limiter,
            )
            metrics.update(assign_advantages(step, rollouts, config))
            write_step(step, rollouts, config, metrics)
            print(progress_line(step, config.max_steps, metrics), flush=True)
        await relay.load_final(config.max_steps)


def assign_advantages(step: int, rollouts: list[Rollout], config: OrchestratorConfig) -> dict[str, float]:
    """Set each rollout's GRPO advantage; return the step's rollout metrics."""
    advantages = compute_advantages([r.reward for r in rollouts], config.group_size, config.advantage.std_normalize)
    for rollout, advantage in zip(rollouts, advantages, strict=True):
        rollout.advantage = advantage
    return rollout_metrics(step, rollouts, count_zero_advantage_groups(advantages, config.group_size))


def write_step(step: int, rollouts: list[Rollout], config: OrchestratorConfig, metrics: dict[str, float]) -> None:
    """Pack the step's rollouts and write one batch file per trainer rank."""
    batches = build_training_batches(
        step,
        rollouts,
        config.sampling.temperature,
        config.micro_batch_tokens,
        config.num_trainer_ranks,
        metrics,
    )
    write_training_batches(config.output_dir, batches)
