"""A verifiers environment (written here, no network) runs in its own env server process and trains through real
vLLM (CPU build); SIGKILL of that process while a rollout is inside it fails only its rollouts (counted), then the
run goes on with a restarted server (`orchestrator.env.server.on_crash = "restart"`). The "stop" setting is exercised
through the orchestrator with a real env server in tests/unit/test_env_server.py (test_a_crash_stops_the_run_when_configured):
a second real-vLLM run here would add a minute to the suite for the same code path. The run uses the session's tiny
vLLM server (tests/e2e/conftest.py's tiny_inference)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import processes_with_marker, tiny_rl_config, write_config

pytest.importorskip("verifiers.v1", reason="optional extra `verifiers` is not installed")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HOLD_AT_CALL = 9
"""The env server's 9th reward call (a rollout after the first batch's 8) waits inside the server until killed."""

TASKSET = f"""
import asyncio
import os
from pathlib import Path

import verifiers.v1 as vf

GATE = Path(os.environ["SLIPSTREAM_TEST_GATE"])
CALLS = [0]


class WordData(vf.TaskData):
    answer: str = ""


class WordTask(vf.Task[WordData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def overlap(self, task, trace) -> float:
        CALLS[0] += 1
        if CALLS[0] == {HOLD_AT_CALL} and not (GATE / "held").exists():
            (GATE / "held").write_text(str(os.getpid()))
            await asyncio.sleep(600)  # in flight until the test kills this process
        reply = trace.last_reply or ""
        return sum(c in reply for c in task.answer) / len(task.answer)


class WordTaskset(vf.Taskset[WordTask, vf.TasksetConfig]):
    def load(self):
        for i in range(32):
            word = f"word{{i}}"
            yield WordTask(WordData(prompt=f"Repeat: {{word}}", answer=word))


__all__ = ["WordTaskset"]
"""


def env_server_pids(marker: str) -> list[int]:
    pids = []
    for pid in processes_with_marker(marker):
        try:
            if b"slipstream.envs.server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
        except FileNotFoundError:
            continue
    return pids


def wait_for(predicate, proc: subprocess.Popen, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert proc.poll() is None, f"the run ended (code {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_verifiers_env_server_trains_and_survives_its_crash(tiny_inference, tiny_qwen3_dir, tmp_path, run_env):
    on_crash = "restart"
    marker, env = run_env
    (tmp_path / "word_taskset.py").write_text(TASKSET)
    gate = tmp_path / "gate"
    gate.mkdir()
    pythonpath = f"{tmp_path}:{env.get('PYTHONPATH', '')}"  # the checkout under test may be on it
    env = tiny_inference.env({**env, "PYTHONPATH": pythonpath, "SLIPSTREAM_TEST_GATE": str(gate)})
    out = tmp_path / "run"
    config = tiny_inference.run_config(tiny_rl_config(tiny_qwen3_dir, out, max_steps=3))
    config["orchestrator"]["env"] = {
        "name": "verifiers",
        "args": {"taskset": "word_taskset"},
        "server": {"on_crash": on_crash, "max_restarts": 1},
    }
    cfg = write_config(tmp_path / "rl.toml", config)
    argv = [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)]
    with open(tmp_path / "stdout.txt", "w") as console:
        proc = subprocess.Popen(argv, env=env, stdout=console, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (gate / "held").exists(), proc, "a rollout inside the env server")
        (server,) = env_server_pids(marker)
        assert server == int((gate / "held").read_text()) and server != proc.pid  # its own process
        os.kill(server, signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout = (tmp_path / "stdout.txt").read_text()
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "environment 'verifiers' (verifiers): 32 train tasks" in log
    assert f"env server of 'verifiers' (pid {server}) was killed by SIGKILL" in log
    assert proc.returncode == 0, f"stdout:\n{stdout}\norchestrator log:\n{log[-5000:]}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)
    last = metrics[-1]
    assert last["env_server/crashes"] == 1 and last["env_server/restarts"] == 1
    assert last["env_server/lost_rollouts"] >= 1 and last["pipeline/failed_rollouts"] >= 1
    assert len(env_server_pids(marker)) == 0  # the restarted server ended with the run
