"""Learning-rate schedule: linear warm-up, then constant, linear or cosine decay (config: trainer.optim). The rate
is a function of the step alone, so a resumed run needs no scheduler state and follows the same rates."""

import math

import torch

from slipstream.config.trainer import OptimConfig


def lr_at(optim: OptimConfig, step: int, max_steps: int) -> float:
    """The learning rate of (1-based) `step` of a run of `max_steps` steps."""
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    if optim.warmup_steps and step <= optim.warmup_steps:
        return optim.lr * step / optim.warmup_steps
    if optim.scheduler == "constant":
        return optim.lr
    # progress 0 at the first step after warm-up; 1 would be the step after max_steps (never trained)
    decay_steps = max(1, max_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps - 1) / decay_steps)
    if optim.scheduler == "linear":
        scale = 1.0 - progress
    else:
        scale = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * scale)


def apply_lr(optimizer: torch.optim.Optimizer, optim: OptimConfig, step: int, max_steps: int) -> float:
    """Set every parameter group's rate for `step`; returns it (logged as `lr`)."""
    lr = lr_at(optim, step, max_steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
