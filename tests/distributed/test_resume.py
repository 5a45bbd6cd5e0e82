"""Checkpoint and resume through run_trainer: 4 straight steps == 2 steps + checkpoint + resume + 2 steps, bit-exact
(2 ranks, FSDP); a 2-rank checkpoint resumes on 1 rank with bit-exact weights and continues like the 2-rank run."""

import shutil

import torch
from safetensors.torch import load_file

from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.trainer import OptimConfig, TrainerConfig
from slipstream.models.registry import export_hf_state_dict
from slipstream.monitor.metrics import read_metrics
from slipstream.trainer.ckpt import COMMITTED, checkpoint_dir, committed_steps
from slipstream.trainer.rl import run_trainer
from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.wire.published import weights_dir
from tests.distributed.helpers import run_ranks, run_trainers, write_step_batches


def _config(model_dir, output_dir, max_steps, **kwargs):
    return TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl="custom",
        output_dir=output_dir,
        max_steps=max_steps,
        optim=OptimConfig(lr=1e-3, max_grad_norm=0.5, weight_decay=0.01),
        device="cpu",
        num_threads=1,
        batch_timeout_s=10.0,
        **kwargs,
    )


def _published(output_dir, step):
    return load_file(weights_dir(output_dir, step) / "model.safetensors")


def _assert_equal(got, want, atol=0.0):
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=atol, msg=name)


def test_resume_is_bit_exact_and_reshards_to_one_rank(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3_moe")
    straight, resumed, single = tmp_path / "straight", tmp_path / "resumed", tmp_path / "single"
    for out in (straight, resumed):
        write_step_batches(out, 4, world_size=2)
    configs = [
        _config(model_dir, straight, 4),
        _config(model_dir, resumed, 2, checkpoint=CheckpointConfig(interval=2)),
        _config(model_dir, resumed, 4, resume_step="latest"),
    ]
    run_ranks(2, run_trainers, configs)

    assert committed_steps(resumed) == [2] and (checkpoint_dir(resumed, 2) / COMMITTED).is_file()
    assert not committed_steps(straight)
    assert sorted(p.name for p in (checkpoint_dir(resumed, 2) / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    for step in (1, 2, 3, 4):
        _assert_equal(_published(resumed, step), _published(straight, step))
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3, 4]
    assert [r["loss"] for r in read_metrics(resumed)] == [r["loss"] for r in read_metrics(straight)]

    # 2 ranks -> 1 rank: the resharded checkpoint holds exactly the weights published at step 2 ...
    shutil.copytree(resumed / "checkpoints", single / "checkpoints")
    write_step_batches(single, 4, world_size=2, as_single_rank=True)
    trainer = setup_trainer(_config(model_dir, single, 4, resume_step=2))
    assert trainer.start_step == 2 and trainer.world_size == 1
    _assert_equal(export_hf_state_dict(trainer.model), _published(straight, 2))
    moments = [s["exp_avg_sq"] for s in trainer.optimizer.state.values()]
    assert len(moments) == len(list(trainer.model.parameters())) and all((m > 0).any() for m in moments)
    teardown_trainer(trainer)
    # ... and two more steps on one rank land where the 2-rank run did (same maths, other reduction order).
    run_trainer(_config(model_dir, single, 4, resume_step=2))
    assert not weights_dir(single, 2).exists()
    _assert_equal(_published(single, 4), _published(straight, 4), atol=1e-5)
