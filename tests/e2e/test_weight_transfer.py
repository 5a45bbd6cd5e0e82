"""Weights by broadcast through vLLM's weight-transfer API on the real vLLM CPU build (gloo: the CPU twin of NCCL):
a tiny model trains with `weights.transport = "gloo"`, every version is received by Slipstream's engine inside vLLM and
verified by the probe, as exactly as through files; vLLM killed in the middle of a transfer is restarted, the
transfer is redone for the new server, verified, and no step is lost."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from slipstream.weights.wire.offers import ACCEPT, DELIVERED
from slipstream.weights.wire.published import READY, weights_dir
from tests.e2e.helpers import (
    HEALTH_TIMEOUT_S,
    child_processes,
    free_port,
    processes_with_marker,
    tiny_rl_config,
    write_config,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(HEALTH_TIMEOUT_S + 600)]
MAX_STEPS = 6
VLLM_SIGNATURE = "vllm.entrypoints.openai.api_server"


def _read_jsonl(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _vllm_tree(launcher_pid: int) -> list[psutil.Process]:
    """The vLLM API server this test's launcher started, and its descendants (engine core, worker)."""
    servers = [pid for pid, cmd in child_processes(launcher_pid).items() if VLLM_SIGNATURE in cmd]
    assert len(servers) == 1, child_processes(launcher_pid)
    server = psutil.Process(servers[0])
    return [server, *server.children(recursive=True)]


def _freeze_mid_transfer(out, launcher: subprocess.Popen, deadline: float) -> int:
    """Wait for a transfer (an ACCEPTed version >= 2) and freeze vLLM (SIGSTOP) while it is under way, i.e. before
    the trainer marks it DELIVERED; return the version. A transfer that ends before the freeze lands is let go."""
    tried: set[int] = set()
    while True:
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, "no transfer could be caught in flight"
        for step in range(2, MAX_STEPS):
            folder = weights_dir(out, step)
            if step in tried or not (folder / ACCEPT).exists():
                continue
            tree = _vllm_tree(launcher.pid)
            for proc in tree:
                proc.send_signal(signal.SIGSTOP)  # processes this test's launcher started
            tried.add(step)
            time.sleep(1.0)  # the trainer would have finished the tiny transfer by now, were vLLM running
            if not (folder / DELIVERED).exists():
                return step
            for proc in tree:
                proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)


def check_redone_after_restart(out, checks: list[dict], frozen: int, stdout: str) -> None:
    """The version frozen mid-transfer was sent again and verified on the restarted server. A recovery interrupted
    after the trainer delivered it (the new server lost too, or its reply failed, or the run's end stopped the
    recovery and the final load found the server mid-receive and recovered again: the orchestrator logs each) rightly
    goes on to the next version the trainer offers; the message names the recovery's and the launcher's lines."""
    orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
    recovery = [line for line in orchestrator_log.splitlines() if "inference" in line and "WARNING" in line]
    restarts = [line for line in stdout.splitlines() if "restart" in line or "healthy again" in line]
    after_restart = [c["step"] for c in checks if c["after_restart"]]
    lost_again = orchestrator_log.count("inference lost again while re-establishing its weights")
    recoveries = orchestrator_log.count("WARNING [orchestrator] inference unavailable")
    why = f"after-restart checks {after_restart}, frozen {frozen}; orchestrator: {recovery}; launcher: {restarts}"
    assert after_restart and after_restart[0] >= frozen, why
    assert after_restart == [frozen] or lost_again >= 1 or recoveries >= 2, why


def test_gloo_transfer_through_vllm_survives_a_kill_mid_transfer(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(
        tiny_qwen3_dir,
        out,
        max_steps=MAX_STEPS,
        weights={"transport": "gloo", "master_port": free_port(), "bucket_mb": 1, "receive_buffers": 3},
        launch={"inference_restarts": 2, "inference_restart_backoff_s": 0.5},
        orchestrator={"recovery": {"timeout_s": 400, "backoff_max_s": 2}},
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(write_config(tmp_path / "rl.toml", config))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        frozen = _freeze_mid_transfer(out, launcher, time.monotonic() + HEALTH_TIMEOUT_S + 200)
        for proc in _vllm_tree(launcher.pid):
            os.kill(proc.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate(timeout=700)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert "restart 1 of 2" in stdout and "inference healthy again" in stdout, stdout

    metrics = _read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))  # every step, exactly once
    attempts = {m["step"]: m["weights/send_attempts"] for m in metrics}
    assert attempts[frozen] == 2 and all(a == 1 for s, a in attempts.items() if s != frozen), attempts
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert f"sending the weights of step {frozen} failed" in trainer_log
    # each worker received into 3 bucket buffers (weights.receive_buffers), before the kill and after the restart
    assert (out / "logs" / "inference.log").read_text().count("(gloo, 3 receive buffers)") >= 2

    checks = [c for c in _read_jsonl(out / "weight_checks.jsonl") if c["kind"] == "update"]  # not the calibration
    assert all(c["passed"] for c in checks), checks
    # as exact as through files (test_rl_tiny: float32 on both sides): far inside the 1e-3 tolerance
    assert max(c["max_abs_diff"] for c in checks) < 1e-4, checks
    check_redone_after_restart(out, checks, frozen, stdout)
    assert checks[-1]["step"] == MAX_STEPS
    # versions that came by broadcast only are not on disk; the last one is
    assert not (weights_dir(out, frozen) / READY).exists() and (weights_dir(out, MAX_STEPS) / READY).exists()

    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"
