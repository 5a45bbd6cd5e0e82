"""`slipstream inference` refuses to start without an admin token. That the real vLLM server it starts rejects admin
calls without the run's token is test_admin_endpoints_need_the_token in test_inflight_update.py, which shares that
module's server."""

import os
import subprocess
import sys

import pytest

from slipstream.inference.admin_token import TOKEN_ENV

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def test_inference_refuses_to_start_without_a_token(tiny_qwen3_dir):
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "inference", "--model.name", str(tiny_qwen3_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and f"set {TOKEN_ENV}" in proc.stderr
