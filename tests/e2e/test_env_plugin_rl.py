"""An environment from outside Slipstream trains through real vLLM (CPU build): `slipstream env init` writes the
package, pip installs it into a folder on PYTHONPATH, and `slipstream rl` names it by its entry point for 2 steps.
Naming it by import path (`word_echo.env:load_environment`) resolves through the same loader: tests/unit/test_env_plugins.py.
The run uses the session's tiny vLLM server (tests/e2e/conftest.py's tiny_inference)."""

import json
import subprocess
import sys

import pytest

from tests.e2e.helpers import tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


@pytest.mark.parametrize("env_name", ["word-echo"])
def test_rl_trains_on_an_installed_environment_package(env_name, tiny_inference, tiny_qwen3_dir, tmp_path, run_env):
    _, env = run_env
    subprocess.run([sys.executable, "-m", "slipstream", "env", "init", "word-echo", "--dir", str(tmp_path)], check=True)
    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site)]
    subprocess.run([*pip, str(tmp_path / "word-echo")], check=True, capture_output=True)
    out = tmp_path / "run"
    config = tiny_inference.run_config(tiny_rl_config(tiny_qwen3_dir, out, max_steps=2))
    config["orchestrator"]["env"] = {"name": env_name, "args": {"num_tasks": 32}}
    cfg = write_config(tmp_path / "rl.toml", config)
    # before, not instead of, the PYTHONPATH the tests run with (the checkout under test may be on it)
    env = tiny_inference.env({**env, "PYTHONPATH": f"{site}:{env.get('PYTHONPATH', '')}"})
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)], env=env, capture_output=True, text=True, timeout=840
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)
    # the orchestrator ran the package's environment (its tasks, not a built-in's)
    assert f"environment 'word-echo' ({env_name}): 32 train tasks" in (out / "logs" / "orchestrator.log").read_text()
