"""SFT loop (`slipstream sft`): take step N's samples, train on this rank's share, validate, log, checkpoint with
the data position; at the end publish the model as a Hugging Face folder `weights/step_<max_steps>/` (with LoRA:
the merged model, plus the adapter in PEFT format in its `adapter/` folder).

Model loading, parallelism (FSDP/EP/CP/AC/compile), AdamW, checkpoints and the weight export are the RL trainer's
(setup_trainer, trainer/ckpt.py, weights/send/publish.py), driven by `SFTConfig.trainer_config()`.
"""

import logging
import time
from dataclasses import dataclass

from slipstream.config.sft import SFTConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.monitor.logs import setup_logging
from slipstream.monitor.metrics import MetricsWriter, format_progress
from slipstream.parallel.dist import barrier
from slipstream.rundir import RunDir
from slipstream.trainer.ckpt import committed_steps
from slipstream.trainer.profile import profiled
from slipstream.trainer.rl import NonFiniteGuard, maybe_checkpoint
from slipstream.trainer.schedule import apply_lr
from slipstream.trainer.setup import Trainer, setup_trainer, teardown_trainer
from slipstream.trainer.sft_data import CURSOR_FILE, DataCursor, next_batch, rank_share
from slipstream.trainer.sft_render import SFTSample, load_samples
from slipstream.trainer.sft_step import prefix_sharing, sft_step, validation_loss
from slipstream.trainer.sft_trees import PrefixSharing
from slipstream.transport.checkpoints import is_checkpoint_step, truncate_step_log
from slipstream.weights.send.lora_export import ADAPTER_DIR, export_peft_adapter
from slipstream.weights.send.publish import WeightPublisher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SFTData:
    train: list[SFTSample]
    val: list[SFTSample]


def run_sft(config: SFTConfig) -> None:
    """Train steps start_step + 1 .. max_steps, then write `weights/step_<max_steps>/`."""
    setup_logging("sft")
    trainer_config = config.trainer_config()
    check_output_dir(config)
    trainer = setup_trainer(trainer_config)
    try:
        data = build_data(config, trainer)
        if trainer.info.is_main:
            log.info(
                f"{len(data.train)} training samples, {len(data.val)} validation samples; {trainer.world_size} "
                f"rank(s), {trainer.num_data_ranks} data rank(s)"
            )
        sharing = setup_sharing(config, trainer)
        cursor = setup_progress(config, trainer, len(data.train))
        writer = MetricsWriter(config.output_dir) if trainer.info.is_main else None
        nonfinite = NonFiniteGuard(trainer_config.max_nonfinite_steps)
        for step in range(trainer.start_step + 1, config.max_steps + 1):
            t_start = time.perf_counter()
            indices, cursor = next_batch(len(data.train), cursor, config.batch_size, config.seed, config.data.shuffle)
            mine = rank_share(indices, trainer.data_rank, trainer.num_data_ranks)
            apply_lr(trainer.optimizer, config.optim, step, config.max_steps)
            with profiled(step, config.profile_steps, config.output_dir, trainer.info.rank, trainer.device):
                metrics = sft_step(
                    trainer,
                    [data.train[i] for i in indices],
                    [data.train[i] for i in mine],
                    config.micro_batch_tokens,
                    config.optim.max_grad_norm,
                    sharing,
                )
            metrics["nonfinite/total"] = nonfinite.update(step, bool(metrics["nonfinite/skipped"]))
            t_train = time.perf_counter()
            metrics |= maybe_validate(trainer, config, data, step, sharing)
            metrics |= {
                "lr": trainer.optimizer.param_groups[0]["lr"],
                "epoch": cursor.epoch + cursor.index / len(data.train),
                "tokens_per_s": metrics["num_tokens"] / max(t_train - t_start, 1e-9),
                "timing/step_s": time.perf_counter() - t_start,
            }
            if writer is not None:  # before the checkpoint: a committed step always has its record
                log.info(format_progress(step, config.max_steps, writer.write(step, metrics)))
            maybe_checkpoint_sft(trainer, trainer_config, step, cursor, len(data.train))
        export_model(trainer, trainer_config)
        if writer is not None:
            from slipstream.monitor.plots import write_plots

            paths = write_plots(config.output_dir)
            log.info(f"plots: {', '.join(p.name for p in paths)} in {RunDir(config.output_dir).plots_dir}")
        barrier()
    finally:
        teardown_trainer(trainer)


def check_output_dir(config: SFTConfig) -> None:
    """A fresh run (no resume_step) refuses a run directory with checkpoints: it would mix two runs."""
    if config.resume_step is None and committed_steps(config.output_dir):
        raise ValueError(
            f"{config.output_dir} holds checkpoints of steps {committed_steps(config.output_dir)}; set resume_step = "
            "'latest' to continue that run, or choose another output_dir"
        )


def build_data(config: SFTConfig, trainer: Trainer) -> SFTData:
    """Render the training and validation files with the model's tokenizer (every rank renders all of it)."""
    if config.batch_size < trainer.num_data_ranks:
        raise ValueError(
            f"batch_size = {config.batch_size} gives some of the {trainer.num_data_ranks} data ranks (world_size / "
            "cp) no sample; raise batch_size to at least that"
        )
    tokenizer, roles, budget = trainer.tokenizer, config.data.loss_roles, config.micro_batch_tokens
    train = load_samples(config.data.train_files, tokenizer, roles, budget)
    val = load_samples(config.data.val_files, tokenizer, roles, budget) if config.data.val_files else []
    if trainer.info.is_main:
        log.info(f"{len(train)} training samples, {len(val)} validation samples")
    return SFTData(train=train, val=val)


def setup_sharing(config: SFTConfig, trainer: Trainer) -> PrefixSharing | None:
    """Prefix trees for this trainer (sft_step.prefix_sharing), saying which way it goes when shared_prefix is on."""
    sharing = prefix_sharing(trainer, config.shared_prefix, config.shared_prefix_min_tokens)
    if trainer.info.is_main and config.shared_prefix:
        log.info(
            "shared_prefix: conversations that share a prefix train as prefix trees"
            if sharing is not None
            else "shared_prefix: conversations are packed whole on this trainer (it would write prefix trees back "
            "out as their conversations: CUDA without context parallelism, a transformers model or recurrent layers)"
        )
    return sharing


def setup_progress(config: SFTConfig, trainer: Trainer, num_samples: int) -> DataCursor:
    """The data cursor to start from (the checkpoint's when resuming); drop metrics records of later steps."""
    if trainer.info.is_main:
        truncate_step_log(RunDir(config.output_dir).metrics_path, trainer.start_step)
    barrier()
    if trainer.start_step == 0:
        return DataCursor()
    return DataCursor.read(RunDir(config.output_dir).checkpoint_dir(trainer.start_step) / CURSOR_FILE, num_samples)


def maybe_validate(
    trainer: Trainer, config: SFTConfig, data: SFTData, step: int, sharing: PrefixSharing | None
) -> dict[str, float]:
    if config.val_interval is None or not (step % config.val_interval == 0 or step == config.max_steps):
        return {}
    return validation_loss(
        trainer, data.val, config.micro_batch_tokens, trainer.data_rank, trainer.num_data_ranks, sharing
    )


def maybe_checkpoint_sft(
    trainer: Trainer, trainer_config: TrainerConfig, step: int, cursor: DataCursor, num_samples: int
) -> None:
    """The RL trainer's checkpoint, with the data cursor written into `checkpoints/step_N/` first: the trainer part's
    COMMITTED marker, written after it, vouches for both."""
    if not is_checkpoint_step(step, trainer_config.checkpoint.interval, trainer_config.max_steps):
        return
    if trainer.info.is_main:
        folder = RunDir(trainer_config.output_dir).checkpoint_dir(step)
        folder.mkdir(parents=True, exist_ok=True)
        cursor.write(folder / CURSOR_FILE, num_samples)
    maybe_checkpoint(trainer, trainer_config, step)


def export_model(trainer: Trainer, trainer_config: TrainerConfig) -> None:
    """Write `weights/step_<max_steps>/` (HF safetensors + config + tokenizer), gathered layer by layer; with LoRA
    that is the merged model, and the adapter alone goes to its `adapter/` folder (PEFT format)."""
    publisher = WeightPublisher(trainer, trainer_config)
    try:
        publisher.publish(trainer_config.max_steps)
    finally:
        publisher.close()
    folder = RunDir(trainer_config.output_dir).weights_dir(trainer_config.max_steps)
    lora = trainer_config.model.lora
    if lora is not None:  # the merged model above; the adapter alone beside its files
        export_peft_adapter(trainer.model, folder / ADAPTER_DIR, lora, str(trainer.model_dir), trainer.info.is_main)
    if trainer.info.is_main:
        log.info(f"model written to {folder} (usable as model.name)")
        if lora is not None:
            log.info(f"LoRA adapter (PEFT format) written to {folder / ADAPTER_DIR}")
