"""Killing the inference server (with restarts off) makes `slipstream rl` exit non-zero within 30 s, naming it,
leaving nothing. The other children are covered elsewhere: test_resume.py kills the orchestrator and a trainer rank
through real vLLM (the same checks, then `--resume`), benchmarks/chaos.py (tests/e2e/test_chaos.py) the torchrun
agent, and test_inference_restart.py a restarted inference server."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import HEALTH_TIMEOUT_S, child_processes, processes_with_marker, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(HEALTH_TIMEOUT_S + 300)]

# how each direct child of the launcher is recognised in its command line
CHILD_SIGNATURE = {
    "inference": "vllm.entrypoints.openai.api_server",
    "trainer": "config/trainer.toml",
    "orchestrator": "config/orchestrator.toml",
}


@pytest.mark.parametrize("victim", ["inference"])
def test_killing_a_child_stops_the_run_and_names_it(victim, tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    out = tmp_path / "run"
    launch = {"inference_restarts": 0} if victim == "inference" else {}
    cfg = write_config(tmp_path / "rl.toml", tiny_rl_config(tiny_qwen3_dir, out, max_steps=200, launch=launch))
    launcher = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + HEALTH_TIMEOUT_S + 100  # vLLM starts, then a step runs
        while not (out / "metrics.jsonl").exists():  # all three children are up and a step has run
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the run never reached its first step"
            time.sleep(0.5)
        pids = [p for p, cmd in child_processes(launcher.pid).items() if CHILD_SIGNATURE[victim] in cmd]
        assert len(pids) == 1, child_processes(launcher.pid)
        os.kill(pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=60)
        assert time.monotonic() - killed_at < 30
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0
    assert f"{victim} was killed by signal 9" in stderr, stderr
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == []
