"""Multi-tenant LoRA end to end through real vLLM (CPU build): one `slipstream tenant-server` (vLLM with --max-loras 2
and the multi-tenant trainer) serves two `slipstream tenant-run`s on one tiny base model. Tenant A's orchestrator is
killed after its first checkpoint and resumes; tenant B trains every step once with every adapter load verified by
the probe, and replaying B's recorded batches through a one-run trainer gives B's adapter exactly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.tenants import TenantConfig, TenantServerConfig, tenant_trainer_config
from slipstream.rundir import RunDir
from slipstream.trainer.rl import run_trainer
from slipstream.transport.tenants import read_status
from slipstream.weights.send.lora_export import ADAPTER_WEIGHTS
from tests.e2e.helpers import HEALTH_TIMEOUT_S, free_port, processes_with_marker, tiny_rl_config, write_config
from tests.e2e.test_rl_tiny import LOGPROB_TOLERANCE, _read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(HEALTH_TIMEOUT_S + 600)]

LORA = {"rank": 8, "alpha": 16.0, "max_loras": 2}
STEPS = 3


def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "slipstream", *args], env=env, stdout=f, stderr=subprocess.STDOUT
        )


def _tenant_run(tmp_path, model_dir, root, port, name, seed, env, resume=False) -> subprocess.Popen:
    orchestrator = tiny_rl_config(model_dir, root, STEPS)["orchestrator"]
    orchestrator |= {"inference_url": f"http://127.0.0.1:{port}", "batch_size": 4, "group_size": 2}
    orchestrator["max_async_level"] = 0  # synchronous: every step's adapter is loaded and verified before the next
    tenant = {"name": name, "max_steps": STEPS, "seed": seed, "checkpoint": {"interval": 1}}
    tenant["optim"] = {"lr": 2e-2, "max_grad_norm": 10.0}
    config = {"model": {"name": str(model_dir), "lora": LORA}, "tenants_dir": str(root), "tenant": tenant}
    cfg = write_config(tmp_path / f"{name}.toml", config | {"orchestrator": orchestrator})
    args = ["tenant-run", "-c", str(cfg)] + (["--resume", "true"] if resume else [])
    return _start(args, env, tmp_path / "logs" / f"{name}{'_resumed' if resume else ''}.log")


def _wait(predicate, what: str, timeout_s: float, procs: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for name, proc in procs.items():
            if proc.poll() is not None and proc.returncode != 0:
                text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.parent.rglob("*.log")))
                raise AssertionError(f"{name} exited with {proc.returncode} while waiting for {what}\n{text}")
        if time.monotonic() > deadline:
            text = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.parent.rglob("*.log")))
            raise AssertionError(f"timed out waiting for {what}\n{text}")
        time.sleep(0.1)


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_tenants_share_one_trainer_and_vllm(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    root, logs, port = tmp_path / "tenants", tmp_path / "logs", free_port()
    server = {
        "model": {"name": str(tiny_qwen3_dir), "lora": LORA},
        "tenants_dir": str(root),
        "inference": {"port": port, "seed": 7, "max_model_len": 512, "max_num_seqs": 16, "cpu_kv_cache_gib": 1},
        "trainer": {"max_tenants": 2, "device": "cpu", "num_threads": 1},
        "health_timeout_s": HEALTH_TIMEOUT_S,
        "shutdown_grace_s": 5,
    }
    server_cfg = write_config(tmp_path / "server.toml", server)
    # The tenants take the admin token from <tenants_dir>/admin_token, written by the server.
    procs = {"server": _start(["tenant-server", "-c", str(server_cfg)], env, logs / "server.log")}
    try:
        _wait(lambda: _healthy(port), "vLLM /health", HEALTH_TIMEOUT_S, procs, logs)
        procs["a"] = _tenant_run(tmp_path, tiny_qwen3_dir, root, port, "a", 1, env)
        procs["b"] = _tenant_run(tmp_path, tiny_qwen3_dir, root, port, "b", 2, env)
        a_dir, b_dir = root / "a", root / "b"
        _wait(lambda: RunDir(a_dir).checkpoint_marker(1).exists(), "A's checkpoint of step 1", 300, procs, logs)
        procs["a"].send_signal(signal.SIGKILL)  # tenant A's orchestrator dies mid-run
        procs["a"].wait()
        del procs["a"]
        procs["a"] = _tenant_run(tmp_path, tiny_qwen3_dir, root, port, "a", 1, env, resume=True)
        for name in ("a", "b"):
            _wait(lambda n=name: procs[n].poll() == 0, f"tenant {name} to finish", 300, procs, logs)
        _wait(lambda: read_status(a_dir)["state"] == "done", "A done", 60, procs, logs)
        assert read_status(b_dir)["state"] == "done"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    assert procs["server"].returncode == 0, (logs / "server.log").read_text()
    trainer_log = RunDir(root).log_path("tenant-trainer").read_text()
    for name in ("a", "b"):
        run = root / name
        assert [m["step"] for m in _read_jsonl(RunDir(run).metrics_path)] == list(range(1, STEPS + 1)), name
        checks = _read_jsonl(RunDir(run).weight_checks_path)
        assert {c["step"] for c in checks} >= set(range(1, STEPS)), (name, checks)
        assert all(c["passed"] and c["max_abs_diff"] <= LOGPROB_TOLERANCE for c in checks), (name, checks)
    for step in range(1, STEPS + 1):  # B trained every step exactly once, A's death notwithstanding
        assert trainer_log.count(f"] b step {step}/{STEPS} ") == 1, trainer_log
    resumed = (logs / "a_resumed.log").read_text()
    assert "tenant a left" in trainer_log and "resuming after step" in resumed, resumed
    resumed_step = int(resumed.split("resuming after step ")[1].split(")")[0])
    assert 1 <= resumed_step < STEPS and f"tenant a joined at step {resumed_step} " in trainer_log, trainer_log

    # B's recorded batches alone through a one-run trainer (`slipstream trainer`'s loop) give B's adapter exactly.
    replay = tmp_path / "replay"
    for step in range(1, STEPS + 1):
        batch = RunDir(b_dir).batch_path(step, 0)
        RunDir(replay).batch_path(step, 0).parent.mkdir(parents=True)
        RunDir(replay).batch_path(step, 0).write_bytes(batch.read_bytes())
    shared = TenantServerConfig.model_validate(server).trainer
    tenant = TenantConfig(name="b", max_steps=STEPS, seed=2, optim={"lr": 2e-2, "max_grad_norm": 10.0})
    run_trainer(tenant_trainer_config(shared, tenant, replay))  # in-process: `slipstream trainer` minus the import
    got = load_file(RunDir(b_dir).weights_dir(STEPS) / ADAPTER_WEIGHTS)
    want = load_file(RunDir(replay).weights_dir(STEPS) / ADAPTER_WEIGHTS)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert json.loads((b_dir / "tenant_status.json").read_text())["step"] == STEPS
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind"
