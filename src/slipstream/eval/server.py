"""A vLLM server owned by `slipstream eval`: started with Slipstream's flags, stopped with all its processes."""

import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slipstream.config.inference import InferenceConfig
from slipstream.inference.admin_token import ensure_admin_token
from slipstream.inference.options import setup_mooncake_config
from slipstream.inference.server import build_vllm_argv, build_vllm_env
from slipstream.inference.vllm_support import check_vllm
from slipstream.launch.plan import ProcessSpec
from slipstream.launch.supervisor import ChildFailed, Supervisor, tail

SEEDED_SAMPLING_ARGS = ["--no-enable-chunked-prefill"]
"""Added to the evaluation server's command line. vLLM (0.32, CPU build) kills its engine on a seeded request
whose prompt is prefilled in chunks: it rewinds the request's torch generator with `set_offset`, which CPU
generators lack ("CPU Generator does not use offset"). Without chunked prefill no prompt is split, and seeded
samples were also bit-identical whatever the batch composition (concurrency 8 vs 512)."""


def build_eval_server_argv(config: InferenceConfig, model_path: Path) -> list[str]:
    """Slipstream's vLLM command line plus SEEDED_SAMPLING_ARGS (unless `chunked_prefill` or `extra_args` set
    chunked prefill)."""
    argv = build_vllm_argv(config, model_path)
    if config.chunked_prefill is not None or any("chunked-prefill" in arg for arg in config.extra_args):
        return argv
    return argv + SEEDED_SAMPLING_ARGS


@contextmanager
def serve_model(config: InferenceConfig, model_path: Path, log_path: Path, timeout_s: float) -> Iterator[str]:
    """Run vLLM on `model_path` (served as `config.model.name`) until the block ends; yields its base URL.

    The server and every process below it are stopped on exit, including on errors, Ctrl-C and SIGTERM.
    """
    check_vllm()
    argv = build_eval_server_argv(config, model_path)
    ensure_admin_token()  # the server requires one; this process's InferenceClient sends it
    env = {**build_vllm_env(config, base={}), **setup_mooncake_config(config)}
    spec = ProcessSpec("inference", argv, log_path, env)
    sup = Supervisor()
    with _sigterm_as_interrupt():
        try:
            sup.start(spec)
            wait_until_healthy(sup, config.url, timeout_s, log_path)
            yield config.url
        finally:
            sup.stop_all()


def wait_until_healthy(sup: Supervisor, url: str, timeout_s: float, log_path: Path) -> None:
    """Poll {url}/health while watching the server process; errors name the log and show its end."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sup.check()
        except ChildFailed as e:
            raise RuntimeError(f"the vLLM server for evaluation failed: {e}; last lines:\n{tail(log_path)}") from e
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the vLLM server did not answer {url}/health within {timeout_s:.0f}s (log: {log_path}); "
                "raise health_timeout_s if the model is slow to load"
            )
        time.sleep(0.5)


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so `finally` blocks stop the server (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
