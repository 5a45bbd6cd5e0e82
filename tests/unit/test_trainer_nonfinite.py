"""NaN/inf gradients: the step is skipped (weights and Adam state untouched) and counted; N in a row stop the run."""

import json

import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.trainer import TrainerConfig
from slipstream.trainer.rl import run_trainer
from slipstream.transport.rollouts import MicroBatch, TrainingBatch, write_batch
from slipstream.weights.wire.published import weights_dir

HUGE = 3e38
"""A float32 advantage whose gradients' squared norm overflows to inf."""


def _batch(step: int, advantage: float) -> TrainingBatch:
    ids = [5, 6, 7, 8, 9, 10]
    mb = MicroBatch(
        input_ids=ids,
        position_ids=list(range(len(ids))),
        loss_mask=[False, False, True, True, True, True],
        advantages=[0.0, 0.0] + [advantage] * 4,
        inference_logprobs=[0.0, 0.0, -5.0, -5.0, -5.0, -5.0],
        temperatures=[1.0] * len(ids),
    )
    return TrainingBatch(step=step, rank=0, num_loss_tokens=4, micro_batches=[mb], metrics={"reward/mean": 0.5})


def _config(model_dir, out, max_steps, limit):
    return TrainerConfig(
        model={"name": str(model_dir)},
        output_dir=out,
        max_steps=max_steps,
        optim={"lr": 1e-3},
        num_threads=1,
        max_nonfinite_steps=limit,
        batch_timeout_s=30,
    )


def test_nan_step_is_skipped_and_counted(tiny_qwen3_dir, tmp_path):
    # A finite but huge advantage overflows the gradients' norm (non-finite inputs are refused by to_packed).
    for step, adv in ((1, 1.0), (2, HUGE), (3, 1.0)):
        write_batch(tmp_path, _batch(step, adv))
    run_trainer(_config(tiny_qwen3_dir, tmp_path, max_steps=3, limit=2))

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite/skipped"] for r in records] == [0.0, 1.0, 0.0]
    assert [r["nonfinite/total"] for r in records] == [0, 1, 1]
    step1, step2, step3 = (load_file(weights_dir(tmp_path, s) / "model.safetensors") for s in (1, 2, 3))
    assert all(torch.equal(step1[k], step2[k]) for k in step1)  # the NaN step changed nothing
    assert any(not torch.equal(step2[k], step3[k]) for k in step2)  # training resumed after it
    assert all(torch.isfinite(t).all() for t in step3.values())


def test_too_many_nonfinite_steps_in_a_row_stop_the_trainer(tiny_qwen3_dir, tmp_path):
    for step in (1, 2):
        write_batch(tmp_path, _batch(step, HUGE))
    with pytest.raises(FloatingPointError, match=r"2 steps in a row .*\(trainer\.max_nonfinite_steps = 2\)"):
        run_trainer(_config(tiny_qwen3_dir, tmp_path, max_steps=3, limit=2))
