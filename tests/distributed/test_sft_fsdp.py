"""`slipstream sft` with FSDP over 2 CPU ranks (gloo) equals one process: the per-token mean over the global batch
and the summed gradients make the losses and the final weights match (<= 1e-5). The two ranks are started the way a
user starts them: `slipstream sft --num-procs 2`, which replaces itself with torchrun (launch/sft.py). Context
parallelism (cp=2) with prefix trees equals one process packing the conversations whole."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import RunDir
from slipstream.trainer.sft import run_sft
from tests.unit.test_sft_loop import _config


def test_sft_fsdp_two_ranks_equals_one_process(tiny_qwen3_dir, tmp_path):
    one = _config(tiny_qwen3_dir, tmp_path, tmp_path / "one", max_steps=3, batch_size=5)
    two = _config(tiny_qwen3_dir, tmp_path, tmp_path / "two", max_steps=3, batch_size=5)
    run_sft(one)
    two.write_toml(tmp_path / "two.toml")  # 5 samples: 3 on rank 0, 2 on rank 1 (uneven micro-batch counts)
    cmd = [sys.executable, "-m", "slipstream", "sft", "-c", str(tmp_path / "two.toml"), "--num-procs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting 2 ranks on the CPU under torchrun" in proc.stdout
    assert proc.stdout.count("step 3/3") == 1  # progress from rank 0 only
    for a, b in zip(read_metrics(one.output_dir), read_metrics(two.output_dir), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["num_loss_tokens"] == b["num_loss_tokens"]
        assert (a.get("val/loss") is None) == (b.get("val/loss") is None)
        if "val/loss" in a:
            assert abs(a["val/loss"] - b["val/loss"]) <= 1e-5
    w1 = load_file(RunDir(one.output_dir).weights_dir(3) / "model.safetensors")
    w2 = load_file(RunDir(two.output_dir).weights_dir(3) / "model.safetensors")
    assert w1.keys() == w2.keys()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-4)  # AdamW: near-zero gradients, rounding x lr


def test_sft_context_parallel_with_prefix_trees_equals_one_process(tiny_qwen3_dir, tmp_path):
    """cp=2 (one data rank) runs the conversations as prefix trees cut between the two ranks; the losses and final
    weights equal one process packing the conversations whole (shared_prefix = false)."""
    one = _config(tiny_qwen3_dir, tmp_path, tmp_path / "one", max_steps=2, shared_prefix=False, model_impl="custom")
    two = _config(tiny_qwen3_dir, tmp_path, tmp_path / "cp", max_steps=2, model_impl="custom", parallel={"cp": 2})
    run_sft(one)
    two.write_toml(tmp_path / "cp.toml")
    cmd = [sys.executable, "-m", "slipstream", "sft", "-c", str(tmp_path / "cp.toml"), "--num-procs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records_one, records_cp = read_metrics(one.output_dir), read_metrics(two.output_dir)
    assert any(r["num_packed_tokens"] < r["num_tokens"] for r in records_cp)  # trees ran
    assert all(r["num_packed_tokens"] == r["num_tokens"] for r in records_one)
    for a, b in zip(records_one, records_cp, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a.get("val/loss") == pytest.approx(b.get("val/loss"), abs=1e-5)
    w1 = load_file(RunDir(one.output_dir).weights_dir(2) / "model.safetensors")
    w2 = load_file(RunDir(two.output_dir).weights_dir(2) / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-4)  # AdamW: near-zero gradients, rounding x lr
