"""Weight updates on real vLLM: a load that silently does nothing (a frozen policy), drops a layer or swaps two is
caught by the calibrated probe verification and stops the run.

The three runs use one vLLM server in turn (tests/e2e/sabotage_ext.py reads each run's sabotage from a file), as runs
against a long-lived inference server do: each after the first finds the broken weights the one before it left and
loads the model's initial weights back before its first rollout, and its calibration (trainer and vLLM on the
initial weights: below 1e-4 in float32) shows they are exactly back."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from slipstream.inference.admin_token import admin_headers
from tests.e2e.helpers import processes_with_marker, shared_inference, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO_ROOT = Path(__file__).resolve().parents[2]
RELOAD_LINE = "not this run's initial ones: loading the initial weights from"


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


def _config(model_dir: Path, out: Path) -> dict:
    config = tiny_rl_config(model_dir, out, max_steps=3)
    del config["orchestrator"]["weight_check"]  # calibrated: judged against the floor, not a fixed bound
    # version 1 is loaded first (with max_async_level 1 the trainer may publish version 2 before it is, and the
    # floor is then measured at a later load): the calibration on the starting weights comes first
    config["orchestrator"]["max_async_level"] = 0
    config["inference"]["extra_args"] = ["--worker-extension-cls", "tests.e2e.sabotage_ext.FrozenWeightLoader"]
    return config


@pytest.fixture(scope="module")
def sabotage_server(tiny_qwen3_dir, tmp_path_factory):
    """One vLLM server with the sabotage extension; `mode_file` holds the sabotage of the run using it."""
    root = tmp_path_factory.mktemp("sabotage_server")
    mode_file = root / "sabotage"
    mode_file.write_text("none")
    env = {"PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}", "SLIPSTREAM_SABOTAGE_FILE": str(mode_file)}
    with shared_inference(_config(tiny_qwen3_dir, root / "unused"), root, env) as server:
        yield server, mode_file


@pytest.mark.parametrize("sabotage", ["frozen", "skip_layer", "swap_layers"])
def test_a_broken_load_stops_the_run(sabotage, sabotage_server, tiny_qwen3_dir, tmp_path, run_env):
    """A load that does nothing, one that drops a layer, one that swaps two layers: each stops the run
    (tests/e2e/sabotage_ext.py). The dropped layer is caught by the engine (tensors received that never reached the
    model: weights/receive/receiver.check_loaded) before any probe; the others by the calibrated check (the floor
    measured before the first load)."""
    server, mode_file = sabotage_server
    marker, env = run_env
    out = tmp_path / "run"
    mode_file.write_text(sabotage)
    served = httpx.get(f"{server.url}/weight_info", headers=admin_headers(server.token), timeout=10).json()
    config = server.run_config(_config(tiny_qwen3_dir, out))
    proc = _run(write_config(tmp_path / "rl.toml", config), server.env(env), timeout=600)
    assert proc.returncode != 0
    assert "orchestrator exited with code 1" in proc.stderr, proc.stderr
    # a server another run loaded weights into is brought back to the initial weights first, and only then
    reloaded = RELOAD_LINE in (out / "logs" / "orchestrator.log").read_text()
    assert reloaded == (served["weight_version"] != "default"), served
    if sabotage == "skip_layer":
        assert "weight update to step 1 did not load whole on inference" in proc.stderr, proc.stderr
        assert "model.layers.1." in proc.stderr and "never reached the model's loader" in proc.stderr, proc.stderr
        records = [json.loads(line) for line in (out / "weight_checks.jsonl").read_text().splitlines()]
        assert [c["kind"] for c in records] == ["calibration"]  # stopped before any probe of the load
        assert records[0]["max_abs_diff"] < 1e-4  # on the initial weights (loaded back after the run before)
        assert _wait_gone(marker) == []
        return
    assert "did not take effect on inference (policy frozen or corrupted)" in proc.stderr
    calibration, check = [json.loads(line) for line in (out / "weight_checks.jsonl").read_text().splitlines()]
    assert calibration["kind"] == "calibration" and calibration["step"] == 0
    assert calibration["max_abs_diff"] < 1e-4  # float32: trainer and vLLM agree on identical weights
    assert check["kind"] == "update" and check["step"] == 1 and not check["passed"]
    assert check["max_abs_diff"] > check["allowed"] == 1e-3  # float32's tolerance: above 3 x the floor
    assert _wait_gone(marker) == []
