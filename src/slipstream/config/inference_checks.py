"""Cross-field rules of the inference config for combinations vLLM rejects (or silently ignores), checked when the
config is read so a cluster job does not fail minutes later in vLLM's start-up. Each message names the fields and
the fix."""

from typing import TYPE_CHECKING

from slipstream.config.inference_options import DBO_BACKENDS, EPLBConfig

if TYPE_CHECKING:
    from slipstream.config.inference import InferenceConfig


def check_inference_options(config: "InferenceConfig") -> None:
    """Raise ValueError on a combination of expert-parallel, EPLB, DBO and GPU-only options vLLM would reject."""
    _check_all2all(config)
    _check_eplb(config)
    _check_dbo(config)
    _check_gpu_only(config)


def _check_all2all(config: "InferenceConfig") -> None:
    backend = config.all2all_backend
    if backend is None:
        return
    if not config.enable_expert_parallel:
        raise ValueError(
            f"inference.all2all_backend = {backend!r} dispatches tokens between expert-parallel ranks, but "
            "inference.enable_expert_parallel is false; set inference.enable_expert_parallel = true, or drop "
            "inference.all2all_backend"
        )
    if config.data_parallel_size == 1:
        raise ValueError(
            f"inference.all2all_backend = {backend!r} needs data-parallel engines (vLLM uses all-to-all only between "
            "data-parallel ranks), but inference.data_parallel_size is 1; give inference more GPUs "
            "(deployment.inference_gpus) or a larger inference.data_parallel_size, or drop inference.all2all_backend"
        )


def _check_eplb(config: "InferenceConfig") -> None:
    if not config.enable_eplb:
        if config.eplb != EPLBConfig():
            raise ValueError(
                "inference.eplb differs from its defaults but inference.enable_eplb is false; set inference.enable_eplb = true, or "
                "drop the [inference.eplb] table"
            )
        return
    if not config.enable_expert_parallel:
        raise ValueError(
            "inference.enable_eplb balances experts between expert-parallel ranks; set "
            "inference.enable_expert_parallel = true, or inference.enable_eplb = false"
        )
    dp = config.data_parallel_size
    if dp is not None and config.tensor_parallel_size * dp == 1:
        raise ValueError(
            "inference.enable_eplb needs more than one expert-parallel rank, but inference.tensor_parallel_size x "
            "inference.data_parallel_size = 1; give inference more GPUs, or set inference.enable_eplb = false"
        )


def _check_dbo(config: "InferenceConfig") -> None:
    if not config.enable_dbo:
        return
    if config.all2all_backend not in DBO_BACKENDS:
        raise ValueError(
            f"inference.enable_dbo (dual batch overlap) works with inference.all2all_backend one of "
            f"{', '.join(DBO_BACKENDS)} (got {config.all2all_backend!r}); set one of them (with "
            "inference.enable_expert_parallel = true), or inference.enable_dbo = false"
        )


def _check_gpu_only(config: "InferenceConfig") -> None:
    if config.device != "cpu":
        return
    if config.model.vlm is not None:
        # vLLM 0.32's CPU build fails inspecting Qwen3-VL: its image processor needs torchvision (docs/vlm.md)
        raise ValueError(
            "[model.vlm] needs vLLM's GPU build: vLLM's CPU build cannot serve vision-language models here (they need "
            "torchvision, which has CUDA builds only), but inference runs on CPU (inference.device = 'cpu', or no "
            "GPU for inference on this node); give inference GPUs, or (tests) serve the model with "
            "`python -m slipstream_sim.vlm_server` and set deployment.run = ['trainer', 'orchestrator'] and "
            "orchestrator.inference_url (examples/count_shapes)"
        )
    used = [
        name
        for name, on in (
            ("enable_eplb", config.enable_eplb),
            ("enable_dbo", config.enable_dbo),
            ("deep_gemm", config.deep_gemm is True),
            ("all2all_backend", config.all2all_backend not in (None, "allgather_reducescatter")),
            # vLLM 0.32's CPU build refuses it at engine start ("CPU Offloading is currently only supported on
            # CUDA-alike and XPU GPUs", tried here): refuse it before the run starts
            ("kv_cache_offload", config.kv_cache_offload is not None and config.kv_cache_offload.backend == "native"),
        )
        if on
    ]
    if used:
        raise ValueError(
            f"inference.{used[0]} needs vLLM's GPU build, but inference runs on CPU (inference.device = 'cpu', or no "
            "GPU for inference on this node); drop it, or give inference GPUs"
        )


def check_deployment(config: "InferenceConfig") -> None:
    """Raise ValueError on a deployment shape vLLM or the router cannot run with the other inference options."""
    from slipstream.config.inference import OWN_FLAGS

    deployment = config.deployment
    if config.wide_ep and deployment.num_replicas != 1:
        raise ValueError(
            "inference.deployment.kind = 'multi_node' with inference.enable_expert_parallel runs one data-parallel "
            "group spanning the nodes (wide-EP), so inference.deployment.num_replicas must be 1; set it to 1, or "
            "inference.enable_expert_parallel = false for independent replicas"
        )
    if deployment.kind != "disaggregated":
        return
    if config.kv_cache_offload is not None:
        raise ValueError(
            "inference.deployment.kind = 'disaggregated' moves KV between engines with the NIXL connector, which "
            "takes vLLM's --kv-transfer-config; inference.kv_cache_offload needs it too: drop one of them"
        )
    for where, args in (
        ("inference.extra_args", config.extra_args),
        ("inference.deployment.prefill.extra_args", deployment.prefill.extra_args),
        ("inference.deployment.decode.extra_args", deployment.decode.extra_args),
    ):
        for arg in args:
            flag = arg.split("=", 1)[0].replace("_", "-")
            if flag in ("--kv-transfer-config", "--kv-offloading-size", "--kv-offloading-backend"):
                raise ValueError(f"{where} sets {flag}, which the disaggregated deployment sets (NIXL); drop it")
            if flag in OWN_FLAGS and where != "inference.extra_args":
                raise ValueError(f"{where} sets {flag}, which Slipstream sets itself; use {OWN_FLAGS[flag]} instead")
