"""Expert parallelism and the trainer's outputs: with ep=2 (2 ranks) the published HF weights hold full expert tensors,
the DCP checkpoint of EP-sharded experts reshards to one process with bit-exact weights, and it loads back into
ep=2 ranks (model and optimizer) to continue like the one process resumed from it."""

import shutil

import torch
from safetensors.torch import load_file

from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.trainer import OptimConfig, ParallelConfig, TrainerConfig
from slipstream.models.registry import export_hf_state_dict
from slipstream.trainer.ckpt import committed_steps
from slipstream.trainer.rl import run_trainer
from slipstream.trainer.setup import setup_trainer, teardown_trainer
from slipstream.weights.wire.published import weights_dir
from tests.distributed.helpers import run_ranks, run_trainers, write_step_batches


def _config(model_dir, output_dir, max_steps, ep=1, **kwargs):
    return TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl="custom",
        output_dir=output_dir,
        max_steps=max_steps,
        optim=OptimConfig(lr=1e-3, max_grad_norm=0.5, weight_decay=0.01),
        parallel=ParallelConfig(ep=ep),
        device="cpu",
        num_threads=1,
        batch_timeout_s=10.0,
        **kwargs,
    )


def _published(output_dir, step):
    return load_file(weights_dir(output_dir, step) / "model.safetensors")


def test_ep_publishes_full_experts_and_checkpoints_reshard(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3_moe")
    ep_dir, single = tmp_path / "ep", tmp_path / "single"
    write_step_batches(ep_dir, 3, world_size=2)
    write_step_batches(single, 3, world_size=2, as_single_rank=True)
    configs = [
        _config(model_dir, ep_dir, 2, ep=2, checkpoint=CheckpointConfig(interval=2)),
        _config(model_dir, ep_dir, 3, ep=2, resume_step="latest"),
    ]
    run_ranks(2, run_trainers, configs)
    assert committed_steps(ep_dir) == [2]

    published = _published(ep_dir, 2)
    num_experts = 8
    expert_keys = [k for k in published if ".mlp.experts." in k]
    assert len(expert_keys) == 2 * 3 * num_experts  # layers x projections x experts, every expert published

    # The EP checkpoint on one process: exactly the weights the EP run published, with Adam moments for all.
    shutil.copytree(ep_dir / "checkpoints" / "step_2", single / "checkpoints" / "step_2")
    trainer = setup_trainer(_config(model_dir, single, 3, resume_step=2))
    exported = export_hf_state_dict(trainer.model)
    assert exported.keys() == published.keys()
    for name, tensor in published.items():
        assert torch.equal(exported[name], tensor), name
    moments = [s["exp_avg_sq"] for s in trainer.optimizer.state.values()]
    assert len(moments) == len(list(trainer.model.parameters())) and all((m > 0).any() for m in moments)
    teardown_trainer(trainer)

    # Step 3 from that checkpoint: one process and the ep=2 ranks (which loaded it into sharded experts) agree.
    run_trainer(_config(model_dir, single, 3, resume_step=2))
    got, want = _published(ep_dir, 3), _published(single, 3)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-5, msg=name)
