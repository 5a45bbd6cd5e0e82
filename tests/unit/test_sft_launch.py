"""`slipstream sft` fits the machine (launch/sft.py): CUDA and bfloat16 where GPUs show, the CPU and float32 elsewhere
(explicit settings win); with several GPUs (or `num_procs`) it replaces itself with torchrun, one rank per GPU, on the
resolved config: the command is checked with torchrun's own parser, the config it writes loads back. Under torchrun,
or on one GPU or the CPU, it trains in this process. (2 CPU ranks through this path for real:
tests/distributed/test_sft_fsdp.py.)"""

import os
import sys

import pytest
import tomli_w

from slipstream.cli import main as cli_main
from slipstream.config.base import ConfigError
from slipstream.config.loader import load_config
from slipstream.config.sft import SFTConfig
from slipstream.launch import sft as sft_launch
from slipstream.launch.sft import build_sft_torchrun, resolve_sft_config, run_sft_command, sft_procs
from slipstream.launch.slurm_sft import render_sft_job


def _config(tmp_path, **fields) -> SFTConfig:
    (tmp_path / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    base = {
        "model": {"name": "org/tiny-model"},
        "data": {"train_files": [str(tmp_path / "train.jsonl")]},
        "output_dir": str(tmp_path / "run"),
        "max_steps": 2,
        "batch_size": 4,
        "micro_batch_tokens": 64,
    }
    path = tmp_path / "sft.toml"
    path.write_text(tomli_w.dumps(base | fields))
    return load_config(SFTConfig, ["-c", str(path)])


@pytest.mark.parametrize(
    ("fields", "gpus", "device", "dtype"),
    [
        ({}, [], "cpu", "float32"),
        ({}, [0, 1], "cuda", "bfloat16"),
        ({"model": {"name": "m", "dtype": "float32"}}, [0], "cuda", "float32"),  # asked: kept on GPUs
        ({"device": "cpu"}, [0, 1], "cpu", "float32"),
        ({"device": "cuda"}, [], "cuda", "bfloat16"),  # torch reports the missing GPU when the trainer starts
    ],
    ids=["CPU", "GPUs", "float32 asked", "CPU asked", "CUDA asked"],
)
def test_device_and_dtype_follow_the_machine_unless_set(tmp_path, fields, gpus, device, dtype):
    config = resolve_sft_config(_config(tmp_path, **fields), gpus)
    assert (config.device, config.model.dtype) == (device, dtype)
    assert config.trainer_config().model.dtype == dtype  # what setup_trainer computes in


def test_ranks_one_per_gpu_or_num_procs(tmp_path):
    def procs(gpus, **fields):
        return sft_procs(resolve_sft_config(_config(tmp_path, **fields), gpus), gpus)

    assert (procs([]), procs([0]), procs(list(range(4)))) == (1, 1, 4)
    assert (procs(list(range(4)), num_procs=2), procs([], num_procs=2)) == (2, 2)  # gloo ranks on the CPU if asked
    assert procs(list(range(4)), device="cpu") == 1  # on the CPU nothing changes
    with pytest.raises(ConfigError, match=r"num_procs = 8, but this machine shows 4 GPU\(s\)"):
        procs(list(range(4)), num_procs=8)


def test_the_torchrun_command_parses_and_its_config_loads_back(tmp_path):
    from torch.distributed.run import get_args_parser

    gpus = [2, 3, 5, 7]
    config = resolve_sft_config(_config(tmp_path, num_procs=3), gpus)
    argv, env = build_sft_torchrun(config, 3, gpus)
    written = tmp_path / "run" / "config" / "sft.toml"
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[-5:] == ["-m", "slipstream", "sft", "-c", str(written)]
    args = get_args_parser().parse_args(argv[3:])
    assert (args.standalone, args.nproc_per_node, args.module) == (True, "3", True)
    assert (args.training_script, args.training_script_args) == ("slipstream", ["sft", "-c", str(written)])
    assert env == {"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "2,3,5"}  # the first num_procs GPUs
    child = load_config(SFTConfig, ["-c", str(written)])
    assert (child.device, child.model.dtype, child.num_procs) == ("cuda", "bfloat16", None)
    assert child.model_copy(update={"num_procs": 3}) == config
    cpu = resolve_sft_config(_config(tmp_path, num_procs=2), [])
    assert build_sft_torchrun(cpu, 2, [])[1] == {"PYTHONUNBUFFERED": "1"}  # the environment's devices, untouched


@pytest.fixture
def launched(monkeypatch):
    """What run_sft_command did: the config it trained in this process, or the command it replaced itself with."""
    calls: dict = {}
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr("slipstream.trainer.sft.run_sft", lambda config: calls.setdefault("trained", config))
    monkeypatch.setattr(sft_launch, "_exec", lambda argv, env: calls.setdefault("exec", (argv, env)))
    return calls


def test_several_gpus_start_torchrun_and_one_trains_here(tmp_path, monkeypatch, launched):
    monkeypatch.setattr(sft_launch, "detect_visible_gpus", lambda: [0, 1])
    toml = tmp_path / "cli.toml"
    _config(tmp_path).write_toml(toml)
    assert cli_main(["sft", "-c", str(toml)]) == 0  # the command goes through the launcher
    argv, env = launched.pop("exec")
    assert argv[argv.index("--nproc-per-node") + 1] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["PATH"] == os.environ["PATH"] and "trained" not in launched
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank of that torchrun: trains, on CUDA in bfloat16
    assert run_sft_command(load_config(SFTConfig, ["-c", argv[-1]])) == 0
    assert launched.pop("trained").model.dtype == "bfloat16" and "exec" not in launched
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setattr(sft_launch, "detect_visible_gpus", lambda: [0])
    assert run_sft_command(_config(tmp_path)) == 0
    assert launched.pop("trained").device == "cuda" and "exec" not in launched


def test_on_the_cpu_nothing_changes(tmp_path, monkeypatch, launched):
    def no_detection():
        raise AssertionError("device = 'cpu' needs no GPU detection")

    monkeypatch.setattr(sft_launch, "detect_visible_gpus", no_detection)
    assert run_sft_command(_config(tmp_path, device="cpu")) == 0
    trained = launched.pop("trained")
    assert (trained.device, trained.model.dtype) == ("cpu", "float32") and not launched
    monkeypatch.setattr(sft_launch, "detect_visible_gpus", lambda: [])
    assert run_sft_command(_config(tmp_path)) == 0  # device "auto" on a machine without GPUs
    assert launched.pop("trained").model.dtype == "float32"


def test_a_failed_gpu_detection_is_an_error_not_a_traceback(tmp_path, monkeypatch, launched, capsys):
    from slipstream.launch.placement import PlacementError

    def broken():
        raise PlacementError("nvidia-smi failed (driver); set CUDA_VISIBLE_DEVICES (empty: CPU) or fix the driver")

    monkeypatch.setattr(sft_launch, "detect_visible_gpus", broken)
    assert run_sft_command(_config(tmp_path)) == 2
    assert "error: nvidia-smi failed" in capsys.readouterr().err and not launched


def test_a_slurm_node_config_leaves_the_dtype_to_the_node(tmp_path):
    slurm = {"num_nodes": 2, "gpus_per_node": 4}
    files = render_sft_job(_config(tmp_path, slurm=slurm))
    node = load_config(SFTConfig, ["-c", str(files.node_configs["sft"])])
    assert "dtype" not in node.model.model_fields_set  # each node resolves it: bfloat16 on its GPUs
    assert resolve_sft_config(node, [0, 1, 2, 3]).model.dtype == "bfloat16"
    files = render_sft_job(_config(tmp_path, slurm=slurm, model={"name": "m", "dtype": "float32"}))
    assert load_config(SFTConfig, ["-c", str(files.node_configs["sft"])]).model.dtype == "float32"
    with pytest.raises(ConfigError, match="a \\[slurm\\] job runs slurm.gpus_per_node ranks on each node"):
        _config(tmp_path, slurm=slurm, num_procs=2)
