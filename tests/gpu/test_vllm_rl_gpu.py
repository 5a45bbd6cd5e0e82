"""`slipstream rl` with vLLM's GPU build on 2 GPUs (vLLM on GPU 0, the trainer on GPU 1, weights over NCCL): tiny
dense and MoE models train 3 steps with every calibrated weight check passing, broken loads (a layer dropped, two
layers swapped) stop the run, router replay takes the experts vLLM routed to, and a multi-turn tool environment runs.

Not run in CI (marked gpu; needs vLLM's GPU build: docs/gpu.md). `SLIPSTREAM_GPU_MODELS` (a
comma-separated list of model folders, e.g. SmolLM2-135M-Instruct imported from its GGUF, or a random-weight model of
a real shape) runs the broken-load tests on those models instead of the tiny one: they must fail on every model.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import free_port, tiny_rl_config, write_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM's GPU build"),
]
REPO_ROOT = Path(__file__).resolve().parents[2]
EXTRA_MODELS = [Path(p) for p in os.environ.get("SLIPSTREAM_GPU_MODELS", "").split(",") if p]


def _config(model_dir: Path, out: Path, max_steps: int, **sections) -> dict:
    """The CPU tests' tiny RL config, on 2 GPUs: vLLM on GPU 0 (30% of it), the trainer on GPU 1, NCCL weights, the
    weight check calibrated (no fixed bound), a larger learning rate so every step moves the policy."""
    config = tiny_rl_config(model_dir, out, max_steps, **sections)
    config["deployment"] = {"gpus": [0, 1]}
    config["weights"] = {"master_port": free_port()}
    config["inference"] |= {"max_model_len": 1024, "max_num_seqs": 64, "gpu_memory_utilization": 0.3}
    del config["inference"]["cpu_kv_cache_gib"]
    config["orchestrator"] = {k: v for k, v in config["orchestrator"].items() if k != "weight_check"}
    config["orchestrator"] |= {"batch_size": 16, "micro_batch_tokens": 2048}
    config["orchestrator"]["sampling"]["max_tokens"] = 32
    config["trainer"] = {"optim": {"lr": 1e-4, "max_grad_norm": 10.0}}
    config["launch"]["health_timeout_s"] = 600
    return config


def _run(config: dict, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    path = write_config(tmp_path / "rl.toml", config)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted((out / "logs").glob("*.log")))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_tiny_models_train_with_every_check_passing(family, tiny_model_factory, tmp_path):
    out = tmp_path / "run"
    proc = _run(_config(tiny_model_factory(family), out, 3), tmp_path)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
    records = _read(out / "weight_checks.jsonl")
    checks = [c for c in records if c["kind"] == "update"]
    assert [c for c in records if c["kind"] == "calibration"], records
    assert checks and all(c["passed"] for c in checks) and checks[-1]["step"] == 3, checks
    metrics = _read(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["mismatch_kl"] < 1e-2, metrics[0]  # vLLM's bf16 sampling vs the trainer's bf16 log-probs


def _broken_models(tiny_model_factory) -> list[Path]:
    return EXTRA_MODELS or [tiny_model_factory("qwen3")]


@pytest.mark.parametrize("sabotage", ["skip_layer", "swap_layers"])
def test_a_broken_load_stops_the_run_on_every_model(sabotage, tiny_model_factory, tmp_path):
    for i, model_dir in enumerate(_broken_models(tiny_model_factory)):
        out = tmp_path / f"run{i}"
        config = _config(model_dir, out, 5)
        config["orchestrator"]["max_async_level"] = 0  # every version loaded in turn: calibrated before the first
        config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.sabotage_ext.FrozenWeightLoader"]
        proc = _run(config, tmp_path, env={"SLIPSTREAM_SABOTAGE": sabotage})
        assert proc.returncode != 0, f"{model_dir}: the run did not stop\n{_logs(out)}"
        assert "did not take effect on inference" in proc.stderr, f"{model_dir}\n{proc.stderr[-3000:]}\n{_logs(out)}"
        records = _read(out / "weight_checks.jsonl")
        calibration = [c for c in records if c["kind"] == "calibration"]
        failed = [c for c in records if c["kind"] == "update" and not c["passed"]]
        assert calibration and failed, records
        print(
            f"{sabotage} on {model_dir.name}: floor {calibration[0]['max_abs_diff']:.3g}, caught at step "
            f"{failed[0]['step']} (max diff {failed[0]['max_abs_diff']:.3g}, allowed {failed[0]['allowed']:.3g})"
        )


def test_router_replay_uses_the_experts_vllm_routed_to(tiny_model_factory, tmp_path):
    kl = {}
    for replay in (False, True):
        out = tmp_path / f"replay_{replay}"
        config = _config(tiny_model_factory("qwen3_moe"), out, 2)
        config["inference"]["enable_return_routed_experts"] = replay
        config["orchestrator"]["router_replay"] = replay
        proc = _run(config, tmp_path)
        assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
        kl[replay] = _read(out / "metrics.jsonl")[0]["mismatch_kl"]
    print(f"router replay: step-1 mismatch KL {kl[False]:.3g} without, {kl[True]:.3g} with")
    assert kl[True] < kl[False], kl


def test_a_multi_turn_tool_environment_trains(tiny_model_factory, tmp_path):
    out = tmp_path / "run"
    env = {"name": "calculator", "args": {"num_tasks": 32, "max_turns": 3}}
    config = _config(tiny_model_factory("qwen3"), out, 2, orchestrator={"env": env})
    config["inference"]["tool_call_parser"] = "hermes"
    proc = _run(config, tmp_path)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
    checks = [c for c in _read(out / "weight_checks.jsonl") if c["kind"] == "update"]
    assert checks and all(c["passed"] for c in checks), checks
