"""On 4 GPUs: `slipstream rl` through the real launcher with the trainer on 2 GPUs (placement, torchrun, FSDP=2) and
weights sent over NCCL to the simulated inference server's receiver on a third GPU (the receive code of Slipstream's
vLLM engine; vLLM's GPU build cannot be installed on the machines of this project). The simulator runs as another
node would: started here, with `deployment.run = ["trainer", "orchestrator"]` on the launcher's side.

Not run in CI (marked gpu). The simulator's log-probs are not the model's, so the probe check is off; what is checked
is that every version arrives whole by broadcast (bytes = the manifest's) and is served, and every step runs once."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from slipstream.weights.wire.offers import read_manifest
from slipstream.weights.wire.published import READY, weights_dir
from tests.e2e.helpers import free_port, running_sim, write_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs 3 CUDA GPUs")]
MAX_STEPS = 5


def test_rl_trainer_fsdp2_sends_weights_over_nccl_to_a_third_gpu(tiny_qwen3_dir, tmp_path):
    out, port = tmp_path / "run", free_port()
    sim_log = tmp_path / "sim.log"
    sim_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "2", "PYTHONUNBUFFERED": "1"}
    sim_args = ["--vocab-size", "256", "--model-name", str(tiny_qwen3_dir), "--transfer-device", "cuda:0"]
    with running_sim(port, sim_log, *sim_args, "--default-max-tokens", "12", env=sim_env):
        config = {
            "max_steps": MAX_STEPS,
            "output_dir": str(out),
            "seed": 7,
            "model": {"name": str(tiny_qwen3_dir)},
            "deployment": {"run": ["trainer", "orchestrator"], "gpus": [0, 1]},
            "weights": {"transport": "nccl", "master_port": free_port(), "bucket_mb": 1},
            "orchestrator": {
                "inference_url": f"http://127.0.0.1:{port}",
                "batch_size": 8,
                "group_size": 4,
                "micro_batch_tokens": 512,
                "sampling": {"temperature": 1.0, "max_tokens": 12},
                "env": {"name": "reverse_text", "args": {"num_tasks": 64}},
                "weight_check": {"enabled": False},
            },
            "launch": {"health_timeout_s": 120, "shutdown_grace_s": 5},
        }
        cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(write_config(tmp_path / "rl.toml", config))]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"slipstream rl did not finish in 240 s: {e.stdout}\n{e.stderr}\n{_logs(out, sim_log)}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\n{_logs(out, sim_log)}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    assert all(m["weights/send_attempts"] == 1 for m in metrics)
    received = [
        json.loads(line.split("received ", 1)[1]) for line in sim_log.read_text().splitlines() if "received " in line
    ]
    assert [r["step"] for r in received] == list(range(1, MAX_STEPS + 1)), received
    # every version has the same plan; older versions' folders are pruned once a newer one is served
    nbytes = sum(b["nbytes"] for b in _bucket_sizes(out, MAX_STEPS))
    assert all(r["source"] == "broadcast" and r["num_bytes"] == nbytes for r in received), received
    assert sorted(p.name for p in (out / "weights").iterdir()) == [f"step_{MAX_STEPS}"]
    resolved = tomllib.loads((out / "config" / "rl.toml").read_text())
    assert resolved["launch"]["num_trainer_procs"] == 2 and resolved["weights"]["transport"] == "nccl"
    assert (weights_dir(out, MAX_STEPS) / READY).exists()  # the last version is also on disk


def _logs(out: Path, sim_log: Path) -> str:
    """The last lines of every log of the run, for a failure message."""
    parts = []
    for path in [*sorted((out / "logs").glob("*.log")), sim_log]:
        if path.exists():
            parts.append(f"----- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(parts)


def _bucket_sizes(out: Path, step: int) -> list[dict]:
    from slipstream.weights.wire.stream import Manifest

    manifest = Manifest.from_dict(read_manifest(out, step))
    return [{"nbytes": b.nbytes} for b in manifest.buckets]
