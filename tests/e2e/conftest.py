"""Fixtures for end-to-end runs."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.helpers import MARKER_VAR, resume_config, write_config


@pytest.fixture
def run_env():
    """Environment for a launcher subprocess, tagged so the test can find all its descendants."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_VAR: marker, "PYTHONUNBUFFERED": "1"}
    return marker, env


@pytest.fixture(scope="session")
def resume_reference(tiny_qwen3_dir, tmp_path_factory) -> Path:
    """Run directory of an uninterrupted run of `resume_config`, shared by the tests that interrupt and resume it."""
    root = tmp_path_factory.mktemp("reference")
    out = root / "run"
    cfg = write_config(root / "rl.toml", resume_config(tiny_qwen3_dir, out))
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return out
