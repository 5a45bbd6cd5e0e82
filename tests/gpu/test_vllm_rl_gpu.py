"""`slipstream rl` with vLLM's GPU build on 2 GPUs (vLLM on GPU 0, the trainer on GPU 1, weights over NCCL): tiny
dense and MoE models train 3 steps with every calibrated weight check passing, broken loads (a layer dropped, two
layers swapped) stop the run, router replay takes the experts vLLM routed to, a multi-turn tool environment runs, vLLM
killed in the middle of an NCCL transfer (of a full or a delta version) is restarted and the version sent again, delta
updates over NCCL load exactly and repair a damaged delta, and LoRA adapters load into vLLM.

Not run in CI (marked gpu; needs vLLM's GPU build: docs/gpu.md). `SLIPSTREAM_GPU_MODELS` (a
comma-separated list of model folders, e.g. SmolLM2-135M-Instruct imported from its GGUF, or a random-weight model of
a real shape) runs the broken-load tests on those models instead of the tiny one: they must fail on every model.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.helpers import free_port, tiny_rl_config, write_config
from tests.e2e.test_weight_delta import check_delta_run
from tests.e2e.test_weight_transfer import MAX_STEPS as KILL_STEPS
from tests.e2e.test_weight_transfer import _freeze_mid_transfer, _vllm_tree, check_redone_after_restart

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


def _command(config: dict, tmp_path: Path, env: dict | None = None) -> tuple[list[str], dict]:
    path = write_config(tmp_path / "rl.toml", config)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    return [sys.executable, "-m", "slipstream", "rl", "-c", str(path)], env


def _run(config: dict, tmp_path: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd, env = _command(config, tmp_path, env)
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


@pytest.fixture(scope="module")
def qwen3_06b_shape(tiny_model_factory, tmp_path_factory) -> Path:
    """A random bf16 model of Qwen3-0.6B's shape (596M parameters, 1.19 GB) with the tiny tokenizer: weights larger
    than what NCCL buffers between two GPUs, so a send waits for its receiver (the tiny model's fit in the buffers)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    tiny, out = tiny_model_factory("qwen3"), tmp_path_factory.mktemp("qwen3_06b_shape")
    config = json.loads((tiny / "config.json").read_text())
    config.update(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=4096,
    )  # fmt: skip
    config.pop("layer_types", None)
    for f in tiny.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config.pop("model_type"), **config), dtype=torch.bfloat16
        )
    model.save_pretrained(out)
    return out


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
        if sabotage == "skip_layer":  # the engine's accounting, before any probe (bf16 noise can hide the layer)
            assert "did not load whole on inference" in proc.stderr, f"{proc.stderr[-3000:]}\n{_logs(out)}"
            print(f"{sabotage} on {model_dir.name}: caught by the engine at step 1")
            continue
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


@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_vllm_killed_mid_transfer_is_restarted_and_the_version_sent_again(delta, qwen3_06b_shape, tmp_path):
    """NCCL does not notice a receiver that died inside a node: the trainer's pending broadcasts would wait for it until
    the group's timeout. The orchestrator restarts vLLM and accepts the version for the new session; the trainer sees
    that, aborts the old group and sends the version again (weights/send/send_watch.py; with `weights.delta` the
    sender waits through the same watch wherever it must: weights/send/delta_send.py). Each version reaches vLLM's
    engine 3 s late (sabotage `slow`), so the test can catch a transfer in flight."""
    out = tmp_path / "run"
    config = _config(qwen3_06b_shape, out, KILL_STEPS)
    config["trainer"]["optim"]["lr"] = 3e-6
    if delta:
        config["weights"] |= {"transport": "nccl", "delta": {"enabled": True}}
    config["launch"] |= {"inference_restarts": 2, "inference_restart_backoff_s": 0.5}
    config["orchestrator"]["recovery"] = {"timeout_s": 600, "backoff_max_s": 2}
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.sabotage_ext.FrozenWeightLoader"]
    cmd, env = _command(config, tmp_path, {"SLIPSTREAM_SABOTAGE": "slow", "SLIPSTREAM_SABOTAGE_SLOW_S": "3"})
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frozen = _freeze_mid_transfer(out, launcher, time.monotonic() + 600)
        killed = time.monotonic()
        for proc in _vllm_tree(launcher.pid):
            os.kill(proc.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=800)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr[-3000:]}\n{_logs(out)}"
    metrics = _read(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, KILL_STEPS + 1))
    attempts = {m["step"]: m["weights/send_attempts"] for m in metrics}
    assert attempts[frozen] == 2, attempts
    assert f"sending the weights of step {frozen} failed" in (out / "logs" / "trainer.log").read_text()
    checks = [c for c in _read(out / "weight_checks.jsonl") if c["kind"] == "update"]
    assert all(c["passed"] for c in checks) and checks[-1]["step"] == KILL_STEPS, checks
    check_redone_after_restart(out, checks, frozen, stdout)
    if delta:  # the redone version goes whole to the new server (a new session); later ones as deltas
        sent = {m["step"]: m for m in metrics}
        assert sent[frozen]["weights/delta_full_version"] == 1.0, sent[frozen]
        print(f"delta ratios: { {s: round(m['weights/delta_ratio'], 4) for s, m in sent.items()} }")
    print(f"vLLM killed mid-transfer of step {frozen}: run finished {time.monotonic() - killed:.0f}s after the kill")


def test_delta_updates_over_nccl_load_exactly_and_repair_a_damaged_delta(tiny_model_factory, tmp_path):
    """tests/e2e/test_weight_delta.py on GPUs: versions 2 and 3 go as changed elements over NCCL (1 is the first,
    4 the every-third full one), each verified by the probe; one delta damaged inside vLLM's worker is caught by its
    checksum, never loaded, and sent again whole in the same update."""
    out = tmp_path / "run"
    config = _config(tiny_model_factory("qwen3"), out, 4)
    config["weights"] |= {"transport": "nccl", "bucket_mb": 1, "delta": {"enabled": True, "full_every": 3}}
    # a few % of the published elements change each step (the CPU test's float32 at 1e-10; here bf16 versions of float32
    # masters: at 1e-10 none change, and the damage, which needs a sparse bucket with changes, hit nothing on
    # 2 x H200; SmolLM2 at 1e-5 changed 1.9-3.0% a step there)
    config["trainer"]["optim"]["lr"] = 1e-5
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.delta_corrupt_ext.DamagedDelta"]
    proc = _run(config, tmp_path)
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
    metrics, _ = check_delta_run(out)
    for step in (2, 3):
        print(f"delta step {step}: {metrics[step]['weights/delta_ratio']:.4f} of the full bytes")


def test_lora_adapters_load_into_vllm_on_gpu(tiny_model_factory, tmp_path):
    out = tmp_path / "run"
    config = _config(tiny_model_factory("qwen3"), out, 3)
    config["model"]["lora"] = {"rank": 8, "alpha": 16.0, "name": "tiny-lora"}
    config["model"]["dtype"] = "bfloat16"  # vLLM's GPU LoRA kernels: float16/bfloat16 only
    config["trainer"]["optim"]["lr"] = float(os.environ.get("SLIPSTREAM_GPU_LORA_LR", "2e-2"))
    config["weights"]["keep_weights"] = 3  # every version's probe.json stays, for the report below
    proc = _run(config, tmp_path)
    checks = [c for c in _read(out / "weight_checks.jsonl") if c["kind"] == "update"]
    for check in checks:  # what inference served against what the trainer published, per token
        probe = out / "weights" / f"step_{check['step']}" / "probe.json"
        trainer = json.loads(probe.read_text())["logprobs"] if probe.exists() else None
        print(
            f"LoRA step {check['step']}: max diff {check['max_abs_diff']:.3g}, inference {check['inference_logprobs']}"
        )
        print(f"LoRA step {check['step']}: trainer {trainer}")
    assert proc.returncode == 0, f"{proc.stderr[-3000:]}\n{_logs(out)}"
    assert checks and all(c["passed"] for c in checks) and checks[-1]["step"] == 3, checks
    assert (out / "weights" / "step_3" / "adapter_model.safetensors").exists()
