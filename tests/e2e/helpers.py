"""Helpers for end-to-end runs: free ports, run configs, and finding every process a run started."""

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import httpx
import tomli_w

from slipstream.utils.net import free_port

MARKER_VAR = "SLIPSTREAM_TEST_RUN_ID"


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
        "launch": {"health_timeout_s": 300, "shutdown_grace_s": 5},
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


def write_config(path: Path, config: dict) -> Path:
    path.write_text(tomli_w.dumps(config))
    return path


def wait_healthy(server: subprocess.Popen, url: str, log_path) -> None:
    """Poll a server started by the test until /health answers 200 (5 min), failing with its log if it dies."""
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "server never became healthy"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)


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
