"""`slipstream rl` on ONE GPU with vLLM's GPU build: vLLM and the trainer colocated (deployment.colocate, the default
on a one-GPU node), taking turns. vLLM sleeps while the trainer steps (its memory really freed: vLLM's log says how
much), wakes to load each version through CUDA IPC, and every calibrated weight check passes at sleep levels 1 and 2;
a broken load (a layer dropped) still stops the run.

Not run in CI (marked gpu; needs vLLM's GPU build: docs/gpu.md).
"""

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.gpu.test_vllm_rl_gpu import _config, _logs, _read, _run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's GPU build"),
]


def _colocated(model_dir: Path, out: Path, max_steps: int, level: int) -> dict:
    """The 2-GPU tests' config on GPU 0 alone: colocation is then the default, so only the sleep level is set."""
    config = _config(model_dir, out, max_steps)
    config["deployment"] = {"gpus": [0], "sleep_level": level}
    del config["weights"]  # no rendezvous: the ipc transport needs none
    del config["inference"]["gpu_memory_utilization"]  # planned from the model's size
    return config


@pytest.mark.parametrize("level", [1, 2])
def test_tiny_model_trains_colocated_with_every_check_passing(level, tiny_model_factory, tmp_path):
    out = tmp_path / "run"
    proc = _run(_colocated(tiny_model_factory("qwen3"), out, 4, level), tmp_path)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
    assert "colocated on the GPU: vLLM and the trainer take turns" in proc.stdout, proc.stdout[-2000:]
    records = _read(out / "weight_checks.jsonl")
    checks = [c for c in records if c["kind"] == "update"]
    assert [c for c in records if c["kind"] == "calibration"], records
    assert [c["step"] for c in checks] == [1, 2, 3, 4] and all(c["passed"] for c in checks), checks
    metrics = _read(out / "metrics.jsonl")
    assert [m["colocate/sleep_level"] for m in metrics] == [1] + [level] * 3
    assert all(m["colocate/wake_s"] > 0 and m["memory/peak_reserved_gib"] > 0 for m in metrics[1:]), metrics
    freed = [
        float(g) for g in re.findall(r"Sleep mode freed ([\d.]+) GiB", (out / "logs" / "inference.log").read_text())
    ]
    assert len(freed) == 4 and min(freed) > 1.0, freed  # the KV cache (and weights) really left the GPU each turn
    print(
        f"level {level}: vLLM freed {freed} GiB; turns {[round(m['colocate/trainer_turn_s'], 2) for m in metrics[1:]]}"
    )


def test_a_dropped_layer_stops_a_colocated_run(tiny_model_factory, tmp_path):
    out = tmp_path / "run"
    config = _colocated(tiny_model_factory("qwen3"), out, 3, 1)
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.sabotage_ext.FrozenWeightLoader"]
    proc = _run(config, tmp_path, env={"SLIPSTREAM_SABOTAGE": "skip_layer"})
    assert proc.returncode != 0, f"the run did not stop\n{_logs(out)}"
    assert "did not load whole on inference" in proc.stderr, f"{proc.stderr[-3000:]}\n{_logs(out)}"
