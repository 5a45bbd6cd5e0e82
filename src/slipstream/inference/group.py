"""`slipstream inference` for a deployment of several engines on this node (inference.deployment): start each vLLM
engine on its share of the node's GPUs and, on the head node, the vllm-router in front of them; stop them all when
one exits or on SIGTERM/SIGINT. Each child dies with this process (PR_SET_PDEATHSIG), so none outlives it."""

import ctypes
import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from slipstream.config.inference import InferenceConfig
from slipstream.inference.deployment import engine_commands, router_argv
from slipstream.inference.options import setup_mooncake_config
from slipstream.inference.server import build_vllm_env

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def split_gpus(visible: list[str], counts: list[int]) -> list[list[str]]:
    """Consecutive slices of this node's inference GPUs, one per engine; ValueError when they do not add up."""
    if sum(counts) != len(visible):
        raise ValueError(
            f"the engines of this node need {sum(counts)} GPUs ({counts}), but inference got {len(visible)} "
            f"({','.join(visible)}); change deployment.inference_gpus, inference.deployment.num_replicas or the "
            "parallel sizes"
        )
    slices, start = [], 0
    for n in counts:
        slices.append(visible[start : start + n])
        start += n
    return slices


def run_inference_group(config: InferenceConfig, model_path: Path) -> int:
    """Start this node's engines (and the router on the head); return the exit code of the first child to end."""
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
    on_gpu = config.device == "cuda" or (config.device == "auto" and bool(visible))
    commands = engine_commands(config, model_path, config.deployment.node_rank, on_gpu)
    slices = split_gpus(visible, [c.num_gpus for c in commands]) if on_gpu else [None] * len(commands)
    children: list[tuple[str, subprocess.Popen]] = []
    stop = {"signal": 0}

    def on_signal(signum: int, frame: object) -> None:
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for command, gpus in zip(commands, slices, strict=True):
            env = {**build_vllm_env(config), **setup_mooncake_config(config), **command.env}
            if gpus is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            name = f"{command.slot.role}-{command.slot.local_index} (port {command.slot.port})"
            log.info(f"starting vLLM engine {name}: {' '.join(command.argv)}")
            children.append((name, subprocess.Popen(command.argv, env=env, preexec_fn=_die_with_parent)))
        if config.deployment.node_rank == 0 and (argv := router_argv(config)) is not None:
            log.info(f"starting vllm-router: {' '.join(argv)}")
            children.append(("vllm-router", subprocess.Popen(argv, preexec_fn=_die_with_parent)))
        return _wait_first_exit(children, stop)
    finally:
        _stop_all(children)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _wait_first_exit(children: list[tuple[str, subprocess.Popen]], stop: dict[str, int]) -> int:
    while not stop["signal"]:
        for name, proc in children:
            if (code := proc.poll()) is not None:
                log.error(f"inference {name} exited with code {code}; stopping the other engines")
                return code or 1
        time.sleep(0.2)
    return 128 + stop["signal"]


def _stop_all(children: list[tuple[str, subprocess.Popen]]) -> None:
    for _, proc in children:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for _, proc in children:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
