"""The vLLM command lines Slipstream renders, parsed by the installed vLLM's own server parser: every flag must be
one vLLM knows, and the values it reads back must be the deployment's (tp, dp, dtype, weight-transfer backend)."""

import argparse
import functools
import json
from pathlib import Path

import pytest

from slipstream.config import RLConfig
from slipstream.config.loader import deep_merge, validate_config
from slipstream.inference.server import build_vllm_argv
from slipstream.inference.vllm_plugin import ENGINE_BACKEND
from slipstream.launch.plan import resolve_config

API_SERVER = "vllm.entrypoints.openai.api_server"
BASE = {"max_steps": 2, "model": {"name": "Qwen/Qwen3-0.6B"}, "orchestrator": {"batch_size": 8, "group_size": 4}}


@functools.cache
def _vllm_parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))


def parse_vllm_argv(argv: list[str]):
    """Parse a rendered command line as `python -m vllm.entrypoints.openai.api_server` would (its parser and its
    checks), and return vLLM's engine arguments. An unknown flag exits (SystemExit 2), as vLLM would."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    assert argv[1:3] == ["-m", API_SERVER]
    args = _vllm_parser().parse_args(argv[3:])
    validate_parsed_serve_args(args)
    return args, AsyncEngineArgs.from_cli_args(args)


def inference_config(visible: list[int], **sections):
    config = validate_config(RLConfig, deep_merge(BASE, sections))
    return resolve_config(config, visible).inference


SHAPES = {
    "1 GPU": ([0, 1], {}, 1, 1),
    "tp=2": ([0, 1, 2, 3], {"inference": {"tensor_parallel_size": 2}}, 2, 1),
    "dp=2": ([0, 1, 2, 3], {}, 1, 2),
    "tp=2 x dp=2": (list(range(8)), {"inference": {"tensor_parallel_size": 2}}, 2, 2),
    "tool parser": ([0, 1], {"inference": {"tool_call_parser": "hermes"}}, 1, 1),
    "expert parallel": (list(range(8)), {"inference": {"enable_expert_parallel": True}}, 1, 4),
    "CPU": ([], {"model": {"name": "Qwen/Qwen3-0.6B", "dtype": "float32"}}, 1, 1),
    "router replay": ([0, 1], {"inference": {"enable_return_routed_experts": True}}, 1, 1),
    "stream interval": ([0, 1], {"inference": {"stream_interval": 8}}, 1, 1),
    "bfloat16 head": ([0, 1], {"model": {"name": "Qwen/Qwen3-0.6B", "head_dtype": "model"}}, 1, 1),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_vllm_parses_our_command_line(shape):
    visible, sections, tp, dp = SHAPES[shape]
    config = inference_config(visible, **sections)
    argv = build_vllm_argv(config, Path("/models/qwen3-0.6b"))
    args, engine = parse_vllm_argv(argv)
    assert (engine.tensor_parallel_size, engine.data_parallel_size) == (tp, dp)
    assert engine.model == "/models/qwen3-0.6b" and engine.served_model_name == ["Qwen/Qwen3-0.6B"]
    assert engine.dtype == ("bfloat16" if visible else "float32")
    assert engine.weight_transfer_config.backend == ENGINE_BACKEND
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "slipstream"}
    assert (engine.max_model_len, engine.max_num_seqs, engine.seed) == (2048, 64, 0)
    assert engine.logprobs_mode == "processed_logprobs"
    assert engine.enforce_eager == (not visible)  # CUDA graphs on GPUs, eager on CPU (inference.enforce_eager unset)
    assert len(args.middleware) == 2
    assert ("--gpu-memory-utilization" in argv) == bool(visible)  # decided by the placement, not by torch here
    if visible:
        assert engine.gpu_memory_utilization == 0.9
    assert ("--data-parallel-size" in argv) == (dp > 1)
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (
        ("tool_call_parser" in sections.get("inference", {})),
        sections.get("inference", {}).get("tool_call_parser"),
    )
    assert engine.enable_expert_parallel == sections.get("inference", {}).get("enable_expert_parallel", False)
    routed = sections.get("inference", {}).get("enable_return_routed_experts", False)
    assert engine.enable_return_routed_experts == routed
    assert engine.stream_interval == sections.get("inference", {}).get("stream_interval", 1)
    assert ("--stream-interval" in argv) == ("stream_interval" in sections.get("inference", {}))
    # model.head_dtype "float32" (default) on bfloat16 GPUs; nothing to override for a float32 model or with "model"
    float32_head = bool(visible) and sections.get("model", {}).get("head_dtype", "float32") == "float32"
    assert engine.hf_overrides == ({"head_dtype": "float32"} if float32_head else {})


def test_a_float32_head_reaches_vllm_s_model_config():
    """vLLM reads our --hf-overrides into the model config's head_dtype, which its LogitsProcessor honours."""
    import torch
    from vllm.config.model import _get_head_dtype

    config = inference_config([0, 1])
    _, engine = parse_vllm_argv(build_vllm_argv(config, Path("/m")))
    hf_config = argparse.Namespace(**engine.hf_overrides)
    assert _get_head_dtype(hf_config, torch.bfloat16, "generate") == torch.float32


def test_a_float32_head_and_hf_overrides_in_extra_args_are_refused():
    config = inference_config([0, 1], inference={"extra_args": ["--hf-overrides", "{}"]})
    with pytest.raises(ValueError, match="head_dtype"):
        build_vllm_argv(config, Path("/m"))
    config = inference_config(
        [0, 1], model={"name": "m", "head_dtype": "model"}, inference={"extra_args": ["--hf-overrides", "{}"]}
    )
    assert "--hf-overrides" in build_vllm_argv(config, Path("/m"))  # theirs alone


@pytest.mark.parametrize(
    ("visible", "asked", "eager"),
    [([0, 1], None, False), ([], None, True), ([0, 1], True, True), ([], False, False)],
    ids=["GPU default", "CPU default", "GPU eager asked", "CPU graphs asked"],
)
def test_enforce_eager_follows_the_placement_unless_set(visible, asked, eager):
    sections = {"inference": {"enforce_eager": asked}} if asked is not None else {}
    config = inference_config(visible, **sections)
    assert config.enforce_eager is eager  # resolved in the written config too
    _, engine = parse_vllm_argv(build_vllm_argv(config, Path("/m")))
    assert engine.enforce_eager is eager


@pytest.mark.parametrize(("device", "eager"), [("cpu", True), ("cuda", False)])
def test_a_server_started_alone_resolves_enforce_eager_from_its_device(device, eager):
    from slipstream.config.inference import InferenceConfig

    config = InferenceConfig(model={"name": "m", "dtype": "bfloat16"}, device=device)
    assert config.enforce_eager is None
    assert ("--enforce-eager" in build_vllm_argv(config, Path("/m"))) is eager
    assert "--enforce-eager" in build_vllm_argv(config.model_copy(update={"enforce_eager": True}), Path("/m"))


@pytest.mark.parametrize(("asked", "environment", "bound"), [(None, "1", "1"), (None, None, None), ("0-1", "1", "0-1")])
def test_cpu_thread_binding_is_the_config_s_or_else_the_environment_s(asked, environment, bound):
    """inference.cpu_threads_bind unset leaves VLLM_CPU_OMP_THREADS_BIND as the environment has it (unset: vLLM's
    own default, auto); set, it wins."""
    from slipstream.config.inference import InferenceConfig
    from slipstream.inference.server import build_vllm_env

    config = InferenceConfig(model={"name": "m"}, cpu_threads_bind=asked)
    base = {} if environment is None else {"VLLM_CPU_OMP_THREADS_BIND": environment}
    assert build_vllm_env(config, base).get("VLLM_CPU_OMP_THREADS_BIND") == bound


def test_a_flag_vllm_does_not_know_fails():
    config = inference_config([], inference={"extra_args": ["--no-such-vllm-flag", "1"]})
    with pytest.raises(SystemExit):
        parse_vllm_argv(build_vllm_argv(config, Path("/m")))


EP = {"enable_expert_parallel": True}
OPTION_SHAPES = {
    "fp8 + DeepGEMM": {"quantization": "fp8_per_block", "deep_gemm": True},
    "DeepEP low latency + DBO": {**EP, "all2all_backend": "deepep_low_latency", "enable_dbo": True},
    "DeepEP high throughput + EPLB": {
        **EP,
        "all2all_backend": "deepep_high_throughput",
        "enable_eplb": True,
        "eplb": {"num_redundant_experts": 32, "window_size": 500},
    },
    "allgather_reducescatter": {**EP, "all2all_backend": "allgather_reducescatter"},
    "KV offload: CPU": {"kv_cache_offload": {"cpu_gib": 64}},
    "KV offload: CPU + disk": {"kv_cache_offload": {"cpu_gib": 8.5, "disk_dir": "/nvme/kv"}},
    "KV offload: Mooncake": {"kv_cache_offload": {"backend": "mooncake", "mooncake": {"master_host": "node0"}}},
}


@pytest.mark.parametrize("shape", OPTION_SHAPES)
def test_vllm_parses_the_large_deployment_options(shape):
    """FP8, expert-parallel backends, EPLB, DBO and KV offload render to flags vLLM's parser reads back as set."""
    options = OPTION_SHAPES[shape]
    config = inference_config(list(range(8)), inference={"tensor_parallel_size": 2, **options})
    argv = build_vllm_argv(config, Path("/models/glm"))
    _, engine = parse_vllm_argv(argv)
    assert (engine.tensor_parallel_size, engine.data_parallel_size) == (2, 2)
    assert engine.quantization == options.get("quantization")
    assert engine.enable_expert_parallel == options.get("enable_expert_parallel", False)
    assert engine.all2all_backend == options.get("all2all_backend", "allgather_reducescatter")
    assert (engine.enable_eplb, engine.enable_dbo) == (
        options.get("enable_eplb", False),
        options.get("enable_dbo", False),
    )
    if engine.enable_eplb:
        assert engine.eplb_config.num_redundant_experts == 32 and engine.eplb_config.window_size == 500
    offload = options.get("kv_cache_offload")
    if offload is None:
        assert engine.kv_offloading_size is None and engine.kv_transfer_config is None
    elif "disk_dir" in offload or "mooncake" in offload:
        assert engine.kv_offloading_size is None and engine.kv_transfer_config.kv_role == "kv_both"
    else:
        assert (engine.kv_offloading_size, engine.kv_offloading_backend) == (64, "native")
