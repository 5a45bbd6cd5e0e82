"""Start vLLM's OpenAI-compatible server for Slipstream: dev-mode RL endpoints, our weight-transfer engine, and
logprobs at the sampling temperature (the trainer's loss needs them)."""

import json
import logging
import os
import sys
from pathlib import Path

from slipstream.config.inference import InferenceConfig
from slipstream.config.shared import LoRAConfig
from slipstream.inference.instance import INSTANCE_ENV, new_instance_id
from slipstream.inference.options import option_args, option_env, setup_mooncake_config
from slipstream.inference.vllm_plugin import ENGINE_BACKEND

log = logging.getLogger(__name__)

ADMIN_MIDDLEWARE = "slipstream.inference.auth.AdminTokenMiddleware"
INSTANCE_MIDDLEWARE = "slipstream.inference.instance.InstanceIdMiddleware"
WEIGHT_TRANSFER_CONFIG = json.dumps({"backend": ENGINE_BACKEND})
"""vLLM's weight-transfer engine: Slipstream's, registered by our vLLM plugin (inference/vllm_plugin.py)."""


DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's share of GPU memory when inference.gpu_memory_utilization is unset (and the run is not colocated)."""


def build_vllm_argv(config: InferenceConfig, model_path: Path) -> list[str]:
    """Command line of the vLLM server (python -m vllm.entrypoints.openai.api_server ...). GPU-only flags and
    eager mode (unless enforce_eager is set) follow config.device, which `slipstream rl` sets from the GPU placement."""
    on_gpu = runs_on_gpu(config)
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_path),
        "--served-model-name", config.model.name,
        "--host", config.host,
        "--port", str(config.port),
        "--dtype", config.model.dtype,
        "--seed", str(config.seed),
        "--max-model-len", str(config.max_model_len),
        "--max-num-seqs", str(config.max_num_seqs),
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--weight-transfer-config", WEIGHT_TRANSFER_CONFIG,
        "--middleware", ADMIN_MIDDLEWARE,  # admin endpoints need the run's admin token
        "--middleware", INSTANCE_MIDDLEWARE,  # replies name this start of the server (restart detection)
        "--logprobs-mode", "processed_logprobs",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if (config.data_parallel_size or 1) > 1:
        argv += ["--data-parallel-size", str(config.data_parallel_size)]
    if config.eager_on(on_gpu):
        argv.append("--enforce-eager")
    if config.stream_interval > 1:
        argv += ["--stream-interval", str(config.stream_interval)]
    if config.chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if config.chunked_prefill else "--no-enable-chunked-prefill")
    if config.enable_return_routed_experts:
        argv.append("--enable-return-routed-experts")
    if config.model.head_dtype != "model" and config.model.head_dtype != config.model.dtype:
        # the trainer computes its logits in the same dtype (trainer/lm_head.py)
        if any(arg.split("=")[0] == "--hf-overrides" for arg in config.extra_args):
            raise ValueError(
                "model.head_dtype sets vLLM's --hf-overrides, which inference.extra_args sets too (the last would "
                'win): add "head_dtype" to the overrides in extra_args and leave model.head_dtype = "model"'
            )
        argv += ["--hf-overrides", json.dumps({"head_dtype": config.model.head_dtype})]
    if config.tool_call_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if on_gpu:
        utilization = config.gpu_memory_utilization
        argv += [
            "--gpu-memory-utilization",
            str(DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization),
        ]
    if config.enable_sleep_mode:
        if not on_gpu:
            raise ValueError(
                "inference.enable_sleep_mode: vLLM's CPU build has no sleep mode (it refuses --enable-sleep-mode); "
                "drop it where vLLM runs on CPU (a colocated CPU run alternates without it)"
            )
        argv.append("--enable-sleep-mode")
    return argv + lora_args(config.model.lora) + option_args(config) + list(config.extra_args)


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for --max-lora-rank."""


def lora_args(lora: LoRAConfig | None) -> list[str]:
    """With `model.lora`: serve `max_loras` adapters (the policy, or one per tenant of a multi-tenant trainer, each
    loaded and reloaded in place by its orchestrator through /v1/load_lora_adapter) of at most the configured rank, on
    top of the frozen base model."""
    if lora is None:
        return []
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= lora.rank), None)
    if max_rank is None:
        raise ValueError(f"model.lora.rank = {lora.rank} is above vLLM's largest LoRA rank ({VLLM_LORA_RANKS[-1]})")
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", str(lora.max_loras)]


def build_vllm_env(config: InferenceConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the vLLM server: RL/admin endpoints on, no hub access, CPU-build sizing, a fresh instance id."""
    env = dict(os.environ if base is None else base)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # enables /pause, /resume, /collective_rpc, /reset_prefix_cache
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE=str(config.cpu_kv_cache_gib),
        VLLM_CONFIGURE_LOGGING="1",
    )
    if config.cpu_threads_bind is not None:  # else the environment's binding (vLLM's default: auto) stands
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    env.update(option_env(config))  # DeepGEMM on/off
    if config.model.lora is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter (the policy's adapter every step)
    env[INSTANCE_ENV] = new_instance_id()  # see slipstream.inference.instance
    return env


MOE_CONFIG_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")
"""HF config keys that mark a mixture-of-experts model."""


def check_lora_servable(config: InferenceConfig, model_path: Path) -> None:
    """vLLM 0.32 wraps every MoE layer for LoRA with a Triton-only kernel: on its CPU build the first request to an
    adapter kills the engine (whatever the adapter targets). Refuse that pairing up front, saying what to change."""
    if config.model.lora is None or runs_on_gpu(config):
        return
    hf_config = json.loads((Path(model_path) / "config.json").read_text())
    if any(hf_config.get(key) for key in MOE_CONFIG_KEYS):
        raise ValueError(
            f"[model.lora] on the mixture-of-experts model {config.model.name} needs vLLM's GPU build: vLLM's CPU build "
            "has no kernel for LoRA on MoE layers. Serve it on GPUs, train a dense model, or drop [model.lora]"
        )


def runs_on_gpu(config: InferenceConfig) -> bool:
    """Whether vLLM runs on GPUs: inference.device, or with "auto" whether torch sees a GPU here."""
    return config.device == "cuda" or (config.device == "auto" and _has_cuda())


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_inference(config: InferenceConfig) -> int:
    """Resolve the model folder and replace this process with the vLLM server."""
    from slipstream.inference.admin_token import TOKEN_ENV
    from slipstream.inference.vllm_support import UnsupportedVLLM, check_vllm
    from slipstream.models.resolve import resolve_model_config
    from slipstream.monitor.logs import setup_logging

    setup_logging("inference")
    if not os.environ.get(TOKEN_ENV):
        print(  # a refusal to start: on stderr, where a command's errors go
            f"error: set {TOKEN_ENV} to a secret before starting inference (the orchestrator needs the same value); "
            "it guards the weight-loading and pause endpoints. `slipstream rl` sets it for you.",
            file=sys.stderr,
        )
        return 2
    try:
        check_vllm()
    except UnsupportedVLLM as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    model_path = resolve_model_config(config.model)
    check_lora_servable(config, model_path)
    if len(config.engines) > 1 or config.uses_router:
        from slipstream.inference.group import run_inference_group

        return run_inference_group(config, model_path)  # several engines (and the router) on this node
    argv = build_vllm_argv(config, model_path)
    log.info(f"starting vLLM: {' '.join(argv)}")
    env = {**build_vllm_env(config), **setup_mooncake_config(config)}
    os.execve(sys.executable, argv, env)
