"""Every command in README.md's ```bash blocks is run or checked, so the five-minute start cannot rot unseen:
- cheap CPU commands run for real (`slipstream doctor`; the Slurm quickstart on the Slurm example: `--dry-run` writes
  the job, the submitting forms run up to the sbatch call, which a PATH without Slurm refuses);
- `make demo` and `make test` are Makefile targets whose dry run (`make -n`) runs the README's commands, on
  configs that load and place on this CPU machine;
- `pip install -e ".[gpu]"` names the extra holding the supported vLLM range;
- the GPU runs are loaded and placed on a simulated node of 2 GPUs (vLLM on one, the trainer on the other), their vLLM
  command line parsed by vLLM's own parser;
- `docker build` builds the Dockerfile (linted by tests/unit/test_dockerfile.py) under the tag Kubernetes uses.
A command no check claims fails test_every_readme_command_is_claimed: a new command needs a check here."""

import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from slipstream.config.sft import SFTConfig
from slipstream.inference.server import build_vllm_argv
from slipstream.inference.vllm_support import SUPPORTED_RANGE
from slipstream.launch.plan import build_plan, resolve_config
from slipstream.launch.sft import resolve_sft_config
from tests.unit.test_vllm_argv import parse_vllm_argv

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SLURM_EXAMPLE = "examples/qwen3_30b_a3b/slurm.toml"
"""What the Slurm quickstart's `rl.toml` stands for: the README names it as the example of a run with [slurm]."""
GPU_NODE = [0, 1]
"""The README's GPU node: 2 GPUs."""


def readme_commands() -> list[list[str]]:
    """The commands of README.md's bash blocks, as tokens (comments dropped), in order."""
    blocks = re.findall(r"^```bash\n(.*?)^```", README.read_text(), flags=re.M | re.S)
    return [tokens for block in blocks for line in block.splitlines() if (tokens := shlex.split(line, comments=True))]


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "slipstream", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def check_make(tokens: list[str], tmp_path: Path) -> None:
    """A Makefile target (with the README's variables) whose dry run runs what the README says it runs."""
    target, *variables = tokens[1:]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.M), f"no `{target}` target in the Makefile"
    assert all(re.search(rf"^{v.split('=')[0]} \??=", makefile, flags=re.M) for v in variables), variables
    argv = ["make", "-n", target, f"VENV={tmp_path / 'venv'}", *variables]
    dry = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    assert dry.returncode == 0, dry.stderr
    venv_python = f"{tmp_path / 'venv'}/bin/python"
    assert f"{venv_python} -m pip install" in dry.stdout  # creates .venv and installs what it needs
    if target == "demo":  # SFT then RL on the reverse-text examples, which run on this CPU machine
        assert f"{venv_python} -m slipstream sft -c examples/reverse_text/sft.toml" in dry.stdout
        assert f"{venv_python} -m slipstream rl -c examples/reverse_text/rl.toml" in dry.stdout
        sft = resolve_sft_config(load_config(SFTConfig, ["-c", "examples/reverse_text/sft.toml"]), [])
        assert (sft.device, sft.model.dtype) == ("cpu", "float32")
        rl = resolve_config(load_config(RLConfig, ["-c", "examples/reverse_text/rl.toml"]), [])
        assert rl.model.dtype == "float32" and rl.inference.enforce_eager and rl.weights.transport == "filesystem"
    if target == "test":
        assert f'{venv_python} -m pytest tests -q -m "not gpu"' in dry.stdout
    if (
        target == "demo-gpu"
    ):  # the GPU build; SFT on CUDA, then the 2-GPU example (tests/unit/test_makefile.py: the chain)
        assert '-m pip install -q -e ".[gpu]"' in dry.stdout and "--device cuda" in dry.stdout
        assert f"{venv_python} -m slipstream rl -c examples/reverse_text/rl-gpu-smollm2.toml" in dry.stdout
        place_gpu_example(["slipstream", "rl", "-c", "examples/reverse_text/rl-gpu-smollm2.toml"], tmp_path)


def check_pip_install(tokens: list[str], tmp_path: Path) -> None:
    """`pip install -e ".[EXTRA]"`: the extra exists; `gpu` holds the vLLM range Slipstream supports."""
    assert tokens[:3] == ["pip", "install", "-e"] and len(tokens) == 4
    extra = re.fullmatch(r"\.\[(\w+)\]", tokens[3]).group(1)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras
    if extra == "gpu":
        assert extras["gpu"] == [f"vllm{SUPPORTED_RANGE}"]


def run_doctor(tokens: list[str], tmp_path: Path) -> None:
    """Runs for real: one line per check (exit 1 only when a check FAILs on this machine)."""
    proc = _cli(*tokens[1:])
    assert proc.returncode in (0, 1), proc.stderr
    checks = {line.split()[1] for line in proc.stdout.splitlines() if line.split()[:1] in (["OK"], ["WARN"], ["FAIL"])}
    assert {"python", "torch", "vllm", "sandbox", "disk", "ports"} <= checks, proc.stdout


def place_gpu_example(tokens: list[str], tmp_path: Path) -> None:
    """Loaded and placed on the README's 2-GPU node: vLLM on GPU 0, the trainer on GPU 1, NCCL weight updates,
    bfloat16, CUDA graphs; vLLM's own parser reads the command line back."""
    config = load_config(RLConfig, [*tokens[2:], "--output-dir", str(tmp_path / "run")])
    resolved = resolve_config(config, GPU_NODE)
    specs = {spec.name: spec for spec in build_plan(resolved, gpus=GPU_NODE)}
    assert specs["inference"].env["CUDA_VISIBLE_DEVICES"] == "0" and specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert (resolved.weights.transport, resolved.model.dtype, resolved.inference.enforce_eager) == (
        "nccl",
        "bfloat16",
        False,
    )
    assert resolved.checkpoint.interval > 0  # `--resume` after a crash continues, it does not start over
    _, engine = parse_vllm_argv(build_vllm_argv(resolved.inference, Path("/models/example")))
    assert (engine.dtype, engine.enforce_eager, engine.tensor_parallel_size) == ("bfloat16", False, 1)


def place_colocated_example(tokens: list[str], tmp_path: Path) -> None:
    """Loaded and placed on a one-GPU node (an H200, the example's SmolLM2 sized from its parameter count): vLLM and
    the trainer both on GPU 0, weights through CUDA IPC, sleep level 0 (no sleep mode; the trainer keeps its cache)
    and vLLM's share what the memory plan leaves beside the trainer's state and activations; vLLM's own parser reads
    the command line back."""
    from slipstream.launch import plan as plan_module
    from slipstream.launch.colocate_memory import ModelShape

    config = load_config(RLConfig, [*tokens[2:], "--output-dir", str(tmp_path / "run")])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "gpu_memory_bytes", lambda ids: 143_771 * 2**20)
        mp.setattr(plan_module, "model_parameters", lambda folder: 134_515_008)
        mp.setattr(ModelShape, "read", classmethod(lambda cls, folder: cls(49_152, 576, 30)))
        resolved = resolve_config(config, [0])
        specs = {spec.name: spec for spec in build_plan(resolved, gpus=[0])}
    assert specs["inference"].env["CUDA_VISIBLE_DEVICES"] == specs["trainer"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert resolved.weights.transport == "ipc" and resolved.trainer.colocated
    assert resolved.orchestrator.colocate is not None and resolved.orchestrator.colocate.sleep_level == 0
    assert not resolved.trainer.release_cached_memory
    assert resolved.inference.gpu_memory_utilization == 0.72  # 143.8 GB less the trainer, its activations, a reserve
    _, engine = parse_vllm_argv(build_vllm_argv(resolved.inference, Path("/models/example")))
    assert not engine.enable_sleep_mode and engine.gpu_memory_utilization == 0.72


def run_slurm_quickstart(tokens: list[str], tmp_path: Path) -> None:
    """`rl.toml` is the Slurm example. `--dry-run` writes the job and prints the sbatch command; the submitting forms
    write it too and stop at sbatch, which a PATH without Slurm lacks; `--resume` reaches every node's config."""
    args = ["-c" if t == "-c" else (SLURM_EXAMPLE if t == "rl.toml" else t) for t in tokens[2:]]
    out = tmp_path / "run"
    env = {**os.environ, "PATH": str(tmp_path / "no-slurm-here")}
    proc = _cli("rl", *args, "--output-dir", str(out), env=env)
    job = out / "slurm" / "job.sbatch"
    assert job.is_file() and (out / "slurm" / "node.sh").is_file(), proc.stdout + proc.stderr
    if "--dry-run" in args:
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == f"sbatch --parsable {job}"
        return
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr, proc.stderr
    node = load_config(RLConfig, ["-c", str(out / "slurm" / "node_trainer.toml")])
    assert node.resume == ("--resume" in args) and node.checkpoint.interval > 0


def check_docker_build(tokens: list[str], tmp_path: Path) -> None:
    """Not built here (no Docker daemon): the Dockerfile at the context's root, tagged as [kubernetes] image's default."""
    from slipstream.config.kubernetes import KubernetesConfig

    assert tokens[:3] == ["docker", "build", "-t"] and tokens[4:] == ["."]
    assert tokens[3] == KubernetesConfig().image and (ROOT / "Dockerfile").is_file()


def claim(tokens: list[str]) -> Callable[[list[str], Path], None] | None:
    """The check of a README command, or None."""
    match tokens:
        case ["make", _, *variables] if all("=" in v for v in variables):
            return check_make
        case ["pip", "install", "-e", _]:
            return check_pip_install
        case ["slipstream", "doctor"]:
            return run_doctor
        case ["docker", "build", "-t", _, "."]:
            return check_docker_build
        case ["slipstream", "rl", "-c", path] if (
            path.startswith("examples/") and "colocate = true" in (ROOT / path).read_text()
        ):
            return place_colocated_example
        case ["slipstream", "rl", "-c", path] if (
            path.startswith("examples/") and "[deployment]" in (ROOT / path).read_text()
        ):
            return place_gpu_example
        case ["slipstream", "rl", "-c", "rl.toml", *flags] if set(flags) <= {"--dry-run", "--resume"}:
            return run_slurm_quickstart
    return None


COMMANDS = readme_commands()


def test_every_readme_command_is_claimed():
    assert len(COMMANDS) >= 9 and ["make", "demo"] in COMMANDS and ["slipstream", "doctor"] in COMMANDS
    unchecked = [shlex.join(tokens) for tokens in COMMANDS if claim(tokens) is None]
    assert not unchecked, (
        f"README.md commands no test runs or checks (add a check in {Path(__file__).name}): {unchecked}"
    )
    assert SLURM_EXAMPLE in README.read_text()  # the README says which config `rl.toml` stands for


def test_an_unknown_command_is_not_claimed():
    for tokens in (["slipstream", "eval", "-c", "x.toml"], ["curl", "x"], ["make"], ["slipstream", "rl", "-c", "a"]):
        assert claim(tokens) is None, tokens


@pytest.mark.parametrize("tokens", [t for t in dict.fromkeys(map(tuple, COMMANDS))], ids=shlex.join)
def test_readme_command(tokens, tmp_path):
    check = claim(list(tokens))
    assert check is not None, shlex.join(tokens)
    check(list(tokens), tmp_path)
