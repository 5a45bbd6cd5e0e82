"""Command lines of an inference deployment (inference.deployment): one vLLM command per engine, with the flags and
environment of its shape (replica, wide-EP head / headless rank, NIXL prefill / decode), and the vllm-router command
in front of them. Pure: slipstream.inference.group starts the commands of one node."""

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.config.inference import InferenceConfig
from slipstream.config.inference_deployment import EngineSlot
from slipstream.inference.server import build_vllm_argv

NIXL_KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
"""vLLM's NIXL connector: prefill engines hand finished prompts' KV to decode engines, which pull it over NIXL
(UCX: RDMA or TCP). Both roles use kv_both; the router tells each request's prefill engine to keep the KV for a
remote decode."""

ROUTER_STARTUP_TIMEOUT_S = 3600
"""How long the router waits for its engines' /health at start (a large model's vLLM start can exceed its 600 s)."""


@dataclass(frozen=True)
class EngineCommand:
    """One vLLM engine of a node: its slot, command line, environment additions and GPU count."""

    slot: EngineSlot
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    num_gpus: int = 0
    """GPUs it takes from the node's inference GPUs (tensor x local data parallel; 0 on CPU)."""


def engine_commands(
    config: InferenceConfig, model_path: Path, node_rank: int | None = None, on_gpu: bool = False
) -> list[EngineCommand]:
    """The engines of node `node_rank` (None: every node), in order. `on_gpu`: count the GPUs each takes."""
    slots = [s for s in config.engines if node_rank is None or s.node_rank == node_rank]
    dp = config.data_parallel_size or 1
    gpus = config.tensor_parallel_size * dp if on_gpu else 0
    return [
        EngineCommand(slot, engine_argv(config, slot, model_path), engine_env(config, slot), gpus) for slot in slots
    ]


def engine_argv(config: InferenceConfig, slot: EngineSlot, model_path: Path) -> list[str]:
    """vLLM command of one engine: the single-server command at the engine's port plus the flags of its role."""
    deployment = config.deployment
    if slot.role in ("ep_head", "ep_headless"):
        local_dp = config.data_parallel_size or 1
        base = build_vllm_argv(config.model_copy(update={"port": slot.port, "data_parallel_size": None}), model_path)
        extra = [
            "--data-parallel-size", str(local_dp * len(deployment.nodes)),
            "--data-parallel-size-local", str(local_dp),
            "--data-parallel-address", deployment.nodes[0],
            "--data-parallel-rpc-port", str(deployment.data_parallel_rpc_port),
        ]  # fmt: skip
        if slot.role == "ep_headless":
            extra += ["--headless", "--data-parallel-start-rank", str(slot.node_rank * local_dp)]
        return base + extra
    argv = build_vllm_argv(config.model_copy(update={"port": slot.port}), model_path)
    if slot.role in ("prefill", "decode"):
        argv += ["--kv-transfer-config", json.dumps(NIXL_KV_TRANSFER_CONFIG)]
        argv += getattr(deployment, slot.role).extra_args
    return argv


def engine_env(config: InferenceConfig, slot: EngineSlot) -> dict[str, str]:
    """Environment additions of one engine: disaggregated roles get their NIXL side channel and their own vars."""
    if slot.role not in ("prefill", "decode"):
        return {}
    deployment = config.deployment
    port = deployment.nixl_side_channel_port + slot.local_index * (config.data_parallel_size or 1)
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": slot.host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
        **getattr(deployment, slot.role).env,
    }


def router_argv(config: InferenceConfig) -> list[str] | None:
    """The vllm-router command (on the head node), or None when the deployment has no router."""
    if not config.uses_router:
        return None
    router = config.deployment.router
    argv = [
        router_binary(),
        "--host", config.host,
        "--port", str(config.port),
        "--policy", router.policy,
        "--prometheus-port", str(router.prometheus_port),
        "--worker-startup-timeout-secs", str(ROUTER_STARTUP_TIMEOUT_S),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip
    engines = config.engines
    if config.deployment.kind == "disaggregated":
        argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
        for engine in engines:
            argv += [f"--{engine.role}", engine.url]
    else:
        argv += ["--worker-urls", *(e.url for e in engines if e.serves_http)]
    return argv + list(router.extra_args)


def router_binary() -> str:
    """vllm-router of this Python environment (the PyPI package installs it beside the interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else (shutil.which("vllm-router") or "vllm-router")


def render_deployment(config: InferenceConfig, model_path: Path) -> dict[int, list[tuple[dict[str, str], list[str]]]]:
    """Every command of the deployment as (environment additions, argv), per node rank: the node's engines, then
    (on the head) the router."""
    nodes: dict[int, list[tuple[dict[str, str], list[str]]]] = {r: [] for r in range(len(config.deployment.nodes))}
    for command in engine_commands(config, model_path):
        nodes[command.slot.node_rank].append((command.env, command.argv))
    if (argv := router_argv(config)) is not None:
        nodes[0].append(({}, argv))
    return nodes
