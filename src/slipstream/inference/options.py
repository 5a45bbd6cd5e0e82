"""vLLM flags, environment and KV-connector configs for the inference config's large-deployment options: FP8,
DeepGEMM, expert parallelism (all-to-all backend, EPLB, DBO) and KV-cache offload (native CPU / CPU + disk tiers, or
a Mooncake store whose master runs on the head inference node). Pure: nothing here starts a process."""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from slipstream.config.inference import InferenceConfig
from slipstream.config.inference_options import KVCacheOffloadConfig, MooncakeConfig

MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
"""vLLM's MooncakeStoreConnector reads its store config (JSON) from the file this variable names."""

GIB = 1 << 30


def option_args(config: InferenceConfig) -> list[str]:
    """vLLM flags of the typed options that are set (nothing for those left at vLLM's defaults)."""
    args: list[str] = []
    if config.quantization is not None:
        args += ["--quantization", config.quantization]
    if config.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if config.all2all_backend is not None:
        args += ["--all2all-backend", config.all2all_backend]
    if config.enable_eplb:
        args += ["--enable-eplb", "--eplb-config", json.dumps(config.eplb.model_dump())]
    if config.enable_dbo:
        args.append("--enable-dbo")
    return args + kv_offload_args(config.kv_cache_offload)


def kv_offload_args(offload: KVCacheOffloadConfig | None) -> list[str]:
    """CPU-only native offload through vLLM's own flags; a disk tier or Mooncake through a KV-transfer config."""
    if offload is None:
        return []
    if offload.backend == "native" and offload.disk_dir is None:
        return ["--kv-offloading-backend", "native", "--kv-offloading-size", _number(offload.cpu_gib)]
    return ["--kv-transfer-config", json.dumps(kv_transfer_config(offload))]


def kv_transfer_config(offload: KVCacheOffloadConfig) -> dict[str, Any]:
    """vLLM's KVTransferConfig (as JSON) for a disk-tiered native offload or a Mooncake store."""
    if offload.backend == "mooncake":
        return {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
    assert offload.disk_dir is not None, "CPU-only native offload uses --kv-offloading-size"
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": int(offload.cpu_gib * GIB),
            "secondary_tiers": [{"type": "fs", "root_dir": str(offload.disk_dir)}],
        },
    }


def mooncake_store_config(mooncake: MooncakeConfig) -> dict[str, Any]:
    """The store-client config every inference node's vLLM reads (vLLM's MooncakeStoreConfig fields)."""
    return {
        "mode": "embedded",
        "metadata_server": f"http://{mooncake.master_host}:{mooncake.metadata_port}/metadata",
        "master_server_address": f"{mooncake.master_host}:{mooncake.master_port}",
        "protocol": mooncake.protocol,
        "device_name": mooncake.device_name,
        "global_segment_size": int(mooncake.segment_gib * GIB),
        "local_buffer_size": int(mooncake.local_buffer_gib * GIB),
    }


def mooncake_master_argv(mooncake: MooncakeConfig) -> list[str]:
    """Command of the Mooncake master plus its HTTP metadata server, run once, on the head inference node."""
    return [
        "mooncake_master",
        f"--rpc_port={mooncake.master_port}",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=0.0.0.0",
        f"--http_metadata_server_port={mooncake.metadata_port}",
    ]


def option_env(config: InferenceConfig) -> dict[str, str]:
    """Environment for the options: DeepGEMM kernels on or off (nothing when left to vLLM)."""
    if config.deep_gemm is None:
        return {}
    flag = "1" if config.deep_gemm else "0"
    return {"VLLM_USE_DEEP_GEMM": flag, "VLLM_MOE_USE_DEEP_GEMM": flag}


def setup_mooncake_config(config: InferenceConfig, folder: Path | None = None) -> dict[str, str]:
    """With a Mooncake store: write its client config (JSON) into `folder` (None: the temporary directory) and return
    the variable that points vLLM at it; {} otherwise."""
    offload = config.kv_cache_offload
    if offload is None or offload.backend != "mooncake":
        return {}
    folder = Path(tempfile.gettempdir()) if folder is None else folder
    path = folder / f"slipstream-mooncake-{config.port}-{os.getpid()}.json"
    path.write_text(json.dumps(mooncake_store_config(offload.mooncake), indent=2))
    return {MOONCAKE_CONFIG_ENV: str(path)}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
