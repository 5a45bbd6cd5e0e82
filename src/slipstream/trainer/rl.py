"""RL trainer loop: wait for the orchestrator's batch of step N, train on it, publish weights of step N, log."""

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from slipstream.config.trainer import TrainerConfig
from slipstream.monitor.metrics import MetricsWriter, format_progress, merge_metrics
from slipstream.trainer.data import validate_batch
from slipstream.trainer.step import train_step
from slipstream.trainer.weights import build_probe_token_ids, publish_weights
from slipstream.transport.rollouts import wait_for_batch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Trainer:
    """Everything the loop needs, built once by setup_trainer."""

    model: nn.Module
    tokenizer: "PreTrainedTokenizerBase"
    optimizer: torch.optim.Optimizer
    device: torch.device
    rank: int
    world_size: int
    probe_token_ids: list[int]
    compute_dtype: torch.dtype
    """config.model.dtype: forward/backward compute dtype and the dtype of the published weights."""


def run_trainer(config: TrainerConfig) -> None:
    """Train for `config.max_steps` steps; step N's weights are published as policy version N."""
    trainer = setup_trainer(config)
    writer = MetricsWriter(config.output_dir)
    for step in range(1, config.max_steps + 1):
        t_start = time.perf_counter()
        batch = wait_for_batch(config.output_dir, step, trainer.rank, config.batch_timeout_s)
        validate_batch(batch, step, trainer.rank, trainer.world_size)
        t_batch = time.perf_counter()
        metrics = train_step(
            trainer.model,
            trainer.optimizer,
            batch,
            config.loss,
            config.optim.max_grad_norm,
            trainer.device,
            trainer.compute_dtype,
        )
        t_train = time.perf_counter()
        publish_weights(
            trainer.model,
            trainer.tokenizer,
            config.output_dir,
            step,
            trainer.probe_token_ids,
            dtype=trainer.compute_dtype,
        )
        t_end = time.perf_counter()

        metrics |= {
            "tokens_per_s": metrics["num_tokens"] / max(t_train - t_batch, 1e-9),
            "timing/wait_batch_s": t_batch - t_start,
            "timing/train_s": t_train - t_batch,
            "timing/publish_s": t_end - t_train,
            "timing/step_s": t_end - t_start,
        }
        record = writer.write(step, merge_metrics(batch.metrics, metrics))
        print(format_progress(step, config.max_steps, record), flush=True)


def setup_trainer(config: TrainerConfig) -> Trainer:
    """Seed, threads, device, model, tokenizer, AdamW and probe tokens.

    The model is always loaded in float32: those are the master weights AdamW updates (a bf16 update of size
    lr ~ 1e-6 would round away). config.model.dtype only sets the compute dtype (autocast) and the published dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from slipstream.models.hub import resolve_model

    rank, world_size = read_rank()
    torch.manual_seed(config.seed)
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    device = select_device(config.device)
    hf_logging.disable_progress_bar()

    model_dir = resolve_model(config.model.name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=config.optim.lr,
        betas=config.optim.betas,
        eps=config.optim.eps,
        weight_decay=config.optim.weight_decay,
    )
    probe_token_ids = build_probe_token_ids(tokenizer, config.probe.text)
    compute_dtype = _DTYPES[config.model.dtype]
    return Trainer(model, tokenizer, optimizer, device, rank, world_size, probe_token_ids, compute_dtype)


def read_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) from the environment (torchrun sets them); defaults to a single rank."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise NotImplementedError(
            f"WORLD_SIZE={world_size}: multi-rank training is not yet supported; run the trainer as one process"
        )
    return rank, world_size


def select_device(device: str) -> torch.device:
    """`auto` picks CUDA when available; an explicit `cuda` without a GPU is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device = 'cuda' but torch sees no CUDA device; set trainer.device = 'cpu'")
    return torch.device(device)
