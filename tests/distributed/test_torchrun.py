"""The production launch path: `torchrun --nproc-per-node 2 -m slipstream trainer -c trainer.toml` on CPU (gloo)
reads each rank's batch file, publishes weights and writes metrics from rank 0 only, and commits checkpoints."""

import subprocess
import sys

import pytest
from safetensors.torch import load_file

from slipstream.config.shared import CheckpointConfig, ModelConfig
from slipstream.config.trainer import OptimConfig, TrainerConfig
from slipstream.monitor.metrics import read_metrics
from slipstream.trainer.ckpt import committed_steps
from slipstream.weights.wire.published import READY, read_probe, weights_dir
from tests.distributed.helpers import step_micro_batches, write_step_batches


@pytest.mark.parametrize(("family", "impl"), [("llama", "custom"), ("qwen3", "hf")])
def test_torchrun_two_ranks_train_publish_and_checkpoint(tiny_model_factory, tmp_path, family, impl):
    model_dir = tiny_model_factory(family)
    write_step_batches(tmp_path, 2, world_size=2)
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl=impl,
        output_dir=tmp_path,
        max_steps=2,
        optim=OptimConfig(lr=1e-3),
        device="cpu",
        num_threads=1,
        batch_timeout_s=20.0,
        checkpoint=CheckpointConfig(interval=1),
    )
    config.write_toml(tmp_path / "trainer.toml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "slipstream", "trainer", "-c", str(tmp_path / "trainer.toml")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    assert proc.stdout.count("step 2/2") == 1  # progress from rank 0 only
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:  # metrics sum over both ranks
        num_tokens = sum(len(mb.input_ids) for mbs in step_micro_batches(r["step"], 2) for mb in mbs)
        assert r["num_tokens"] == num_tokens and r["reward/mean"] == 0.5
    for step in (1, 2):
        assert (weights_dir(tmp_path, step) / READY).is_file()
        assert len(read_probe(tmp_path, step)["logprobs"]) > 0
    first, second = (load_file(weights_dir(tmp_path, s) / "model.safetensors") for s in (1, 2))
    assert ("lm_head.weight" in first) == (family != "llama")  # llama's tied embeddings stay tied
    assert any(not first[k].equal(second[k]) for k in first)
    assert committed_steps(tmp_path) == [1, 2]
