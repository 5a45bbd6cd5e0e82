"""Config of the inference deployment shape: how many vLLM engines run, on which nodes, in which role, and the
vllm-router in front of them. Torch- and vLLM-free; slipstream.inference.deployment renders the commands.

Ports: with a router, the router listens on inference.port (so orchestrator.inference_url is unchanged) and the
engines of a node on inference.port + 1, + 2, ... One engine and no router (single_node, one replica, the default):
vLLM itself listens on inference.port, as before."""

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig

DeploymentKind = Literal["single_node", "multi_node", "disaggregated"]
RouterPolicy = Literal["consistent_hash", "round_robin"]

SESSION_HEADER = "X-Session-Id"
"""Header vllm-router's consistent_hash policy keys on; the orchestrator sends one value per rollout, so every turn of
a rollout reaches the same engine and reuses its KV cache."""


class RouterConfig(BaseConfig):
    """vllm-router (the PyPI binary) in front of the engines: generation requests go through it; admin calls
    (pause, weight transfer, resume, probe check) go to every engine directly."""

    policy: RouterPolicy = "consistent_hash"
    """consistent_hash: requests with the same session header (one per rollout) reach the same engine, so the turns
    of a multi-turn rollout reuse its KV cache. round_robin: spread requests evenly, ignoring sessions."""

    prometheus_port: int = Field(29000, ge=1, le=65535)
    """Port of the router's own Prometheus metrics (`--prometheus-port`), on the head inference node."""

    extra_args: list[str] = []
    """Extra vllm-router arguments, e.g. `["--request-timeout-secs", "3600"]`."""


class RoleConfig(BaseConfig):
    """One role of a disaggregated deployment (prefill or decode): its engines and their own overrides."""

    num_replicas: int = Field(1, ge=1)
    """Engines of this role on each node listed in `nodes`."""

    nodes: list[int] = [0]
    """Indices into inference.deployment.nodes of the nodes running this role's engines."""

    env: dict[str, str] = {}
    """Environment variables of this role's engines only (e.g. UCX_NET_DEVICES, VLLM_* tuning)."""

    extra_args: list[str] = []
    """vLLM arguments of this role's engines only, appended after inference.extra_args (e.g. a larger
    `--max-num-batched-tokens` for prefill)."""


class InferenceDeploymentConfig(BaseConfig):
    """Shape of the inference deployment: single_node (replicas on this node behind a local vllm-router),
    multi_node (independent replicas on every node behind one router, or wide-EP: with
    inference.enable_expert_parallel one data-parallel group spanning the nodes behind its head's API server), or
    disaggregated (prefill and decode engines exchanging KV through vLLM's NIXL connector, the router in P/D mode)."""

    kind: DeploymentKind = "single_node"
    """single_node, multi_node or disaggregated (see above)."""

    num_replicas: int = Field(1, ge=1)
    """Independent vLLM engines per node (single_node, multi_node without expert parallelism), each on
    tensor_parallel_size x data_parallel_size GPUs. More than one starts a vllm-router in front of them."""

    nodes: list[str] = ["127.0.0.1"]
    """Addresses of the inference nodes, head first (router, wide-EP coordinator); every engine must be reachable
    from the orchestrator at its node address. single_node: exactly one."""

    node_rank: int = Field(0, ge=0)
    """Which of `nodes` this `slipstream inference` process is (multi-node jobs set it per node, e.g. from
    SLURM_NODEID); it starts that node's engines, and the router on the head (0)."""

    router: RouterConfig = RouterConfig()
    """The vllm-router in front of the engines (when there is more than one)."""

    data_parallel_rpc_port: int = Field(13345, ge=1, le=65535)
    """Wide-EP: port of the data-parallel coordinator on the head node (`--data-parallel-rpc-port`)."""

    nixl_side_channel_port: int = Field(5600, ge=1, le=65535)
    """Disaggregated: first NIXL side-channel port on each node (VLLM_NIXL_SIDE_CHANNEL_PORT); each engine of a node
    takes the next data_parallel_size ports."""

    prefill: RoleConfig = RoleConfig()
    """Disaggregated: the prefill engines (NIXL KV producers)."""

    decode: RoleConfig = RoleConfig()
    """Disaggregated: the decode engines (NIXL KV consumers)."""

    @model_validator(mode="after")
    def _check_shape(self) -> "InferenceDeploymentConfig":
        if not self.nodes or len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"inference.deployment.nodes must list each inference node once (got {self.nodes})")
        if self.node_rank >= len(self.nodes):
            raise ValueError(
                f"inference.deployment.node_rank ({self.node_rank}) must index inference.deployment.nodes "
                f"({len(self.nodes)} nodes)"
            )
        if self.kind == "single_node" and len(self.nodes) != 1:
            raise ValueError(
                f"inference.deployment.kind = 'single_node' runs on one node, but nodes lists {len(self.nodes)}; "
                "use kind = 'multi_node', or list one node"
            )
        defaults = RoleConfig()
        if self.kind != "disaggregated" and (self.prefill != defaults or self.decode != defaults):
            raise ValueError(
                "inference.deployment.prefill / decode configure a disaggregated deployment, but kind is "
                f"{self.kind!r}; set kind = 'disaggregated', or drop those tables"
            )
        if self.kind == "disaggregated":
            if self.num_replicas != 1:
                raise ValueError(
                    "inference.deployment.num_replicas does not apply to kind = 'disaggregated'; set "
                    "prefill.num_replicas and decode.num_replicas instead"
                )
            for role in ("prefill", "decode"):
                bad = [i for i in getattr(self, role).nodes if not 0 <= i < len(self.nodes)]
                if bad or not getattr(self, role).nodes:
                    raise ValueError(
                        f"inference.deployment.{role}.nodes must be indices into inference.deployment.nodes "
                        f"(0..{len(self.nodes) - 1}), at least one (got {getattr(self, role).nodes})"
                    )
        return self


@dataclass(frozen=True)
class EngineSlot:
    """Where one vLLM engine of the deployment runs."""

    role: Literal["replica", "prefill", "decode", "ep_head", "ep_headless"]
    node_rank: int
    host: str
    port: int
    """Its API server's port (a headless wide-EP engine has none: its ranks join the head's)."""
    local_index: int
    """Its index among the engines of its node (GPU slice, NIXL side-channel ports)."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def serves_http(self) -> bool:
        return self.role != "ep_headless"


def engine_slots(deployment: InferenceDeploymentConfig, port: int, wide_ep: bool) -> list[EngineSlot]:
    """Every engine of the deployment, node by node (disaggregated: prefill before decode on each node). `port`:
    inference.port (taken by the router when there is one). `wide_ep`: multi_node with expert parallelism."""
    slots: list[EngineSlot] = []
    single = deployment.kind == "single_node" and deployment.num_replicas == 1
    for rank, host in enumerate(deployment.nodes):
        if deployment.kind == "disaggregated":
            per_role = [
                (r, getattr(deployment, r).num_replicas)
                for r in ("prefill", "decode")
                if rank in getattr(deployment, r).nodes
            ]
        elif wide_ep and deployment.kind == "multi_node":
            per_role = [("ep_head" if rank == 0 else "ep_headless", 1)]
        else:
            per_role = [("replica", deployment.num_replicas)]
        local = 0
        for role, count in per_role:
            for _ in range(count):
                engine_port = port if single or wide_ep else port + 1 + local
                slots.append(EngineSlot(role, rank, host, engine_port, local))  # type: ignore[arg-type]
                local += 1
    return slots


def uses_router(deployment: InferenceDeploymentConfig, wide_ep: bool) -> bool:
    """Whether a vllm-router fronts the engines: more than one API server, or P/D (the router pairs prefill with
    decode). Wide-EP has one API server (the head's) and no router."""
    if deployment.kind == "disaggregated":
        return True
    if wide_ep and deployment.kind == "multi_node":
        return False
    return len(deployment.nodes) * deployment.num_replicas > 1
