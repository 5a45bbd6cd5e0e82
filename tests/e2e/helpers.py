"""Helpers for end-to-end runs: free ports, run configs, finding every process a run started, and vLLM servers that
several runs share."""

import contextlib
import copy
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import tomli_w

from slipstream.config import RLConfig
from slipstream.inference.admin_token import TOKEN_ENV, admin_headers
from slipstream.utils.net import free_port

MARKER_VAR = "SLIPSTREAM_TEST_RUN_ID"
HEALTH_TIMEOUT_VAR = "SLIPSTREAM_TEST_HEALTH_TIMEOUT_S"


def health_timeout_s(environ: dict[str, str] = os.environ) -> float:
    """How long a test waits for a server it starts (vLLM above all) to answer /health: the seconds in
    $SLIPSTREAM_TEST_HEALTH_TIMEOUT_S, else the product's default (launch.health_timeout_s). vLLM's CPU build loads
    the tiny models much more slowly beside the other pytest-xdist worker and someone's training run than on a quiet
    machine, so no test guesses a lower figure of its own; a slower host raises the variable."""
    value = environ.get(HEALTH_TIMEOUT_VAR)
    if value is None:
        return DEFAULT_HEALTH_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 1e6:
        raise ValueError(f"{HEALTH_TIMEOUT_VAR}={value!r}: give the seconds to wait for a server's /health, e.g. 900")
    return seconds


DEFAULT_HEALTH_TIMEOUT_S = RLConfig.model_fields["launch"].default.health_timeout_s
HEALTH_TIMEOUT_S = health_timeout_s()
"""Read once per session: configs' health timeouts and the deadlines that include a server's start-up add to it."""


def processes_with_marker(marker: str, var: str = MARKER_VAR) -> list[int]:
    """PIDs of live processes whose environment sets `var` to `marker` (every descendant of a run inherits it)."""
    needle = f"{var}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def child_processes(pid: int) -> dict[int, str]:
    """pid -> command line of the live direct children of `pid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def tiny_rl_config(model_dir: Path, output_dir: Path, max_steps: int, **sections) -> dict:
    """A small, fast RL config for a tiny random model on CPU."""
    config = {
        "max_steps": max_steps,
        "output_dir": str(output_dir),
        "seed": 7,
        "model": {"name": str(model_dir)},
        "inference": {"port": free_port(), "max_model_len": 512, "max_num_seqs": 16, "cpu_kv_cache_gib": 1},
        "orchestrator": {
            "batch_size": 8,
            "group_size": 4,
            "micro_batch_tokens": 512,
            "sampling": {"temperature": 1.0, "max_tokens": 12},
            "env": {"name": "reverse_text", "args": {"num_tasks": 64}},
            "weight_check": {"max_abs_diff": 1e-3},
        },
        "trainer": {"optim": {"lr": 3e-3, "max_grad_norm": 10.0}, "num_threads": 1},
        "launch": {"health_timeout_s": HEALTH_TIMEOUT_S, "shutdown_grace_s": 5},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(tomli_w.dumps(config))
    return path


def wait_healthy(server: subprocess.Popen, url: str, log_path: Path, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    """Poll a server started by the test until /health answers 200, failing with the end of its log if it exits or
    has not answered within `timeout_s`."""
    start = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise AssertionError(
                f"{url}: the server exited with {server.returncode}; {log_path} ends:\n{_tail(log_path)}"
            )
        if (waited := time.monotonic() - start) > timeout_s:
            raise AssertionError(
                f"{url} did not answer /health in {waited:.0f} s (a loaded host may need more: {HEALTH_TIMEOUT_VAR}); "
                f"{log_path} ends:\n{_tail(log_path)}"
            )
        time.sleep(0.25)


def _tail(path: Path, num_chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else "(no log)"


@contextlib.contextmanager
def running_server(argv: list[str], url: str, log_path, env: dict | None = None):
    """The server `argv` starts, for the duration of the block, healthy at `url` before it starts, logging to
    `log_path`; terminated at the end (killed if it has not stopped within 30 s)."""
    with open(log_path, "w") as log:
        server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, url, log_path)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def running_sim(port: int, log_path, *args: str, env: dict | None = None):
    """The simulated inference server (`python -m slipstream_sim --port PORT ARGS`) for the duration of
    the block, healthy before it starts, logging to `log_path`."""
    argv = [sys.executable, "-m", "slipstream_sim", "--port", str(port), *args]
    return running_server(argv, f"http://127.0.0.1:{port}", log_path, env)


RESUME_MAX_STEPS = 4


def resume_config(model_dir: Path, output_dir: Path) -> dict:
    """The run that resume tests interrupt: synchronous (max_async_level = 0) with seeded requests, so batch contents
    do not depend on timing and a resumed run must end with the weights of an uninterrupted one."""
    return tiny_rl_config(
        model_dir,
        output_dir,
        max_steps=RESUME_MAX_STEPS,
        orchestrator={"max_async_level": 0, "seed_requests": True},
        checkpoint={"interval": 1, "keep_last": 1, "keep_every": 2},
    )


TOOL_CALL_PARSER = "hermes"
"""The session server's tool-call parser (tests/e2e/conftest.py's tiny_inference; vLLM's hermes parser, which reads
the tool calls Qwen3's chat template asks for)."""


@dataclass(frozen=True)
class SharedInference:
    """One vLLM server that several `slipstream rl` runs of the same model and inference flags use in turn, each run
    starting only its trainer and orchestrator (deployment.run), as runs against a long-lived inference server do:
    each finds the weights the run before it left and loads its initial ones back (orchestrator/weights.py)."""

    url: str
    token: str
    log: Path
    """The server's log (the inference process's output)."""

    def run_config(self, config: dict) -> dict:
        """`config` (one of this server's flags) as a run that uses this server instead of starting its own."""
        config = copy.deepcopy(config)
        config["deployment"] = {**config.get("deployment", {}), "run": ["trainer", "orchestrator"]}
        config["weights"] = {**config.get("weights", {}), "transport": "filesystem"}  # what "auto" is on CPU
        config["orchestrator"]["inference_url"] = self.url
        return config

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """A run's environment with this server's admin token."""
        return {**env, TOKEN_ENV: self.token}


@contextlib.contextmanager
def shared_inference(config: dict, root: Path, env: dict[str, str] | None = None) -> Iterator[SharedInference]:
    """The inference server of run config `config` (its model, its inference flags), started by `slipstream rl` with
    deployment.run = ["inference"] on a port of its own (with `env` added to its environment), for the duration of
    the block; then stopped as a user stops it (SIGTERM to the launcher), leaving no process behind."""
    config = copy.deepcopy(config)
    port = free_port()
    config["inference"] = {**config["inference"], "port": port}
    config |= {"output_dir": str(root / "inference"), "deployment": {"run": ["inference"]}}
    config["weights"] = {**config.get("weights", {}), "transport": "filesystem"}
    cfg = write_config(root / "inference.toml", config)
    marker, token = uuid.uuid4().hex, secrets.token_urlsafe(32)
    env = {**os.environ, **(env or {}), MARKER_VAR: marker, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}
    url, log_path = f"http://127.0.0.1:{port}", root / "inference_launcher.log"
    with running_server([sys.executable, "-m", "slipstream", "rl", "-c", str(cfg)], url, log_path, env) as launcher:
        # ours, not another worker's on the same port: it takes this server's admin token
        reply = httpx.get(f"{url}/weight_info", headers=admin_headers(token), timeout=10)
        assert reply.status_code == 200 and reply.json() == {"weight_version": "default"}, reply.text
        yield SharedInference(url, token, root / "inference" / "logs" / "inference.log")
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the shared inference server"
