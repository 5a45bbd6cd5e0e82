"""Weight updates on real vLLM: a load that silently does nothing (a frozen policy) is caught by the probe
verification and stops the run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import processes_with_marker, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(config_path: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _wait_gone(marker: str) -> list[int]:
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    return processes_with_marker(marker)


def test_a_load_that_does_nothing_stops_the_run(tiny_qwen3_dir, tmp_path, run_env):
    marker, env = run_env
    env = {**env, "PYTHONPATH": f"{REPO_ROOT}:{env.get('PYTHONPATH', '')}"}
    out = tmp_path / "run"
    config = tiny_rl_config(tiny_qwen3_dir, out, max_steps=4)
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.sabotage_ext.FrozenWeightLoader"]
    proc = _run(write_config(tmp_path / "rl.toml", config), env, timeout=600)
    assert proc.returncode != 0
    assert "orchestrator exited with code 1" in proc.stderr, proc.stderr
    assert "did not take effect on inference (policy frozen or corrupted)" in proc.stderr
    check = json.loads((out / "weight_checks.jsonl").read_text().splitlines()[0])
    assert not check["passed"] and check["max_abs_diff"] > 1e-3
    assert _wait_gone(marker) == []
