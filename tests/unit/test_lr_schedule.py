"""Learning-rate schedule (trainer/schedule.py): warm-up, constant / linear / cosine decay, and that the RL trainer
steps with the scheduled rate (Adam's first update moves each weight by about the rate)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import OptimConfig, TrainerConfig
from slipstream.monitor.metrics import read_metrics
from slipstream.trainer.rl import run_trainer
from slipstream.trainer.schedule import lr_at
from slipstream.weights.wire.published import weights_dir
from tests.unit.test_trainer_loop import _write_batches


def test_warmup_then_constant():
    optim = OptimConfig(lr=1e-3, warmup_steps=4)
    assert [lr_at(optim, s, 10) for s in (1, 2, 4, 5, 10)] == pytest.approx([2.5e-4, 5e-4, 1e-3, 1e-3, 1e-3])
    assert lr_at(OptimConfig(lr=1e-3), 1, 10) == 1e-3


@pytest.mark.parametrize("scheduler", ["linear", "cosine"])
def test_decay_starts_at_lr_falls_monotonically_and_never_reaches_zero(scheduler):
    optim = OptimConfig(lr=1e-3, warmup_steps=2, scheduler=scheduler)
    rates = [lr_at(optim, s, 12) for s in range(1, 13)]
    assert rates[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # the first step after warm-up trains at lr
    assert all(a > b for a, b in zip(rates[2:], rates[3:], strict=False))
    assert 0 < rates[-1] < 2e-4  # the last step still trains
    if scheduler == "linear":  # ten decay steps: lr x (1 - k / 10)
        assert rates[2:] == pytest.approx([1e-3 * (1 - k / 10) for k in range(10)])
    else:
        assert rates[2:] == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(10)])


def test_min_lr_ratio_is_the_floor():
    optim = OptimConfig(lr=1e-3, scheduler="cosine", min_lr_ratio=0.1)
    assert lr_at(optim, 1, 100) == pytest.approx(1e-3)
    assert 1e-4 < lr_at(optim, 100, 100) < 1.01e-4
    assert lr_at(optim, 1000, 100) == pytest.approx(1e-4)  # past max_steps (a longer resumed run): stays at the floor


def test_bad_schedule_fields_name_the_field():
    with pytest.raises(ValueError, match="scheduler"):
        OptimConfig(scheduler="exponential")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        OptimConfig(min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="steps count from 1"):
        lr_at(OptimConfig(), 0, 10)


def test_rl_trainer_steps_with_the_scheduled_rate(tiny_qwen3_dir, tmp_path):
    """Adam's first update is lr x g / (|g| + eps) per weight: the largest move is the step's rate. With warm-up
    over 4 steps, step 1 trains at a quarter of lr, and metrics.jsonl logs each step's rate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    _write_batches(model, tmp_path, num_steps=3)
    optim = OptimConfig(lr=1e-2, warmup_steps=4, scheduler="linear", max_grad_norm=1e9)
    config = TrainerConfig(
        model=ModelConfig(name=str(tiny_qwen3_dir)),
        output_dir=tmp_path,
        max_steps=3,
        optim=optim,
        device="cpu",
        batch_timeout_s=5.0,
    )
    run_trainer(config)
    assert [r["lr"] for r in read_metrics(tmp_path)] == pytest.approx([lr_at(optim, s, 3) for s in (1, 2, 3)])
    before = dict(model.named_parameters())
    after = load_file(weights_dir(tmp_path, 1) / "model.safetensors")
    moved = max((after[name].float() - p.detach()).abs().max().item() for name, p in before.items() if name in after)
    assert moved == pytest.approx(2.5e-3, rel=0.05)  # lr / 4, not lr
