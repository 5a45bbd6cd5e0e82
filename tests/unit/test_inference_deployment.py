"""inference.deployment: engine slots and ports per shape, config-time rejections, and every rendered vLLM command
(replicas, wide-EP head and headless ranks, NIXL prefill / decode) parsed by vLLM's own parser; the NIXL KV-transfer
config validated by vLLM's KVTransferConfig; the vllm-router command accepted by the installed router."""

from pathlib import Path

import pytest

from slipstream.config import RLConfig
from slipstream.config.inference import InferenceConfig
from slipstream.config.loader import deep_merge, validate_config
from slipstream.inference.deployment import NIXL_KV_TRANSFER_CONFIG, engine_commands, render_deployment, router_argv
from tests.unit.test_vllm_argv import BASE, parse_vllm_argv

MODEL = Path("/models/qwen3-30b-a3b")


def _inference(**fields) -> InferenceConfig:
    return InferenceConfig(model={"name": "Qwen/Qwen3-30B-A3B"}, **fields)


def test_single_replica_has_no_router_and_keeps_the_port():
    config = _inference()
    assert [e.port for e in config.engines] == [8000] and not config.uses_router
    assert config.engine_urls == ["http://127.0.0.1:8000"] and router_argv(config) is None


def test_replicas_sit_behind_the_router_on_the_next_ports():
    config = _inference(deployment={"num_replicas": 3})
    assert [e.port for e in config.engines] == [8001, 8002, 8003]
    argv = router_argv(config)
    assert argv is not None and argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--policy") + 1] == "consistent_hash"
    assert argv[argv.index("--worker-urls") + 1 :][:3] == config.engine_urls
    for command in engine_commands(config, MODEL):
        args, engine = parse_vllm_argv(command.argv)
        assert args.port == command.slot.port and engine.data_parallel_size == 1


def test_multi_node_replicas_on_every_node():
    config = _inference(deployment={"kind": "multi_node", "nodes": ["n0", "n1"], "num_replicas": 2})
    assert config.engine_urls == ["http://n0:8001", "http://n0:8002", "http://n1:8001", "http://n1:8002"]
    nodes = render_deployment(config, MODEL)
    assert [len(nodes[0]), len(nodes[1])] == [3, 2]  # the router on the head only
    for _env, argv in nodes[1]:
        parse_vllm_argv(argv)


def test_wide_ep_is_one_data_parallel_group_across_the_nodes():
    config = _inference(
        enable_expert_parallel=True,
        data_parallel_size=8,
        all2all_backend="deepep_low_latency",
        deployment={"kind": "multi_node", "nodes": ["n0", "n1", "n2"]},
    )
    assert not config.uses_router and config.engine_urls == ["http://n0:8000"]
    head, *others = engine_commands(config, MODEL)
    _, engine = parse_vllm_argv(head.argv)
    assert (engine.data_parallel_size, engine.data_parallel_size_local, engine.data_parallel_address) == (24, 8, "n0")
    assert engine.enable_expert_parallel and engine.all2all_backend == "deepep_low_latency"
    assert not getattr(parse_vllm_argv(head.argv)[0], "headless", False)
    for rank, command in enumerate(others, start=1):
        args, engine = parse_vllm_argv(command.argv)
        assert args.headless and engine.data_parallel_start_rank == 8 * rank
        assert engine.data_parallel_rpc_port == 13345 and engine.data_parallel_size == 24


def test_disaggregated_prefill_and_decode_over_nixl():
    config = _inference(
        deployment={
            "kind": "disaggregated",
            "nodes": ["n0", "n1"],
            "prefill": {
                "nodes": [0],
                "num_replicas": 2,
                "env": {"UCX_TLS": "rc"},
                "extra_args": ["--max-num-batched-tokens", "16384"],
            },
            "decode": {"nodes": [1], "env": {"VLLM_FOO": "1"}},
        }
    )
    commands = engine_commands(config, MODEL)
    assert [(c.slot.role, c.slot.host, c.slot.port) for c in commands] == [
        ("prefill", "n0", 8001), ("prefill", "n0", 8002), ("decode", "n1", 8001)
    ]  # fmt: skip
    from vllm.config import KVTransferConfig

    for command in commands:
        args, engine = parse_vllm_argv(command.argv)
        kv = engine.kv_transfer_config
        assert isinstance(kv, KVTransferConfig) and kv.kv_connector == "NixlConnector" and kv.is_kv_transfer_instance
        assert command.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == command.slot.host
    assert KVTransferConfig(**NIXL_KV_TRANSFER_CONFIG).kv_role == "kv_both"
    assert parse_vllm_argv(commands[0].argv)[1].max_num_batched_tokens == 16384
    assert parse_vllm_argv(commands[2].argv)[1].max_num_batched_tokens != 16384
    assert [c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for c in commands] == ["5600", "5601", "5600"]
    assert commands[0].env["UCX_TLS"] == "rc" and commands[2].env["VLLM_FOO"] == "1"
    argv = router_argv(config)
    assert argv is not None and "--vllm-pd-disaggregation" in argv
    assert (
        argv[argv.index("--prefill") + 1] == "http://n0:8001" and argv[argv.index("--decode") + 1] == "http://n1:8001"
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"deployment": {"nodes": ["a", "b"]}}, "single_node"),
        ({"deployment": {"prefill": {"num_replicas": 2}}}, "disaggregated"),
        ({"deployment": {"kind": "disaggregated", "num_replicas": 2}}, "num_replicas"),
        ({"deployment": {"kind": "disaggregated", "decode": {"nodes": [3]}}}, "decode.nodes"),
        ({"deployment": {"kind": "disaggregated"}, "kv_cache_offload": {}}, "kv_cache_offload"),
        ({"deployment": {"kind": "disaggregated", "prefill": {"extra_args": ["--kv-transfer-config={}"]}}}, "NIXL"),
        ({"deployment": {"kind": "disaggregated", "decode": {"extra_args": ["-tp", "2"]}}}, "tensor_parallel_size"),
        (
            {
                "enable_expert_parallel": True,
                "deployment": {"kind": "multi_node", "nodes": ["a", "b"], "num_replicas": 2},
            },
            "wide-EP",
        ),
        ({"deployment": {"kind": "multi_node", "nodes": ["a"], "node_rank": 1}}, "node_rank"),
    ],
)
def test_rejected_shapes_name_the_fix(fields, message):
    with pytest.raises(ValueError, match=message):
        _inference(**fields)


def test_rl_config_gives_the_orchestrator_every_engine_and_places_replicas_on_gpus():
    from slipstream.launch.plan import resolve_config

    config = validate_config(RLConfig, deep_merge(BASE, {"inference": {"deployment": {"num_replicas": 2}}}))
    assert config.orchestrator.inference_url == "http://127.0.0.1:8000"
    assert config.orchestrator.inference_engine_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    resolved = resolve_config(config, [0, 1, 2, 3]).inference  # 2 GPUs for inference: one per replica
    assert (resolved.tensor_parallel_size, resolved.data_parallel_size) == (1, 1)
    commands = engine_commands(resolved, MODEL, 0, on_gpu=True)
    assert [c.num_gpus for c in commands] == [1, 1]
    single = validate_config(RLConfig, BASE)
    assert single.orchestrator.inference_engine_urls == []


def test_the_installed_router_parses_the_rendered_commands():
    from vllm_router.launch_router import parse_router_args

    pd = router_argv(_inference(deployment={"kind": "disaggregated", "prefill": {"num_replicas": 2}}))
    assert pd is not None
    args = parse_router_args(pd[1:])  # the router's own parser (an unknown flag or value exits)
    assert args.vllm_pd_disaggregation and args.policy == "consistent_hash" and args.port == 8000
    assert [url for url, _ in args.prefill_urls] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert args.decode_urls == ["http://127.0.0.1:8003"]
    rr = router_argv(_inference(deployment={"num_replicas": 2, "router": {"policy": "round_robin"}}))
    assert rr is not None
    args = parse_router_args(rr[1:])
    assert args.policy == "round_robin" and args.worker_urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    with pytest.raises(SystemExit):
        parse_router_args([*rr[1:], "--no-such-flag"])
