"""Every example config parses with the config loader, places on a simulated node (CPU, or 8 GPUs: no GPU needed),
yields a plan, and renders a vLLM command line that vLLM's own parser accepts with the values the config asks for."""

from pathlib import Path

import pytest

from slipstream.config import RLConfig
from slipstream.config.eval import EvalConfig
from slipstream.config.loader import load_config
from slipstream.inference.server import build_vllm_argv
from slipstream.launch.plan import build_plan, resolve_config
from tests.unit.test_vllm_argv import parse_vllm_argv

ALL_RL = sorted(
    p for p in (Path(__file__).parents[2] / "examples").glob("**/*.toml") if not p.name.startswith(("sft", "eval"))
)
"""RL configs; `sft*.toml` are `slipstream sft` configs (tests/unit/test_sft_loop.py parses them), `eval*.toml`
`slipstream eval` configs (test_eval_examples_parse)."""
EVAL_EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("**/eval*.toml"))
SLURM_EXAMPLES = [p for p in ALL_RL if "[slurm]" in p.read_text()]
"""Multi-node jobs: each node's config is placed on its own 8 GPUs (test_slurm_examples_place_on_every_node)."""
EXAMPLES = [p for p in ALL_RL if p not in SLURM_EXAMPLES]
EIGHT_GPUS = list(range(8))


def nodes(path: Path) -> list[list[int]]:
    """Simulated GPU lists: GPU examples (with a [deployment] section) on 8 GPUs; CPU examples on CPU and 8 GPUs."""
    return [EIGHT_GPUS] if "[deployment]" in path.read_text() else [[], EIGHT_GPUS]


@pytest.mark.parametrize("path", EVAL_EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_eval_examples_parse(path):
    config = load_config(EvalConfig, ["-c", str(path)])
    assert config.inference.model == config.model and config.num_samples >= 1


def test_examples_are_found():
    names = {f"{p.parent.name}/{p.name}" for p in EXAMPLES}
    assert {"reverse_text/rl.toml", "reverse_text/rl-gpu.toml", "qwen3_30b_a3b/rl.toml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_example_parses_places_and_renders(path, tmp_path, monkeypatch):
    config = load_config(RLConfig, ["-c", str(path), "--output-dir", str(tmp_path / "run")])
    if config.deployment.colocate:  # the memory plan reads the GPU (an H200 here) and the model (SmolLM2's size)
        from slipstream.launch import plan as plan_module
        from slipstream.launch.colocate_memory import ModelShape

        monkeypatch.setattr(plan_module, "gpu_memory_bytes", lambda ids: 143_771 * 2**20)
        monkeypatch.setattr(plan_module, "model_parameters", lambda folder: 134_515_008)
        monkeypatch.setattr(ModelShape, "read", classmethod(lambda cls, folder: cls(49_152, 576, 30)))
    for visible in nodes(path):
        resolved = resolve_config(config, visible)
        specs = {spec.name: spec for spec in build_plan(resolved, gpus=visible)}
        assert set(specs) == set(resolved.deployment.run)
        trainer = specs["trainer"].argv
        assert int(trainer[trainer.index("--nproc-per-node") + 1]) == resolved.launch.num_trainer_procs
        default = "bfloat16" if visible else "float32"  # when the example leaves model.dtype unset
        expected = config.model.dtype if "dtype" in config.model.model_fields_set else default
        assert resolved.model.dtype == expected
        transport = config.weights.transport if "transport" in config.weights.model_fields_set else None
        auto = ("ipc" if resolved.trainer.colocated else "nccl") if visible else "filesystem"
        assert resolved.weights.transport == (transport or auto)
        if "inference" not in specs:  # served from elsewhere (orchestrator.inference_url), e.g. count_shapes' stand-in
            assert resolved.orchestrator.inference_url is not None
            continue
        argv = build_vllm_argv(resolved.inference, Path("/models/example"))
        _, engine = parse_vllm_argv(argv)
        assert engine.tensor_parallel_size * engine.data_parallel_size == max(len(resolved_ids(specs)), 1)
        assert engine.dtype == expected
        sleeps = resolved.trainer.colocated and bool(visible) and resolved.deployment.sleep_level >= 1
        assert engine.enable_sleep_mode == sleeps == resolved.trainer.release_cached_memory


def resolved_ids(specs) -> list[str]:
    ids = specs["inference"].env.get("CUDA_VISIBLE_DEVICES", "")
    return [i for i in ids.split(",") if i]


def test_gpu_examples_place_as_documented(tmp_path):
    root = Path(__file__).parents[2] / "examples"
    small = resolve_config(load_config(RLConfig, ["-c", str(root / "reverse_text/rl-gpu.toml")]), [0, 1])
    specs = {spec.name: spec for spec in build_plan(small, gpus=[0, 1])}
    assert (specs["inference"].env["CUDA_VISIBLE_DEVICES"], specs["trainer"].env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert small.model.name == "Qwen/Qwen3-0.6B" and small.model.dtype == "bfloat16"
    moe = resolve_config(load_config(RLConfig, ["-c", str(root / "qwen3_30b_a3b/rl.toml")]), EIGHT_GPUS)
    specs = {spec.name: spec for spec in build_plan(moe, gpus=EIGHT_GPUS)}
    assert specs["inference"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "2,3,4,5,6,7"
    assert (moe.launch.num_trainer_procs, moe.trainer.parallel.ep, moe.trainer.model_impl) == (6, 2, "custom")
    _, engine = parse_vllm_argv(build_vllm_argv(moe.inference, Path("/models/qwen3-30b-a3b")))
    assert (engine.tensor_parallel_size, engine.data_parallel_size, engine.enable_expert_parallel) == (1, 2, True)


@pytest.mark.parametrize("path", SLURM_EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_slurm_examples_place_on_every_node(path, tmp_path):
    """The job renders; every node's config, loaded with the hostnames its node script passes, places on 8 GPUs,
    and each inference node's vLLM command lines parse under vLLM's own parser."""
    from slipstream.inference.deployment import engine_commands
    from slipstream.launch.slurm import render_job

    config = load_config(RLConfig, ["-c", str(path), "--output-dir", str(tmp_path / "run")])
    slurm = config.slurm
    files = render_job(config)
    hosts = [f"node-{k}" for k in range(slurm.num_nodes)]
    first_trainer = hosts[slurm.num_inference_nodes]
    overrides = ["--inference.deployment.nodes", str(hosts[: slurm.num_inference_nodes]).replace("'", '"')]
    overrides += ["--orchestrator.inference_url", f"http://{hosts[0]}:{config.inference.port}"]
    overrides += ["--weights.master_addr", first_trainer, "--launch.trainer_master_addr", first_trainer]
    ranks = 0
    for role, node_config in files.node_configs.items():
        node = resolve_config(load_config(RLConfig, ["-c", str(node_config), *overrides]), EIGHT_GPUS)
        specs = {spec.name: spec for spec in build_plan(node, gpus=EIGHT_GPUS)}
        assert set(specs) == set(node.deployment.run), role
        if "trainer" in specs:
            ranks += node.launch.num_trainer_procs
            assert node.launch.trainer_nodes == slurm.trainer_nodes
        if "inference" in specs:
            rank = node.inference.deployment.node_rank
            commands = engine_commands(node.inference, Path("/models/example"), rank, True)
            assert sum(c.num_gpus for c in commands) == len(EIGHT_GPUS), role
            for command in commands:
                parse_vllm_argv(command.argv)
        if "orchestrator" in specs:  # a batch for every rank of every trainer node; requests to the head's router
            assert node.orchestrator.num_trainer_ranks == slurm.trainer_nodes * 8 // config.trainer.parallel.cp
            assert node.orchestrator.inference_url == f"http://{hosts[0]}:{config.inference.port}"
    assert ranks == slurm.trainer_nodes * len(EIGHT_GPUS)
