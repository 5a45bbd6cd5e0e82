"""Orchestrator main loop: take each batch from the continuous rollout pipeline, score advantages, write it.

Rollouts run continuously and weights are loaded mid-rollout (pipeline.py, weights.py); this loop only waits when
the next batch is not ready: too few finished groups, or the served policy too old for it (max_async_level).
At checkpoint steps it saves its state before writing the batch (state.py); a resumed run restores it first.
"""

import asyncio
import logging
from itertools import groupby

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.config.vlm import placeholder_token_ids
from slipstream.envs.hosting import open_environment
from slipstream.monitor.logs import setup_logging
from slipstream.monitor.sinks import Monitors
from slipstream.orchestrator.advantages import group_advantages
from slipstream.orchestrator.batching import build_training_batches, write_training_batches
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.metrics import progress_line, rollout_metrics
from slipstream.orchestrator.pipeline import RolloutPipeline
from slipstream.orchestrator.sampler import TaskSampler
from slipstream.orchestrator.state import load_state, save_state
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.record import Rollout
from slipstream.rundir import RunDir, step_dirs
from slipstream.transport.checkpoints import is_checkpoint_step, resolve_run_step
from slipstream.utils.loop_lag import LoopLag
from slipstream.weights.wire.published import is_ready

log = logging.getLogger(__name__)


def run_orchestrator(config: OrchestratorConfig) -> None:
    """Run the orchestrator for `config.max_steps` steps (blocking; drives asyncio internally)."""
    setup_logging("orchestrator")
    asyncio.run(orchestrate(config))


async def orchestrate(config: OrchestratorConfig) -> dict[str, float]:
    """The orchestrator's run; returns the final pipeline counters."""
    async with (
        InferenceClient(
            config.inference_url, config.model.name, config.request_timeout_s, config.inference_engine_urls
        ) as client,
        open_environment(config.env, config.output_dir) as env,
    ):
        await client.wait_healthy(config.health_timeout_s)
        train_tasks = env.tasks("train")
        log.info(f"environment {env.name!r} ({config.env.name}): {len(train_tasks)} train tasks")
        sampler = TaskSampler(train_tasks, config.batch_size // config.group_size, config.seed)
        relay = WeightRelay(client, config)
        pipeline = RolloutPipeline(client, env, sampler, relay, config)
        await relay.serve_initial()  # a server another run loaded weights into serves this run's initial ones again
        start_step = await maybe_resume(pipeline, relay, config)
        monitors = Monitors(config, "orchestrator")
        lag = LoopLag()
        sampling = asyncio.ensure_future(lag.run())
        try:
            async with pipeline.running():
                for step in range(start_step + 1, config.max_steps + 1):
                    rollouts, metrics = await pipeline.next_batch(step)
                    metrics.update(assign_advantages(step, rollouts, config))
                    metrics.update(lag.take_metrics("orchestrator"))
                    metrics.update(await pipeline.hand_to_trainer(step))  # colocated: vLLM sleeps before the write
                    maybe_checkpoint(step, pipeline, config)
                    # packing and the fsynced writes off the event loop, where they held up streamed tokens and
                    # the admin calls of weight updates (utils/loop_lag.py measures it)
                    await asyncio.to_thread(write_step, step, rollouts, config, metrics)
                    log.info(progress_line(step, config.max_steps, metrics))
                    monitors.log(step, {**metrics, **pipeline.counters()})
        finally:
            sampling.cancel()
            monitors.close()
        summary = {**pipeline.counters(), "pipeline/abandoned_groups": float(pipeline.ledger.num_abandoned)}
        log.info(
            f"done: {summary['pipeline/dispatched_groups']:.0f} groups started, "
            f"{summary['pipeline/cancelled_groups']:.0f} cancelled and {summary['pipeline/dropped_groups']:.0f} "
            f"dropped as too old, {summary['pipeline/failed_groups']:.0f} dropped for failed rollouts "
            f"({summary['pipeline/failed_rollouts']:.0f} rollouts failed in their environment), "
            f"{summary['pipeline/abandoned_groups']:.0f} left over at the end"
        )
        await relay.load_final(config.max_steps)
        if pipeline.evaluator is not None:
            await pipeline.evaluator.final(config.max_steps)
        return summary


async def maybe_resume(pipeline: RolloutPipeline, relay: WeightRelay, config: OrchestratorConfig) -> int:
    """Restore the state of the checkpoint `config.resume_step` selects and serve that step's weights before any
    rollout starts (a fresh inference server serves the initial ones); return the last step already trained."""
    run = RunDir(config.output_dir)
    step = resolve_run_step(config.output_dir, config.resume_step, "orchestrator.resume_step")
    if step is None:
        if config.resume_step is not None:
            log.info(f"no committed checkpoint in {run.checkpoints_root}; starting at step 0")
        return 0
    later = [s for s in step_dirs(run.rollouts_root) if s > step]
    if later:
        raise RuntimeError(
            f"{run.rollouts_root} holds batches of steps {later}, after the step resumed from ({step}); the "
            "trainer could train them instead of the regenerated ones. Resume with `slipstream rl --resume`, which "
            "removes them first"
        )
    if not is_ready(config.output_dir, step):
        raise FileNotFoundError(
            f"{run.weights_dir(step)} (with its READY marker) is missing, so inference cannot serve the "
            f"policy of step {step}; resume from another committed step"
        )
    state = load_state(config.output_dir, step, config.seed, config.env.name, pipeline.sampler.tasks_per_step)
    pipeline.restore(state)
    await relay.update(step)
    log.info(
        f"resumed after step {step}: serving its weights, next task position {state.next_task_index}, "
        f"{len(state.requeued_task_indices)} unfinished group(s) to generate again"
    )
    return step


def maybe_checkpoint(step: int, pipeline: RolloutPipeline, config: OrchestratorConfig) -> None:
    """At checkpoint steps, commit the orchestrator's part of the checkpoint; before the step's batch is written, so
    the part exists whenever the trainer commits the step."""
    if is_checkpoint_step(step, config.checkpoint.interval, config.max_steps):
        save_state(config.output_dir, pipeline.checkpoint_state(step))


def assign_advantages(step: int, rollouts: list[Rollout], config: OrchestratorConfig) -> dict[str, float]:
    """Set each rollout's GRPO advantage within its group (consecutive rollouts of one `group_index`; a multi-turn
    group may have lost failed rollouts); return the step's rollout metrics."""
    num_zero_adv_groups = 0
    for _, members in groupby(rollouts, key=lambda r: r.group_index):
        group = list(members)
        advantages = group_advantages([r.reward for r in group], config.advantage.std_normalize)
        for rollout, advantage in zip(group, advantages, strict=True):
            rollout.advantage = advantage
        num_zero_adv_groups += all(a == 0.0 for a in advantages)
    return rollout_metrics(step, rollouts, num_zero_adv_groups)


def vlm_placeholder_ids(config: OrchestratorConfig) -> frozenset[int]:
    """[model.vlm]: the model's image and video placeholder tokens (samples that sampled one are not trained)."""
    if config.model.vlm is None:
        return frozenset()
    if config.model.path is None:
        raise ValueError("[model.vlm] needs model.path (set by `slipstream rl`) to read the model's placeholder tokens")
    return placeholder_token_ids(config.model.path)


def write_step(step: int, rollouts: list[Rollout], config: OrchestratorConfig, metrics: dict[str, float]) -> None:
    """Pack the step's rollouts and write one batch file per trainer rank."""
    batches = build_training_batches(
        step,
        rollouts,
        config.sampling.temperature,
        config.micro_batch_tokens,
        config.num_trainer_ranks,
        metrics,
        shared_prefix=config.shared_prefix,
        shared_prefix_min_tokens=config.shared_prefix_min_tokens,
        placeholder_ids=vlm_placeholder_ids(config),
    )
    write_training_batches(config.output_dir, batches)
