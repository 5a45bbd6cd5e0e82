"""Orchestrator main loop: take each batch from the continuous rollout pipeline, score advantages, write it.

Rollouts run continuously and weights are loaded mid-rollout (pipeline.py, weights.py); this loop only waits when
the next batch is not ready: too few finished groups, or the served policy too old for it (max_async_level).
"""

import asyncio

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.registry import build_env
from slipstream.orchestrator.advantages import compute_advantages, count_zero_advantage_groups
from slipstream.orchestrator.batching import build_training_batches, write_training_batches
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.metrics import progress_line, rollout_metrics
from slipstream.orchestrator.pipeline import RolloutPipeline
from slipstream.orchestrator.rollouts import Rollout
from slipstream.orchestrator.sampler import TaskSampler
from slipstream.orchestrator.weights import WeightRelay


def run_orchestrator(config: OrchestratorConfig) -> None:
    """Run the orchestrator for `config.max_steps` steps (blocking; drives asyncio internally)."""
    asyncio.run(orchestrate(config))


async def orchestrate(config: OrchestratorConfig) -> dict[str, float]:
    """The orchestrator's run; returns the final pipeline counters."""
    async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
        await client.wait_healthy(config.health_timeout_s)
        env = build_env(config.env.name, **config.env.args)
        sampler = TaskSampler(env.tasks("train"), config.batch_size // config.group_size, config.seed)
        relay = WeightRelay(client, config)
        pipeline = RolloutPipeline(client, env, sampler, relay, config)
        async with pipeline.running():
            for step in range(1, config.max_steps + 1):
                rollouts, metrics = await pipeline.next_batch(step)
                metrics.update(assign_advantages(step, rollouts, config))
                write_step(step, rollouts, config, metrics)
                print(progress_line(step, config.max_steps, metrics), flush=True)
        summary = {**pipeline.counters(), "pipeline/abandoned_groups": float(pipeline.ledger.num_abandoned)}
        print(
            f"[orchestrator] done: {summary['pipeline/dispatched_groups']:.0f} groups started, "
            f"{summary['pipeline/cancelled_groups']:.0f} cancelled and {summary['pipeline/dropped_groups']:.0f} "
            f"dropped as too old, {summary['pipeline/abandoned_groups']:.0f} left over at the end",
            flush=True,
        )
        await relay.load_final(config.max_steps)
        return summary


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
