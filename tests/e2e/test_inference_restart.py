"""The vLLM server dies (SIGKILL) mid-run: `slipstream rl` restarts it, the orchestrator reloads and verifies the
served weights on it, and the run completes every step exactly once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import HEALTH_TIMEOUT_S, child_processes, processes_with_marker, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(HEALTH_TIMEOUT_S + 600)]
MAX_STEPS = 6
VLLM_SIGNATURE = "vllm.entrypoints.openai.api_server"


def _read_jsonl(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_killed_inference_is_restarted_and_the_run_loses_no_step(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    config = tiny_rl_config(
        tiny_qwen3_dir,
        out,
        max_steps=MAX_STEPS,
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
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + 200  # vLLM starts, then a step and its check run
        # kill once inference serves trained weights (version >= 1), so the restarted server must be given them
        while not any(c.get("passed") for c in _read_jsonl(out / "weight_checks.jsonl")):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "inference never served trained weights"
            time.sleep(0.2)
        servers = [pid for pid, cmd in child_processes(launcher.pid).items() if VLLM_SIGNATURE in cmd]
        assert len(servers) == 1, child_processes(launcher.pid)
        os.kill(servers[0], signal.SIGKILL)  # a process this test's launcher started
        steps_at_kill = len(_read_jsonl(out / "metrics.jsonl"))
        stdout, stderr = launcher.communicate(timeout=700)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert steps_at_kill < MAX_STEPS, "the kill came after the last step: nothing was tested"

    assert "inference was killed by signal 9" in stdout and "restart 1 of 2" in stdout, stdout
    assert "inference healthy again" in stdout, stdout
    assert "===== slipstream: inference restart 1 of 2 =====" in (out / "logs" / "inference.log").read_text()
    orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
    assert "inference unavailable" in orchestrator_log and "inference back after" in orchestrator_log

    metrics = _read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))  # every step, exactly once
    assert sum(m.get("inference/num_recoveries", 0) for m in metrics) == 1
    checks = [c for c in _read_jsonl(out / "weight_checks.jsonl") if c["kind"] == "update"]  # not the calibration
    assert all(c["passed"] for c in checks), checks
    after_restart = [c for c in checks if c["after_restart"]]
    assert len(after_restart) == 1 and after_restart[0]["step"] >= 1, checks
    assert checks[-1]["step"] == MAX_STEPS  # the run ends serving (and having verified) the final policy

    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"
