"""Config of the inference process: a vLLM OpenAI server plus Slipstream's weight-transfer engine."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig
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
}
"""vLLM flags Slipstream sets from its own fields (flag -> the field to set instead): inference.extra_args must not
repeat them."""


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

    enforce_eager: bool = True
    """Skip CUDA-graph / compile warm-up (fast start; recommended on CPU)."""

    enable_return_routed_experts: bool = False
    """Return each request's routed experts (`--enable-return-routed-experts`, vLLM's GPU build only), which the
    orchestrator passes to the trainer for router replay (orchestrator.router_replay)."""

    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (GPU builds only)."""

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

    cpu_threads_bind: str = "auto"
    """OpenMP thread binding of the CPU build (VLLM_CPU_OMP_THREADS_BIND), e.g. `auto` or `0-1`."""

    tool_call_parser: str | None = None
    """vLLM tool-call parser for environments with tools (e.g. `hermes` for models that emit
    `<tool_call>{json}</tool_call>`, as the Qwen2.5 and Qwen3 chat templates do): starts vLLM with
    `--enable-auto-tool-choice --tool-call-parser <name>`, so assistant replies carry OpenAI `tool_calls`.
    None: off; vLLM then refuses requests that offer tools, so tool environments need a parser."""

    chunked_prefill: bool | None = None
    """Chunked prefill (`--enable-chunked-prefill` / `--no-enable-chunked-prefill`); None: vLLM's default (on).
    vLLM's CPU build crashes on seeded requests with it on, so `slipstream rl` sets false when
    orchestrator.seed_requests is on and this is left unset."""

    extra_args: list[str] = []
    """Extra command-line arguments appended to the vLLM server command, e.g. `["--max-num-batched-tokens", "4096"]`."""

    @model_validator(mode="after")
    def _check_extra_args(self) -> "InferenceConfig":
        for arg in self.extra_args:
            flag = arg.split("=", 1)[0].replace("_", "-")  # vLLM accepts --tensor_parallel_size too
            if flag in OWN_FLAGS:
                raise ValueError(
                    f"inference.extra_args sets {flag}, which Slipstream sets itself; use {OWN_FLAGS[flag]} instead"
                )
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
