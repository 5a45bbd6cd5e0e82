"""Colocated runs (deployment.colocate): when one GPU is shared, what the launcher resolves for each process, the
memory plan that sizes vLLM's share, and one clear error per impossible request. No GPU needed: tests pass the
visible GPU list and the GPU's memory."""

import json
import math
import struct
from pathlib import Path

import pytest

from slipstream.config import InferenceConfig
from slipstream.inference.server import build_vllm_argv
from slipstream.launch import plan as plan_module
from slipstream.launch.colocate_memory import (
    GIB,
    ModelShape,
    activation_bytes,
    model_parameters,
    oom_hint,
    plan_colocated,
)
from slipstream.launch.placement import PlacementError, place
from slipstream.launch.plan import resolve_config
from tests.unit.test_placement import rl

H200 = 143_771 * 2**20  # nvidia-smi's memory.total of an H200, in bytes
Q06 = ModelShape(vocab_size=151_936, hidden_size=1024, num_layers=28)  # Qwen3-0.6B's shape


def write_model(folder: Path, shapes: dict[str, list[int]]) -> Path:
    """A model folder: config.json of the 0.6B shape and a safetensors file declaring `shapes`."""
    write_safetensors(folder, shapes)
    (folder / "config.json").write_text(
        json.dumps({"vocab_size": 151936, "hidden_size": 1024, "num_hidden_layers": 28})
    )
    return folder


def write_safetensors(folder: Path, shapes: dict[str, list[int]]) -> Path:
    """A safetensors file whose header declares `shapes` (bf16); the data is zeros."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return folder


def test_one_gpu_with_every_process_here_is_colocated_with_ipc():
    placement = place(rl(), [3])
    assert placement.colocated
    assert placement.inference_gpus == placement.trainer_gpus == (3,)
    assert placement.weights_transport == "ipc" and placement.num_trainer_procs == 1
    assert placement.env("inference") == placement.env("trainer") == {"CUDA_VISIBLE_DEVICES": "3"}
    # two GPUs, a node running part of the run, or an explicit split: side by side, as before
    assert not place(rl(), [0, 1]).colocated
    part = rl(deployment={"run": ["inference", "trainer"]}, weights={"transport": "filesystem"})
    assert not place(part, [0, 1]).colocated
    assert not place(rl(), []).colocated


def test_explicit_colocate_shares_one_gpu_of_a_larger_node_and_runs_on_cpu_too():
    one = place(rl(deployment={"colocate": True, "gpus": [1]}), [0, 1])
    assert one.colocated and one.inference_gpus == one.trainer_gpus == (1,) and one.weights_transport == "ipc"
    with pytest.raises(PlacementError, match=r"2 are usable .* choose one with deployment.gpus = \[i\]"):
        place(rl(deployment={"colocate": True}), [0, 1])
    cpu = place(rl(deployment={"colocate": True}), [])
    assert cpu.colocated and cpu.weights_transport == "filesystem"
    assert place(rl(deployment={"colocate": True}, weights={"transport": "ipc"}), []).weights_transport == "ipc"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"deployment": {"colocate": True, "run": ["inference", "trainer"]}}, r"leaves out orchestrator"),
        ({"deployment": {"colocate": True, "trainer_gpus": 1}}, r"drop deployment.inference_gpus / deployment.trainer"),
        ({"deployment": {"sleep_level": 2}, "model": {"lora": {"rank": 8}}}, r"only the adapter is sent back"),
    ],
)
def test_impossible_colocation_is_refused_when_parsing(sections, message):
    with pytest.raises(ValueError, match=message):
        rl(**sections)


def test_nccl_cannot_join_two_processes_of_one_gpu():
    with pytest.raises(PlacementError, match=r"'nccl' cannot join vLLM and the trainer on the same GPU.*'ipc'"):
        place(rl(weights={"transport": "nccl"}), [0])


def test_resolved_config_tells_each_process(monkeypatch, tmp_path):
    model = write_model(tmp_path / "m", {"w": [1000, 1000]})
    monkeypatch.setattr(plan_module, "gpu_memory_bytes", lambda ids: H200)
    cfg = resolve_config(rl(model={"name": str(model)}, deployment={"sleep_level": 2}), [0])
    assert cfg.orchestrator.colocate is not None and cfg.orchestrator.colocate.sleep_level == 2
    assert cfg.trainer.colocated and cfg.inference.enable_sleep_mode and cfg.trainer.release_cached_memory
    assert cfg.weights.transport == "ipc" and cfg.inference.device == cfg.trainer.device == "cuda"
    assert cfg.inference.gpu_memory_utilization == 0.9  # a 1M-parameter model: vLLM's usual share, no more
    assert resolve_config(cfg, [0]) == cfg  # idempotent
    # level 0: vLLM keeps its memory, so no sleep mode; on CPU never (vLLM's CPU build refuses the flag)
    level0 = resolve_config(rl(model={"name": str(model)}, deployment={"sleep_level": 0}), [0])
    assert level0.trainer.colocated and not level0.inference.enable_sleep_mode
    assert not level0.trainer.release_cached_memory  # vLLM keeps its share: the trainer keeps its allocator's cache
    cpu = resolve_config(rl(model={"name": str(model)}, deployment={"colocate": True}), [])
    assert cpu.trainer.colocated and cpu.orchestrator.colocate is not None and not cpu.inference.enable_sleep_mode
    assert not cpu.trainer.release_cached_memory
    side_by_side = resolve_config(rl(model={"name": str(model)}), [0, 1])
    assert side_by_side.orchestrator.colocate is None and not side_by_side.trainer.colocated


def test_unknown_gpu_memory_needs_an_explicit_share(monkeypatch, tmp_path):
    model = write_model(tmp_path / "m", {"w": [10, 10]})
    monkeypatch.setattr(plan_module, "gpu_memory_bytes", lambda ids: None)
    with pytest.raises(PlacementError, match=r"nvidia-smi did not report; set inference.gpu_memory_utilization"):
        resolve_config(rl(model={"name": str(model)}), [0])
    cfg = resolve_config(rl(model={"name": str(model)}, inference={"gpu_memory_utilization": 0.4}), [0])
    assert cfg.inference.gpu_memory_utilization == 0.4


def test_model_parameters_come_from_the_safetensors_headers(tmp_path):
    folder = write_safetensors(tmp_path / "m", {"a": [3, 4], "b": [5], "c": [2, 2, 2]})
    assert model_parameters(folder) == 12 + 5 + 8
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        model_parameters(tmp_path)


def test_memory_plan_sizes_vllm_by_what_the_trainer_keeps():
    b = 10**9
    # 4B parameters: 16 bytes each in the trainer plus the 2-byte ipc buffer = 72 GB resident
    plan = plan_colocated(rl(), 4 * b, Q06, H200, 1)
    assert plan.trainer_bytes == 72 * b
    assert plan.utilization == 0.5  # (140.4 - 67.1 - 3) GiB / 140.4 GiB = 0.501, rounded down
    assert "trainer resident 67.1 GiB" in plan.summary()
    # bf16 AdamW moments: 4 bytes less per parameter, so vLLM gets more
    assert plan_colocated(rl(trainer={"optim": {"state_dtype": "bfloat16"}}), 4 * b, Q06, H200, 1).utilization == 0.6
    # level 0: vLLM stays awake, so the trainer's activations need room beside it
    awake = plan_colocated(rl(deployment={"sleep_level": 0}), 4 * b, Q06, H200, 1)
    assert awake.activation_bytes == activation_bytes(rl(), Q06) and awake.utilization < plan.utilization
    # a small model: vLLM's usual share, never more
    assert plan_colocated(rl(), b // 10, Q06, H200, 1).utilization == 0.9


def test_a_model_too_large_to_share_one_gpu_names_the_knobs():
    with pytest.raises(PlacementError, match=r"does not fit colocated on a 140 GiB GPU.*state_dtype = 'bfloat16'"):
        plan_colocated(rl(), 8 * 10**9, Q06, H200, 1)  # 8B: 144 GB resident in the trainer alone
    with pytest.raises(PlacementError, match=r"gpu_memory_utilization = 0.95 gives vLLM .* lower it to at most 0.9"):
        plan_colocated(rl(inference={"gpu_memory_utilization": 0.95}), 6 * 10**8, Q06, H200, 1)


def test_vllm_gets_sleep_mode_on_gpus_only(tmp_path):
    gpu = InferenceConfig(model={"name": "m"}, device="cuda", enable_sleep_mode=True)
    argv = build_vllm_argv(gpu, tmp_path)
    assert "--enable-sleep-mode" in argv and argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    with pytest.raises(ValueError, match="inference.enable_sleep_mode: vLLM's CPU build has no sleep mode"):
        build_vllm_argv(InferenceConfig(model={"name": "m"}, device="cpu", enable_sleep_mode=True), tmp_path)


def test_level_0_budgets_the_trainers_activations_beside_vllm():
    # measured on an H200: the 0.6B shape's trainer peaked at 82 GiB allocated with 16k-token micro-batches, and at
    # sleep_level 0 with vLLM planned beside a 2 GiB budget it ran out of memory; the budget now covers it
    tokens16k = rl(orchestrator={"micro_batch_tokens": 16384}, deployment={"sleep_level": 0})
    assert activation_bytes(tokens16k, Q06) > 82 * GIB
    assert activation_bytes(rl(trainer={"parallel": {"activation_checkpointing": True}}), Q06) < activation_bytes(
        rl(), Q06
    )
    plan = plan_colocated(tokens16k, 6 * 10**8, Q06, H200, 1)
    assert plan.utilization < 0.3
    with pytest.raises(
        PlacementError, match=r"at sleep_level 0 the trainer's activations .*deployment.sleep_level = 1"
    ):
        plan_colocated(
            rl(orchestrator={"micro_batch_tokens": 32768}, deployment={"sleep_level": 0}), 6 * 10**8, Q06, H200, 1
        )


def test_out_of_memory_hints_name_the_knobs_with_this_runs_values():
    trainer = oom_hint(rl(orchestrator={"micro_batch_tokens": 8192}), "trainer")
    assert "orchestrator.micro_batch_tokens (now 8192)" in trainer and "activation_checkpointing" in trainer
    colocated = rl(deployment={"sleep_level": 0}, trainer={"colocated": True})
    assert "deployment.sleep_level = 1 frees it" in oom_hint(colocated, "trainer")
    vllm = oom_hint(rl(inference={"gpu_memory_utilization": 0.7}, trainer={"colocated": True}), "inference")
    assert "inference.gpu_memory_utilization (now 0.7)" in vllm and "memory plan printed at the start" in vllm


def test_model_shape_reads_text_configs(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"vocab_size": 10, "hidden_size": 4, "num_hidden_layers": 2}})
    )
    assert ModelShape.read(tmp_path) == ModelShape(10, 4, 2)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    with pytest.raises(ValueError, match="lacks 'hidden_size'"):
        ModelShape.read(tmp_path)


class RecordingSupervisor:
    def __init__(self) -> None:
        self.events: list[str] = []

    def start(self, spec) -> None:
        self.events.append(f"start {spec.name}")


@pytest.mark.parametrize(("colocated", "device"), [(True, "cuda"), (False, "cuda"), (True, "cpu")])
def test_a_colocated_trainer_on_a_gpu_starts_once_vllm_has_sized_its_share(monkeypatch, colocated, device):
    from slipstream.launch import local
    from slipstream.launch.plan import ProcessSpec

    sup = RecordingSupervisor()
    monkeypatch.setattr(local, "wait_healthy", lambda s, url, timeout: sup.events.append("healthy"))
    config = rl(trainer={"colocated": colocated, "device": device}, inference={"device": device})
    specs = {n: ProcessSpec(n, [], Path(f"/tmp/{n}.log")) for n in ("inference", "trainer", "orchestrator")}
    local.start_processes(sup, specs, config, 0.0)
    if colocated and device == "cuda":  # vLLM checks the memory free at its start against its share
        assert sup.events == ["start inference", "healthy", "start trainer", "start orchestrator"]
    else:  # the trainer loads its model while vLLM starts
        assert sup.events == ["start inference", "start trainer", "healthy", "start orchestrator"]


def test_the_launcher_recognises_an_out_of_memory_in_this_start_of_a_child(tmp_path):
    from slipstream.launch.local import _out_of_memory
    from slipstream.launch.supervisor import ChildFailed

    log = tmp_path / "trainer.log"
    log.write_text("earlier start: torch.OutOfMemoryError: CUDA out of memory\n")
    offset = log.stat().st_size
    with log.open("a") as f:
        f.write("RuntimeError: something else\n")
    assert not _out_of_memory(ChildFailed("trainer", 1, log, offset))  # an earlier start's error does not count
    with log.open("a") as f:
        f.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 250.00 MiB.\n")
    assert _out_of_memory(ChildFailed("trainer", 1, log, offset))


def test_plan_colocate_says_which_sleep_levels_fit(tmp_path, capsys):
    from slipstream.planner.cli import main as plan_main

    model = write_model(tmp_path / "m", {"w": [100_000, 6_000]})  # 0.6B parameters of the 0.6B shape
    cfg = tmp_path / "rl.toml"
    cfg.write_text(f'max_steps = 1\n[model]\nname = "{model}"\n[orchestrator]\nmicro_batch_tokens = 16384\n')
    assert plan_main(["--colocate", "-c", str(cfg), "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    assert "colocated on 1 x H200 (139.8 GiB)" in out and "(0.60B parameters)" in out
    assert "sleep_level 1 (configured): fits; colocated memory plan" in out and "sleep_level 0: fits" in out
    # on an 80 GB H100 the trainer's activations of 16k-token micro-batches cannot sit beside an awake vLLM
    assert plan_main(["--colocate", "-c", str(cfg), "--gpu", "h100", "--deployment.sleep_level", "0"]) == 1
    assert "sleep_level 0 (configured): does not fit" in capsys.readouterr().out
    missing = tmp_path / "missing.toml"
    missing.write_text('max_steps = 1\n[model]\nname = "no/such-model"\n')
    assert plan_main(["--colocate", "-c", str(missing), "--gpu", "h200"]) == 2
    assert "is not on this machine" in capsys.readouterr().err
