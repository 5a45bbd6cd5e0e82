"""GPU placement on one node: splits for 1-8 GPUs, explicit ids, single-role nodes, what the launcher resolves from
the placement, and one clear error per impossible request. No GPU needed: tests pass the visible GPU list."""

import json

import pytest

from slipstream.config import ConfigError, InferenceConfig, RLConfig
from slipstream.config.loader import deep_merge, validate_config
from slipstream.launch.placement import PlacementError, detect_visible_gpus, place
from slipstream.launch.plan import build_plan, resolve_config, write_configs

BASE = {"max_steps": 2, "model": {"name": "some-model"}, "orchestrator": {"batch_size": 8, "group_size": 4}}


def rl(**sections) -> RLConfig:
    """An RLConfig from BASE plus nested tables, e.g. rl(deployment={"gpus": [0, 1]})."""
    return validate_config(RLConfig, deep_merge(BASE, sections))


def split(config: RLConfig, visible: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    placement = place(config, visible)
    return placement.inference_gpus, placement.trainer_gpus


@pytest.mark.parametrize(
    ("visible", "inference", "trainer", "dp"),
    [
        ([0, 1], (0,), (1,), 1),
        ([0, 1, 2], (0,), (1, 2), 1),
        ([0, 1, 2, 3], (0, 1), (2, 3), 2),
        (list(range(8)), (0, 1, 2, 3), (4, 5, 6, 7), 4),
        ([4, 5, 6, 7], (4, 5), (6, 7), 2),  # the launcher's own CUDA_VISIBLE_DEVICES ids are kept
    ],
)
def test_default_split_half_and_half(visible, inference, trainer, dp):
    placement = place(rl(), visible)
    assert (placement.inference_gpus, placement.trainer_gpus) == (inference, trainer)
    assert (placement.tensor_parallel_size, placement.data_parallel_size) == (1, dp)
    assert placement.num_trainer_procs == len(trainer)
    assert placement.weights_transport == "nccl"
    assert placement.env("inference") == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, inference))}
    assert placement.env("trainer") == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, trainer))}
    assert placement.env("orchestrator") == {"CUDA_VISIBLE_DEVICES": ""}


def test_cpu_node_leaves_the_environment_alone():
    placement = place(rl(), [])
    assert (placement.inference_gpus, placement.trainer_gpus, placement.num_trainer_procs) == ((), (), 1)
    assert placement.env("inference") == placement.env("trainer") == {}
    assert placement.weights_transport == "filesystem"


def test_cpu_requested_on_a_gpu_node_hides_the_gpus():
    placement = place(rl(deployment={"gpus": []}), [0, 1])
    assert placement.env("trainer") == placement.env("inference") == {"CUDA_VISIBLE_DEVICES": ""}
    assert placement.num_trainer_procs == 1 and placement.weights_transport == "filesystem"


def test_tensor_and_data_parallel_fill_the_inference_gpus():
    cfg = rl(inference={"tensor_parallel_size": 2})
    placement = place(cfg, list(range(8)))
    assert (placement.tensor_parallel_size, placement.data_parallel_size) == (2, 2)
    cfg = rl(inference={"tensor_parallel_size": 2, "data_parallel_size": 2}, deployment={"inference_gpus": 4})
    assert place(cfg, list(range(6))).trainer_gpus == (4, 5)


def test_explicit_lists_and_counts():
    cfg = rl(deployment={"inference_gpus": [3], "trainer_gpus": [0, 1]}, launch={"num_trainer_procs": 2})
    assert split(cfg, [0, 1, 2, 3]) == ((3,), (0, 1))
    assert split(rl(deployment={"inference_gpus": 1}), [0, 1, 2, 3]) == ((0,), (1, 2, 3))
    assert split(rl(deployment={"trainer_gpus": 1}), [0, 1, 2, 3]) == ((0, 1, 2), (3,))
    assert split(rl(deployment={"trainer_gpus": [0]}), [0, 1, 2]) == ((1, 2), (0,))  # a count or the rest
    cfg = rl(deployment={"gpus": [2, 3], "inference_gpus": 1, "trainer_gpus": 1})
    assert split(cfg, [0, 1, 2, 3]) == ((2,), (3,))


@pytest.mark.parametrize("visible", [[0], [0, 1], [0, 1, 2, 3], list(range(8))])
def test_single_role_nodes_take_every_gpu(visible):
    trainer_node = rl(
        deployment={"run": ["trainer", "orchestrator"]},
        weights={"transport": "nccl", "master_addr": "10.0.0.2"},
        orchestrator={"inference_url": "http://10.0.0.1:8000"},
    )
    placement = place(trainer_node, visible)
    assert placement.trainer_gpus == tuple(visible) and placement.inference_gpus == ()
    assert placement.num_trainer_procs == len(visible)
    specs = build_plan(trainer_node, gpus=visible)
    assert [s.name for s in specs] == ["trainer", "orchestrator"]
    assert specs[0].argv[specs[0].argv.index("--nproc-per-node") + 1] == str(len(visible))
    inference_node = rl(deployment={"run": ["inference"]}, weights={"transport": "nccl", "master_addr": "10.0.0.2"})
    placement = place(inference_node, visible)
    assert placement.inference_gpus == tuple(visible) and placement.data_parallel_size == len(visible)
    assert [s.name for s in build_plan(inference_node, gpus=visible)] == ["inference"]


def test_plan_pins_each_child_and_sizes_torchrun():
    specs = {s.name: s for s in build_plan(rl(), gpus=list(range(8)))}
    assert specs["inference"].env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert specs["trainer"].argv[specs["trainer"].argv.index("--nproc-per-node") + 1] == "4"
    assert specs["orchestrator"].env == {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_resolve_fills_what_the_placement_decides(tmp_path):
    cfg = rl(output_dir=str(tmp_path / "run"), trainer={"parallel": {"cp": 2}})
    assert cfg.launch.num_trainer_procs is None and cfg.model.dtype == "float32"
    gpu = resolve_config(cfg, list(range(8)))
    assert gpu.model.dtype == gpu.trainer.model.dtype == gpu.inference.model.dtype == "bfloat16"
    assert gpu.launch.num_trainer_procs == 4 and gpu.orchestrator.num_trainer_ranks == 2  # 4 ranks / cp 2
    assert gpu.inference.data_parallel_size == 4 and gpu.inference.device == gpu.trainer.device == "cuda"
    assert gpu.weights.transport == gpu.trainer.weights.transport == gpu.inference.weights.transport == "nccl"
    assert resolve_config(gpu, list(range(8))) == gpu  # idempotent
    paths = write_configs(gpu)
    assert InferenceConfig.model_validate_json(gpu.inference.model_dump_json()).device == "cuda"
    assert 'transport = "nccl"' in paths["trainer"].read_text()
    explicit = resolve_config(rl(model={"name": "m", "dtype": "float32"}), [0, 1])
    assert explicit.model.dtype == "float32"  # set by the user: kept
    cpu = resolve_config(rl(), [])
    assert (cpu.model.dtype, cpu.weights.transport, cpu.trainer.device, cpu.launch.num_trainer_procs) == (
        "float32",
        "filesystem",
        "cpu",
        1,
    )


def test_detect_visible_gpus_reads_cuda_visible_devices():
    assert detect_visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5, 6"}) == [4, 5, 6]
    assert detect_visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert detect_visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,2"}) == [0]  # CUDA stops at an invalid entry
    with pytest.raises(PlacementError, match="CUDA_VISIBLE_DEVICES holds 'GPU-8f2e'.*list indices"):
        detect_visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f2e"})


@pytest.mark.parametrize(
    ("sections", "visible", "message"),
    [
        (
            {"deployment": {"colocate": False}},
            [0],
            r"inference and the trainer each need their own GPU, but 1 is usable.*deployment.colocate = true",
        ),
        ({"deployment": {"gpus": [0, 5]}}, [0, 1], r"deployment.gpus lists GPU\(s\) \[5\], but this node shows"),
        ({"deployment": {"inference_gpus": 3}}, [0, 1], r"deployment.inference_gpus asks for 3 GPUs, but only 2"),
        ({"deployment": {"trainer_gpus": [7]}}, [0, 1], r"deployment.trainer_gpus lists GPU\(s\) \[7\] that are not"),
        ({"deployment": {"inference_gpus": 2}}, [0, 1], r"no GPU is left for the trainer"),
        ({"deployment": {"trainer_gpus": 1}}, [], r"deployment.trainer_gpus asks for GPUs, but this node shows none"),
        (
            {"inference": {"tensor_parallel_size": 2, "data_parallel_size": 1}},
            list(range(8)),
            r"tensor_parallel_size \(2\) x inference.data_parallel_size \(1\) = 2 must equal the 4 GPUs inference",
        ),
        (
            {"inference": {"tensor_parallel_size": 3}},
            [0, 1, 2, 3],
            r"tensor_parallel_size \(3\) must divide the 2 GPUs",
        ),
        (
            {"launch": {"num_trainer_procs": 2}},
            list(range(8)),
            r"launch.num_trainer_procs \(2\) must equal the trainer's 4 GPUs .*deployment.trainer_gpus = 2",
        ),
        ({"weights": {"transport": "nccl"}}, [], r"'nccl' needs GPUs, but the trainer runs on CPU here"),
        ({"trainer": {"device": "cuda"}}, [], r"trainer.device = 'cuda', but the trainer gets no GPU"),
        ({"model": {"name": "m", "lora": {"rank": 8}}}, [0, 1], r"model.lora with model.dtype = 'float32' cannot run"),
    ],
)
def test_impossible_splits_say_what_to_change(sections, visible, message):
    with pytest.raises(PlacementError, match=message):
        resolve_config(rl(**sections), visible)


def test_lora_in_float32_runs_on_cpu_and_in_bfloat16_on_gpus():
    """vLLM's GPU LoRA kernels refuse float32; its CPU build and bfloat16 on GPUs take the adapter."""
    assert place(rl(model={"name": "m", "lora": {"rank": 8}}), []).inference_gpus == ()
    lora_bf16 = rl(model={"name": "m", "dtype": "bfloat16", "lora": {"rank": 8}})
    assert place(lora_bf16, [0, 1]).inference_gpus == (0,)
    trainer_only = rl(
        model={"name": "m", "lora": {"rank": 8}},
        deployment={"run": ["trainer", "orchestrator"]},
        weights={"transport": "filesystem"},
    )
    assert place(trainer_only, [0, 1]).trainer_gpus == (0, 1)  # vLLM elsewhere: its dtype is its own node's check


def test_tensor_parallel_must_divide_the_attention_heads(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 6, "num_key_value_heads": 2}))
    cfg = rl(model={"name": str(model)}, inference={"tensor_parallel_size": 4})
    with pytest.raises(PlacementError, match=r"tensor_parallel_size \(4\) must divide the model's 6 attention heads"):
        resolve_config(cfg, list(range(8)))
    assert resolve_config(cfg.rebuilt({"inference": {"tensor_parallel_size": 2}}), [0, 1, 2, 3]).inference


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"deployment": {"inference_gpus": [0, 1], "trainer_gpus": [1, 2]}},
            r"deployment.inference_gpus and deployment.trainer_gpus share GPU\(s\) \[1\]",
        ),
        ({"deployment": {"trainer_gpus": [0, 0]}}, r"deployment.trainer_gpus lists a GPU twice"),
        ({"deployment": {"inference_gpus": 0}}, r"deployment.inference_gpus must be a GPU count >= 1"),
        ({"deployment": {"gpus": [0, -1]}}, r"deployment.gpus lists a negative GPU id"),
        ({"deployment": {"gpus": [0, 1], "inference_gpus": [2]}}, r"lists GPU\(s\) \[2\] that deployment.gpus"),
        ({"deployment": {"gpus": [], "trainer_gpus": 1}}, r"deployment.gpus = \[\] runs on CPU"),
        ({"deployment": {"run": []}}, r"deployment.run must list each"),
        ({"deployment": {"run": ["inference"]}}, r"every node must agree on how weights travel"),
        (
            {
                "deployment": {"run": ["trainer", "orchestrator"]},
                "weights": {"transport": "nccl"},
                "orchestrator": {"inference_url": "http://10.0.0.3:8000"},
            },
            r"set weights.master_addr to the trainer node's address",
        ),
        (
            {"deployment": {"run": ["orchestrator"]}, "weights": {"transport": "filesystem"}},
            r"set launch.num_trainer_procs to the trainer node's number of ranks",
        ),
        ({"deployment": {"gpus": []}, "weights": {"transport": "nccl"}}, r"'nccl' needs GPUs, but deployment.gpus"),
        ({"inference": {"extra_args": ["--tensor-parallel-size=2"]}}, r"use inference.tensor_parallel_size instead"),
        ({"trainer": {"weights": {"transport": "gloo"}}}, r"trainer.weights differs from the top-level weights"),
    ],
)
def test_config_rejects_impossible_requests(sections, message):
    with pytest.raises(ConfigError, match=message):
        rl(**sections)


def test_collective_weights_between_roles_on_one_machine_need_no_master_addr():
    config = rl(
        deployment={"run": ["trainer", "orchestrator"]},
        weights={"transport": "gloo"},
        orchestrator={"inference_url": "http://127.0.0.1:8123"},
    )
    assert config.weights.master_addr == "127.0.0.1"  # inference is reached on loopback: the store is too


def test_a_trainer_across_nodes_gets_a_static_rendezvous_and_every_node_counted():
    """launch.trainer_nodes = 2: torchrun on each trainer node with its rank and node 0's address; the orchestrator
    writes one batch per rank of every node; the second node runs only its trainer ranks, logging beside node 0's."""
    common = {"trainer_nodes": 2, "trainer_master_addr": "10.0.0.5", "trainer_master_port": 29411}
    first = rl(deployment={"run": ["trainer", "orchestrator"]}, launch=common, weights={"transport": "filesystem"})
    gpus = [0, 1, 2, 3]
    resolved = resolve_config(first, gpus)
    assert resolved.orchestrator.num_trainer_ranks == 2 * 4  # 4 GPUs on each of the 2 nodes
    (trainer, _) = build_plan(resolved, gpus=gpus)
    args = trainer.argv[trainer.argv.index("torch.distributed.run") + 1 : trainer.argv.index("--nproc-per-node")]
    assert args == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.5", "--master-port", "29411"]
    assert trainer.log_path.name == "trainer.log"
    second = rl(
        deployment={"run": ["trainer"]}, launch={**common, "trainer_node_rank": 1}, weights={"transport": "filesystem"}
    )
    (trainer,) = build_plan(resolve_config(second, gpus), gpus=gpus)
    assert trainer.argv[trainer.argv.index("--node-rank") + 1] == "1" and trainer.log_path.name == "trainer_node1.log"
    assert "--standalone" in build_plan(rl(), gpus=list(range(8)))[1].argv  # one trainer node


@pytest.mark.parametrize(
    ("launch", "run", "message"),
    [
        ({"trainer_nodes": 2, "trainer_node_rank": 2}, ["trainer"], r"launch.trainer_node_rank \(2\) must be below"),
        (
            {"trainer_nodes": 2, "trainer_node_rank": 1},
            ["trainer", "orchestrator"],
            r"set deployment.run = \['trainer'\]",
        ),
    ],
)
def test_trainer_node_mistakes_name_the_field(launch, run, message):
    with pytest.raises(ConfigError, match=message):
        rl(deployment={"run": run}, launch=launch, weights={"transport": "filesystem"})
