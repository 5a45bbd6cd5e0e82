"""RL trainer loop: wait for this rank's batch of step N, train on it, publish weights of step N, log, checkpoint."""

import logging
import time
from pathlib import Path

from slipstream.config.trainer import TrainerConfig
from slipstream.monitor.logs import setup_logging
from slipstream.monitor.metrics import MetricsWriter, format_progress, merge_metrics
from slipstream.monitor.sinks import Monitors
from slipstream.parallel.dist import barrier
from slipstream.trainer.ckpt import committed_steps, save_checkpoint
from slipstream.trainer.data import validate_batch
from slipstream.trainer.profile import profiled
from slipstream.trainer.schedule import apply_lr
from slipstream.trainer.setup import Trainer, setup_trainer, teardown_trainer
from slipstream.trainer.step import train_step
from slipstream.transport.checkpoints import (
    ORCHESTRATOR_PART,
    commit_step,
    committed_run_steps,
    is_checkpoint_step,
    is_part_committed,
    prune_checkpoints,
)
from slipstream.transport.rollouts import wait_for_batch
from slipstream.weights.send.publish import WeightPublisher

__all__ = ["run_trainer", "setup_trainer"]

log = logging.getLogger(__name__)


def run_trainer(config: TrainerConfig) -> None:
    """Train steps start_step + 1 .. max_steps; step N's weights are published as policy version N (by rank 0)."""
    setup_logging("trainer")
    trainer = setup_trainer(config)
    publisher = WeightPublisher(trainer, config, adapters=True)
    monitors = Monitors(config, "trainer") if trainer.info.is_main else None
    try:
        publisher.note_start_probe()
        writer = MetricsWriter(config.output_dir) if trainer.info.is_main else None
        nonfinite = NonFiniteGuard(config.max_nonfinite_steps)
        for step in range(trainer.start_step + 1, config.max_steps + 1):
            t_start = time.perf_counter()
            batch = wait_for_batch(config.output_dir, step, trainer.data_rank, config.batch_timeout_s)
            validate_batch(batch, step, trainer.data_rank, trainer.num_data_ranks)
            t_batch = time.perf_counter()
            apply_lr(trainer.optimizer, config.optim, step, config.max_steps)  # logged by train_step as `lr`
            with profiled(step, config.profile_steps, config.output_dir, trainer.info.rank, trainer.device):
                metrics = train_step(
                    trainer.policy,
                    trainer.optimizer,
                    batch,
                    config.loss,
                    config.optim.max_grad_norm,
                    trainer.device,
                    trainer.autocast_dtype,
                    trainer.image_inputs,
                )
            t_train = time.perf_counter()
            metrics["nonfinite/total"] = nonfinite.update(step, bool(metrics["nonfinite/skipped"]))
            metrics |= step_memory(trainer, config)  # a sleeping colocated vLLM wakes into it once we publish
            metrics |= publisher.publish(step)
            step_memory(trainer, config)
            t_publish = time.perf_counter()
            if writer is not None:
                metrics |= {
                    "tokens_per_s": metrics["num_tokens"] / max(t_train - t_batch, 1e-9),
                    "model_tokens_per_s": metrics["num_model_tokens"] / max(t_train - t_batch, 1e-9),
                    "timing/wait_batch_s": t_batch - t_start,
                    "timing/train_s": t_train - t_batch,
                    "timing/publish_s": t_publish - t_train,
                    "timing/step_s": t_publish - t_start,
                }
                # Before the checkpoint: a committed step always has its record (resume drops later records).
                record = writer.write(step, merge_metrics(batch.metrics, metrics))
                log.info(format_progress(step, config.max_steps, record))
                monitors.log(step, record)
            maybe_checkpoint(trainer, config, step)
        barrier()
    finally:
        if monitors is not None:
            monitors.close()
        publisher.close()
        teardown_trainer(trainer)


def step_memory(trainer: Trainer, config: TrainerConfig) -> dict[str, float]:
    """Colocated on a GPU: the step's peak memory (reset for the next), and, where vLLM sleeps
    (config.release_cached_memory), the allocator's cached blocks returned to the GPU for vLLM. Elsewhere: nothing."""
    if not config.colocated or trainer.device.type != "cuda":
        return {}
    import torch

    peak = {
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(trainer.device) / 2**30,
        "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(trainer.device) / 2**30,
    }
    if config.release_cached_memory:
        torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(trainer.device)
    return peak


class NonFiniteGuard:
    """Counts skipped (NaN/inf) steps; raises once `limit` of them come in a row."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def update(self, step: int, skipped: bool) -> int:
        if not skipped:
            self.in_a_row = 0
            return self.total
        self.in_a_row += 1
        self.total += 1
        log.warning(f"step {step}: NaN/inf gradient norm, optimizer step skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.limit:
            raise FloatingPointError(
                f"{self.in_a_row} steps in a row (up to step {step}) had NaN/inf gradients and were skipped "
                f"(trainer.max_nonfinite_steps = {self.limit}); lower trainer.optim.lr or check the batches "
                "(advantages, inference_logprobs) for inf/nan"
            )
        return self.total


def maybe_checkpoint(trainer: Trainer, config: TrainerConfig, step: int) -> None:
    """At checkpoint steps (every `checkpoint.interval` steps and the last step): write and commit the trainer's part,
    then (rank 0) commit the whole-run checkpoint with the orchestrator's part, and apply retention."""
    ckpt = config.checkpoint
    if not is_checkpoint_step(step, ckpt.interval, config.max_steps):
        return
    start = time.perf_counter()
    save_checkpoint(trainer.policy, trainer.optimizer, config.output_dir, trainer.checkpoint_meta(step), trainer.info)
    if not trainer.info.is_main:
        return
    if config.whole_run_checkpoints:
        wait_for_part(config.output_dir, step, ORCHESTRATOR_PART, ORCHESTRATOR_PART_TIMEOUT_S)
        commit_step(config.output_dir, step)
        committed = committed_run_steps(config.output_dir)
    else:
        committed = committed_steps(config.output_dir)
    pruned = prune_checkpoints(config.output_dir, committed, ckpt.keep_last, ckpt.keep_every)
    note = f"; deleted checkpoints of steps {pruned}" if pruned else ""
    log.info(f"checkpoint of step {step} committed in {time.perf_counter() - start:.1f}s{note}")


ORCHESTRATOR_PART_TIMEOUT_S = 60.0
"""The orchestrator writes its part before the step's batch, so it is there already; the wait only covers
filesystems that show other hosts' files late."""


def wait_for_part(output_dir: Path, step: int, part: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not is_part_committed(output_dir, step, part):
        if time.monotonic() > deadline:
            commit_step(output_dir, step)  # raises, naming the missing part and the fix
        time.sleep(0.1)
