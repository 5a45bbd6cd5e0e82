"""The real vLLM server started by `slipstream inference` rejects admin calls without the run's token."""

import os
import subprocess
import sys

import httpx
import pytest

from slipstream.inference.admin_token import HEADER, TOKEN_ENV
from tests.e2e.helpers import free_port, wait_healthy

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


def test_admin_endpoints_need_the_token(tiny_qwen3_dir, tmp_path):
    port, token = free_port(), "e2e-secret"
    argv = [sys.executable, "-m", "slipstream", "inference", "--model.name", str(tiny_qwen3_dir), "--port", str(port)]
    argv += ["--max_model_len", "256", "--max_num_seqs", "4"]
    with open(tmp_path / "inference.log", "wb") as log:
        server = subprocess.Popen(argv, env={**os.environ, TOKEN_ENV: token}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, tmp_path / "inference.log")
        for path in ("/pause", "/resume", "/collective_rpc", "/reset_prefix_cache"):
            assert httpx.post(f"{url}{path}", timeout=10).status_code == 401, path
            assert httpx.post(f"{url}{path}", headers={HEADER: "wrong"}, timeout=10).status_code == 401, path
        good = {HEADER: token}
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=good, timeout=30).status_code == 200
        assert httpx.get(f"{url}/is_paused", headers=good, timeout=10).json() == {"is_paused": True}
        assert httpx.post(f"{url}/resume", headers=good, timeout=30).status_code == 200
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 200  # inference routes stay open
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
