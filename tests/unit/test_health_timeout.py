"""tests/e2e/helpers.py: how long the end-to-end tests wait for a server's /health, and what they say when it never
answers."""

import subprocess
import sys

import pytest

from slipstream.utils.net import free_port
from tests.e2e.helpers import DEFAULT_HEALTH_TIMEOUT_S, HEALTH_TIMEOUT_VAR, health_timeout_s, wait_healthy


def test_the_wait_is_the_product_default_unless_the_environment_sets_it():
    assert health_timeout_s({}) == DEFAULT_HEALTH_TIMEOUT_S == 600
    assert health_timeout_s({HEALTH_TIMEOUT_VAR: "900"}) == 900
    for bad in ("soon", "0", "-5"):
        with pytest.raises(ValueError, match=HEALTH_TIMEOUT_VAR):
            health_timeout_s({HEALTH_TIMEOUT_VAR: bad})


def test_a_server_that_never_answers_fails_naming_the_wait_and_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("still loading the model\n")
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(
            AssertionError, match=rf"(?s)did not answer /health in \d+ s .*{HEALTH_TIMEOUT_VAR}.*still loading"
        ):
            wait_healthy(server, f"http://127.0.0.1:{free_port()}", log, timeout_s=0.5)
    finally:
        server.kill()
        server.wait()


def test_a_server_that_exits_fails_at_once_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("error: no such model\n")
    server = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    server.wait()
    with pytest.raises(AssertionError, match=r"(?s)exited with 3.*no such model"):
        wait_healthy(server, f"http://127.0.0.1:{free_port()}", log, timeout_s=60)
