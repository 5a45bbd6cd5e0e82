"""The inference config's large-deployment options (FP8, all-to-all backend, EPLB, DBO, KV-cache offload): the typed
values are the installed vLLM's own names, combinations vLLM rejects fail when the config is read (naming the fields
and the fix), and every KV-transfer / Mooncake config validates with vLLM's own config classes."""

import inspect
import json
import typing
from pathlib import Path
from unittest import mock

import pytest

from slipstream.config.base import ConfigError
from slipstream.config.inference import InferenceConfig
from slipstream.config.inference_options import All2AllBackend, KVCacheOffloadConfig, Quantization
from slipstream.inference.options import (
    MOONCAKE_CONFIG_ENV,
    kv_transfer_config,
    mooncake_master_argv,
    option_env,
    setup_mooncake_config,
)

MODEL = {"name": "zai-org/GLM-4.5-Air"}
EP = {"enable_expert_parallel": True}


def inference(**fields) -> InferenceConfig:
    return InferenceConfig.model_validate({"model": MODEL, "device": "cuda", "data_parallel_size": 4, **fields})


def test_typed_values_are_vllms_own_names():
    from vllm.config.parallel import All2AllBackend as VllmBackends
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert set(typing.get_args(All2AllBackend)) <= set(typing.get_args(VllmBackends)) - {"passthrough"}
    assert set(typing.get_args(Quantization)) <= set(QUANTIZATION_METHODS)


REJECTED = {
    "DeepEP without expert parallelism": (
        {"all2all_backend": "deepep_low_latency"},
        r"inference.all2all_backend = 'deepep_low_latency' .* set inference.enable_expert_parallel = true",
    ),
    "all-to-all with one engine": (
        {**EP, "all2all_backend": "deepep_high_throughput", "data_parallel_size": 1},
        r"needs data-parallel engines .* inference.data_parallel_size is 1",
    ),
    "EPLB without expert parallelism": ({"enable_eplb": True}, r"set inference.enable_expert_parallel = true"),
    "EPLB on one GPU": ({**EP, "enable_eplb": True, "data_parallel_size": 1}, r"more than one expert-parallel rank"),
    "EPLB settings without EPLB": ({"eplb": {"num_redundant_experts": 8}}, r"set inference.enable_eplb = true"),
    "DBO without a DeepEP backend": (
        {**EP, "enable_dbo": True, "all2all_backend": "allgather_reducescatter"},
        r"inference.enable_dbo .* deepep_high_throughput, deepep_low_latency, nixl_ep",
    ),
    "EPLB on CPU": ({**EP, "enable_eplb": True, "device": "cpu"}, r"inference.enable_eplb needs vLLM's GPU build"),
    "DeepGEMM on CPU": ({"deep_gemm": True, "device": "cpu"}, r"inference.deep_gemm needs vLLM's GPU build"),
    "native KV offload on CPU": (
        {"kv_cache_offload": {"cpu_gib": 1}, "device": "cpu"},
        r"inference.kv_cache_offload needs vLLM's GPU build",
    ),
    "extra_args repeating a typed flag": (
        {"extra_args": ["--all2all-backend=naive"]},
        r"use inference.all2all_backend",
    ),
    "extra_args with a second KV connector": (
        {"kv_cache_offload": {}, "extra_args": ["--kv-transfer-config", "{}"]},
        r"--kv-transfer-config, which inference.kv_cache_offload sets",
    ),
    "disk tier under Mooncake": (
        {"kv_cache_offload": {"backend": "mooncake", "disk_dir": "/nvme"}},
        r"disk_dir is a tier of the native backend",
    ),
    "Mooncake settings under native": (
        {"kv_cache_offload": {"mooncake": {"master_host": "node0"}}},
        r"set backend = 'mooncake'",
    ),
}


@pytest.mark.parametrize("case", REJECTED)
def test_combinations_vllm_rejects_fail_at_config_time(case):
    fields, message = REJECTED[case]
    with pytest.raises(ValueError, match=message):
        inference(**fields)


def _vllm_parallel_config(config: InferenceConfig):
    """vLLM's own ParallelConfig for these options, on a pretend CUDA platform (its EPLB check needs one)."""
    import vllm.config.parallel as parallel
    from vllm.config import ParallelConfig
    from vllm.config.parallel import EPLBConfig

    with mock.patch.object(type(parallel.current_platform), "is_cuda_alike", return_value=True):
        return ParallelConfig(
            tensor_parallel_size=config.tensor_parallel_size,
            data_parallel_size=config.data_parallel_size or 1,
            enable_expert_parallel=config.enable_expert_parallel,
            all2all_backend=config.all2all_backend or "allgather_reducescatter",
            enable_eplb=config.enable_eplb,
            eplb_config=EPLBConfig(**config.eplb.model_dump()),
            enable_dbo=config.enable_dbo,
        )


@pytest.mark.parametrize("case", ["EPLB without expert parallelism", "EPLB on one GPU", "EPLB settings without EPLB"])
def test_vllm_rejects_the_same_parallel_combinations(case):
    fields, _ = REJECTED[case]
    base = inference()
    eplb = base.eplb.model_copy(update=fields.get("eplb", {}))
    config = base.model_copy(update={**fields, "eplb": eplb})  # unvalidated: our checks would refuse it first
    with pytest.raises(ValueError):
        _vllm_parallel_config(config)


def test_accepted_wide_ep_options_pass_vllms_parallel_config():
    config = inference(
        **EP, all2all_backend="deepep_low_latency", enable_dbo=True, enable_eplb=True, eplb={"num_redundant_experts": 8}
    )
    parallel = _vllm_parallel_config(config)
    assert parallel.use_all2all and parallel.use_ubatching and parallel.eplb_config.num_redundant_experts == 8


@pytest.mark.parametrize(
    "offload",
    [{"cpu_gib": 4, "disk_dir": "/nvme/kv"}, {"backend": "mooncake", "mooncake": {"master_host": "10.0.0.1"}}],
)
def test_kv_transfer_configs_validate_with_vllms_config_class(offload):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    rendered = kv_transfer_config(KVCacheOffloadConfig.model_validate(offload))
    checked = KVTransferConfig(**json.loads(json.dumps(rendered)))
    assert checked.kv_connector in KVConnectorFactory._registry and checked.is_kv_transfer_instance


def test_disk_tier_names_vllms_tiering_spec_and_filesystem_tier():
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    extra = kv_transfer_config(KVCacheOffloadConfig(cpu_gib=2, disk_dir=Path("/nvme/kv")))["kv_connector_extra_config"]
    assert OffloadingSpecFactory.get_spec_cls(extra).__name__ == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == 2 << 30
    (tier,) = extra["secondary_tiers"]
    tier_cls = SecondaryTierFactory._registry[tier["type"]]()
    assert set(tier) - {"type"} <= set(inspect.signature(tier_cls.__init__).parameters)


def test_mooncake_client_config_loads_with_vllms_store_config(tmp_path, monkeypatch):
    from vllm.distributed.mooncake_store import MooncakeStoreConfig

    config = inference(kv_cache_offload={"backend": "mooncake", "mooncake": {"master_host": "node0", "segment_gib": 8}})
    env = setup_mooncake_config(config, tmp_path)
    monkeypatch.setenv(MOONCAKE_CONFIG_ENV, env[MOONCAKE_CONFIG_ENV])
    store = MooncakeStoreConfig.load_from_config()
    assert (store.master_server_address, store.metadata_server) == ("node0:50051", "http://node0:8080/metadata")
    assert (store.global_segment_size, store.protocol, store.mode) == (8 << 30, "rdma", "embedded")
    assert mooncake_master_argv(config.kv_cache_offload.mooncake)[:2] == ["mooncake_master", "--rpc_port=50051"]
    assert setup_mooncake_config(inference(kv_cache_offload={"cpu_gib": 4}), tmp_path) == {}


def test_deep_gemm_is_an_environment_switch():
    assert option_env(inference(quantization="fp8", deep_gemm=False)) == {
        "VLLM_USE_DEEP_GEMM": "0",
        "VLLM_MOE_USE_DEEP_GEMM": "0",
    }
    assert option_env(inference(quantization="fp8")) == {}


def test_config_error_names_the_field_under_rl(tmp_path):
    from slipstream.config.loader import load_config
    from slipstream.config.rl import RLConfig

    toml = tmp_path / "rl.toml"
    toml.write_text(
        'max_steps = 1\n[model]\nname = "m"\n[inference]\nall2all_backend = "deepep_low_latency"\n'
        "[orchestrator]\nbatch_size = 4\ngroup_size = 2\n[trainer]\n"
    )
    with pytest.raises(ConfigError, match=r"inference.enable_expert_parallel = true"):
        load_config(RLConfig, ["-c", str(toml)])
