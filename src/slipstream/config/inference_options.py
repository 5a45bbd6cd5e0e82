"""Typed sub-configs of the inference process for large (MoE, multi-node) deployments: expert-parallel load
balancing and KV-cache offload (vLLM's native CPU / CPU + disk tiers, or a Mooncake store). Torch- and vLLM-free;
slipstream.inference.options renders them as vLLM flags, environment and connector configs."""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig

All2AllBackend = Literal[
    "allgather_reducescatter",
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "mori_high_throughput",
    "mori_low_latency",
    "moonep",
    "nixl_ep",
    "flashinfer_nvlink_one_sided",
    "flashinfer_nvlink_two_sided",
]
"""vLLM's `--all2all-backend` choices (vLLM 0.32) for expert-parallel token dispatch between data-parallel ranks."""

DBO_BACKENDS = ("deepep_high_throughput", "deepep_low_latency", "nixl_ep")
"""All-to-all backends vLLM's dual batch overlap (microbatching) works with."""

Quantization = Literal["fp8", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "mxfp8"]
"""Online quantization methods of vLLM (`--quantization`) that quantize the bf16 weights the trainer publishes at
load time. Checkpoints quantized offline are detected by vLLM from their config.json and need no flag."""


class EPLBConfig(BaseConfig):
    """Expert-parallel load balancing (`--eplb-config`): vLLM records per-expert load and periodically rearranges
    (and optionally replicates) experts across the expert-parallel ranks."""

    window_size: int = Field(1000, ge=1)
    """Forward steps of expert load recorded before a rearrangement."""

    step_interval: int = Field(3000, ge=1)
    """Forward steps between two rearrangements of the experts."""

    num_redundant_experts: int = Field(0, ge=0)
    """Extra (replicated) physical experts spread over the ranks for hot experts; 0: none."""

    log_balancedness: bool = False
    """Log how balanced the expert load is (costs a collective per step)."""


class MooncakeConfig(BaseConfig):
    """A Mooncake distributed store as the KV-cache offload tier (vLLM's MooncakeStoreConnector, embedded mode:
    every vLLM rank on every inference node is a store client that contributes `segment_gib` of memory). The
    master, with its HTTP metadata server, runs on the head inference node; `master_host` must reach it from every
    inference node."""

    master_host: str = "127.0.0.1"
    """Address of the head inference node, where `mooncake_master` runs (reachable from every inference node)."""

    master_port: int = Field(50051, ge=1, le=65535)
    """RPC port of the Mooncake master (`mooncake_master --rpc_port`)."""

    metadata_port: int = Field(8080, ge=1, le=65535)
    """Port of the master's HTTP metadata server (`--http_metadata_server_port`)."""

    protocol: Literal["rdma", "tcp"] = "rdma"
    """Transport between store clients: rdma (InfiniBand / RoCE NICs) or tcp."""

    device_name: str = ""
    """RDMA NIC(s) the clients use, e.g. `mlx5_0` or `mlx5_0,mlx5_1`; empty: Mooncake picks (and tcp ignores it)."""

    segment_gib: float = Field(32.0, gt=0.0)
    """Memory each vLLM rank contributes to the store pool, in GiB (`global_segment_size`)."""

    local_buffer_gib: float = Field(4.0, gt=0.0)
    """Each client's local transfer buffer, in GiB (`local_buffer_size`)."""


class KVCacheOffloadConfig(BaseConfig):
    """KV-cache offload: blocks evicted from GPU memory are kept in a larger, slower tier and loaded back on a prefix
    hit (multi-turn rollouts whose earlier turns were evicted). Blocks are keyed by their hashes, which include the
    per-policy-version cache salt, so a new policy never reuses offloaded KV of an older one."""

    backend: Literal["native", "mooncake"] = "native"
    """native: vLLM's own offloading connector (CPU memory, plus a disk tier with `disk_dir`). mooncake: a Mooncake
    store shared by the inference nodes (see `mooncake`; needs the mooncake-transfer-engine package)."""

    cpu_gib: float = Field(16.0, gt=0.0)
    """native: CPU memory for offloaded KV blocks, in GiB (per vLLM engine)."""

    disk_dir: Path | None = None
    """native: a directory (local NVMe) for a disk tier below the CPU tier (vLLM's TieringOffloadingSpec with a
    filesystem tier); None: CPU only."""

    mooncake: MooncakeConfig = MooncakeConfig()
    """mooncake: where the master runs and what each client contributes."""

    @model_validator(mode="after")
    def _check_backend(self) -> "KVCacheOffloadConfig":
        if self.backend == "mooncake" and self.disk_dir is not None:
            raise ValueError(
                "inference.kv_cache_offload.disk_dir is a tier of the native backend; with backend = 'mooncake' "
                "the Mooncake store holds the offloaded KV: drop disk_dir, or use backend = 'native'"
            )
        if self.backend == "native" and self.mooncake != MooncakeConfig():
            raise ValueError(
                "inference.kv_cache_offload.mooncake differs from its defaults but backend = 'native'; set backend = 'mooncake' or "
                "drop the [inference.kv_cache_offload.mooncake] table"
            )
        return self
