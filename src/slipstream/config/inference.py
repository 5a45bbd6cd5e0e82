"""Config of the inference process: a vLLM OpenAI server plus Slipstream's weight-transfer engine."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
from slipstream.config.inference_checks import check_deployment, check_inference_options
from slipstream.config.inference_deployment import EngineSlot, InferenceDeploymentConfig, engine_slots, uses_router
from slipstream.config.inference_options import (
    All2AllBackend,
    EPLBConfig,
    KVCacheOffloadConfig,
    Quantization,
)
from slipstream.config.shared import ModelConfig
from slipstream.config.weights import WeightsConfig

OWN_FLAGS = {
    "--model": "model.name",
    "--dtype": "model.dtype",
    "--tensor-parallel-size": "inference.tensor_parallel_size",
    "-tp": "inference.tensor_parallel_size",
    "--data-parallel-size": "inference.data_parallel_size",
    "-dp": "inference.data_parallel_size",
    "--weight-transfer-config": "weights (Slipstream's weight-transfer backend is always used)",
    "--enable-return-routed-experts": "inference.enable_return_routed_experts",
    "--quantization": "inference.quantization",
    "-q": "inference.quantization",
    "--enable-expert-parallel": "inference.enable_expert_parallel",
    "--no-enable-expert-parallel": "inference.enable_expert_parallel",
    "-ep": "inference.enable_expert_parallel",
    "--all2all-backend": "inference.all2all_backend",
    "--enable-eplb": "inference.enable_eplb",
    "--no-enable-eplb": "inference.enable_eplb",
    "--eplb-config": "inference.eplb",
    "--enable-dbo": "inference.enable_dbo",
    "--no-enable-dbo": "inference.enable_dbo",
}
"""vLLM flags Slipstream sets from its own fields (flag -> the field to set instead): inference.extra_args must not
repeat them."""

OFFLOAD_FLAGS = ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend")
"""vLLM flags inference.kv_cache_offload sets: extra_args may pass them (another KV connector) only without it."""


class InferenceConfig(BaseConfig):
    """How vLLM is started. Admin endpoints bind to `host`, loopback by default."""

    model: ModelConfig
    """The model served at policy version 0."""

    host: str = "127.0.0.1"
    """Address the server binds to. Keep loopback unless other machines must reach it."""

    port: int = Field(8000, ge=1, le=65535)
    """TCP port of the OpenAI-compatible server."""

    seed: int = 0
    """vLLM's sampling seed."""

    max_model_len: int = Field(2048, ge=16)
    """Longest prompt + completion, in tokens."""

    max_num_seqs: int = Field(64, ge=1)
    """Most sequences decoded at once."""

    enforce_eager: bool | None = None
    """Skip CUDA-graph capture and torch.compile warm-up (`--enforce-eager`): a fast start, slower decoding. None:
    true where vLLM runs on CPU, false on GPUs (CUDA graphs: a slower start, faster decoding); `slipstream rl` sets it
    from the GPU placement, a server started alone from `device`."""

    stream_interval: int = Field(1, ge=1)
    """Completion tokens vLLM gathers into one streamed chunk (`--stream-interval`; the first and last token of a
    completion go at once). Rollouts stream one chunk per token and choice by default, and at GPU speed that many
    chunks keep vLLM's API server busy: a weight update's /pause then waits for the server's event loop (measured on
    an H200, vLLM 0.26, 8 requests x 16 choices streaming: /pause 668 ms with 1, 151 ms with 8; benchmarks/
    pause_latency.py). The cost: tokens decoded before a pause but still gathered when it comes are delivered after
    the update and stamped with the new policy version, at most `stream_interval - 1` per completion and update."""

    enable_return_routed_experts: bool = False
    """Return each request's routed experts (`--enable-return-routed-experts`, vLLM's GPU build only), which the
    orchestrator passes to the trainer for router replay (orchestrator.router_replay)."""

    gpu_memory_utilization: float | None = Field(None, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (GPU builds only). None: 0.9, or in a colocated run (deployment.colocate)
    what the trainer leaves (`slipstream rl` plans it from the model's size: launch/colocate_memory.py)."""

    enable_sleep_mode: bool = False
    """Start vLLM with `--enable-sleep-mode` (GPU builds only: vLLM's CPU build refuses the flag), so /sleep can free
    its KV cache and weights. `slipstream rl` sets it for colocated runs on GPUs with deployment.sleep_level >= 1."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel degree of each vLLM engine (`--tensor-parallel-size`); must divide the model's attention
    heads."""

    data_parallel_size: int | None = Field(None, ge=1)
    """Data-parallel engines behind the one server (`--data-parallel-size`), each on tensor_parallel_size GPUs;
    tensor_parallel_size x data_parallel_size must equal the GPUs inference gets (deployment.inference_gpus).
    None: `slipstream rl` fills the inference GPUs (their count / tensor_parallel_size); 1 on CPU."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where vLLM runs; decides GPU-only flags such as `--gpu-memory-utilization`. `slipstream rl` sets it from
    the GPU placement; auto (a server started alone): CUDA when torch sees a GPU."""

    weights: WeightsConfig = WeightsConfig()
    """How new weights arrive from the trainer. Under `slipstream rl` set once at the top level."""

    cpu_kv_cache_gib: int = Field(1, ge=1)
    """KV-cache size in GiB on the CPU build (VLLM_CPU_KVCACHE_SPACE)."""

    cpu_threads_bind: str | None = None
    """OpenMP thread binding of the CPU build (VLLM_CPU_OMP_THREADS_BIND), e.g. `auto` or `0-1`. None: the
    environment's VLLM_CPU_OMP_THREADS_BIND when set (so two servers on one machine can be given cores of their
    own), else vLLM's `auto`."""

    tool_call_parser: str | None = None
    """vLLM tool-call parser for environments with tools (e.g. `hermes` for models that emit
    `<tool_call>{json}</tool_call>`, as the Qwen2.5 and Qwen3 chat templates do): starts vLLM with
    `--enable-auto-tool-choice --tool-call-parser <name>`, so assistant replies carry OpenAI `tool_calls`.
    None: off; vLLM then refuses requests that offer tools, so tool environments need a parser."""

    chunked_prefill: bool | None = None
    """Chunked prefill (`--enable-chunked-prefill` / `--no-enable-chunked-prefill`); None: vLLM's default (on).
    vLLM's CPU build crashes on seeded requests with it on, so `slipstream rl` sets false when
    orchestrator.seed_requests is on and this is left unset."""

    quantization: Quantization | None = None
    """Online quantization of the served weights (`--quantization`), e.g. `fp8` (per-tensor scales) or
    `fp8_per_block` (128x128 blocks, DeepGEMM's layout); every weight update from the trainer is quantized again as
    it loads. None: serve in model.dtype (checkpoints quantized offline are detected by vLLM without it)."""

    deep_gemm: bool | None = None
    """DeepGEMM kernels for FP8 GEMMs and MoE (VLLM_USE_DEEP_GEMM and VLLM_MOE_USE_DEEP_GEMM = 1 / 0; GPU builds
    with the deep_gemm package). None: vLLM's default (used where installed and supported)."""

    enable_expert_parallel: bool = False
    """Split MoE experts over the engine's ranks (`--enable-expert-parallel`: tensor x data parallel ranks form one
    expert-parallel group) instead of tensor-parallel sharding of every expert. Needed by all2all_backend,
    enable_eplb and enable_dbo."""

    all2all_backend: All2AllBackend | None = None
    """How expert parallelism dispatches tokens between data-parallel ranks (`--all2all-backend`):
    allgather_reducescatter (vLLM's default; works everywhere), deepep_high_throughput (prefill-heavy batches,
    DeepEP), deepep_low_latency (decode, DeepEP with CUDA graphs), or another vLLM backend. Needs
    enable_expert_parallel and data-parallel engines. None: vLLM's default."""

    enable_eplb: bool = False
    """Expert-parallel load balancing (`--enable-eplb`, configured by inference.eplb): vLLM moves (and with
    eplb.num_redundant_experts replicates) hot experts between ranks. Needs enable_expert_parallel, more than one
    GPU (tensor x data parallel > 1) and a GPU build."""

    eplb: EPLBConfig = EPLBConfig()
    """Expert-parallel load balancing settings (`--eplb-config`), used with enable_eplb."""

    enable_dbo: bool = False
    """Dual batch overlap (`--enable-dbo`): each batch is split in two micro-batches so one's all-to-all overlaps
    the other's compute. Needs enable_expert_parallel, data-parallel engines and all2all_backend one of
    deepep_high_throughput, deepep_low_latency, nixl_ep (GPU builds)."""

    kv_cache_offload: KVCacheOffloadConfig | None = None
    """KV-cache offload below GPU memory: vLLM's native connector (CPU, or CPU + disk tiering) or a Mooncake store
    shared by the inference nodes. None: off (KV lives in GPU memory only)."""

    extra_args: list[str] = []
    """Extra command-line arguments appended to the vLLM server command, e.g. `["--max-num-batched-tokens", "4096"]`."""

    deployment: InferenceDeploymentConfig = InferenceDeploymentConfig()
    """Deployment shape: single_node (one or more engines on this node, behind a local vllm-router when more than
    one), multi_node (replicas on every node, or wide-EP with enable_expert_parallel), disaggregated (prefill /
    decode engines over NIXL, the router in P/D mode)."""

    @model_validator(mode="after")
    def _check_extra_args(self) -> "InferenceConfig":
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0].replace("_", "-")  # vLLM accepts --tensor_parallel_size too
            if flag in OWN_FLAGS:
                raise ValueError(
                    f"inference.extra_args sets {flag}, which Slipstream sets itself; use {OWN_FLAGS[flag]} instead"
                )
            if flag in OFFLOAD_FLAGS and self.kv_cache_offload is not None:
                raise ValueError(
                    f"inference.extra_args sets {flag}, which inference.kv_cache_offload sets; drop one of them"
                )
        return self

    @model_validator(mode="after")
    def _check_moe_options(self) -> "InferenceConfig":
        check_inference_options(self)
        check_deployment(self)
        return self

    def eager_on(self, on_gpu: bool) -> bool:
        """enforce_eager, with None resolved for a server on GPUs (`on_gpu`: CUDA graphs) or on CPU (eager)."""
        return (not on_gpu) if self.enforce_eager is None else self.enforce_eager

    @property
    def wide_ep(self) -> bool:
        """multi_node with expert parallelism: one data-parallel group spanning the inference nodes."""
        return self.deployment.kind == "multi_node" and self.enable_expert_parallel

    @property
    def engines(self) -> list[EngineSlot]:
        """Every vLLM engine of the deployment, on every node."""
        return engine_slots(self.deployment, self.port, self.wide_ep)

    @property
    def uses_router(self) -> bool:
        """Whether a vllm-router on the head node fronts the engines (at inference.port)."""
        return uses_router(self.deployment, self.wide_ep)

    @property
    def engine_urls(self) -> list[str]:
        """Base URLs of the engines' API servers: the orchestrator sends admin calls to each one directly."""
        return [e.url for e in self.engines if e.serves_http]

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
