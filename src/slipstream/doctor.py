"""`slipstream doctor`: is this machine ready for a run? One line per check, OK, WARN or FAIL, and the fix when not
OK; the exit status is 1 when a check FAILs. Checks are pure functions of what a probe found (the `probe_*` functions,
which tests replace), so each verdict is tested without the machine that would give it.

    slipstream doctor [--output-dir DIR] [--slurm]
"""

import argparse
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

GIB = 1 << 30
MIN_FREE_GIB = 2
"""Below this, free disk FAILs: the tiny demo's weights, checkpoints and rollouts do not fit."""
LOW_FREE_GIB = 20
"""Below this, free disk WARNs: one checkpoint of a 1B model (weights + AdamW state, float32) is ~16 GB."""


@dataclass(frozen=True)
class Check:
    """One verdict: `name` of the thing checked, `status`, what was found, and what to do when not OK."""

    name: str
    status: Literal["OK", "WARN", "FAIL"]
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status:<4}  {self.name:<7}  {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix and self.status != "OK" else text


@dataclass(frozen=True)
class TorchInfo:
    """What the installed torch offers: its version, the CUDA it was built for (None: a CPU build), the GPUs it sees,
    and the NCCL it links (None: none)."""

    version: str
    cuda: str | None
    num_gpus: int
    nccl: str | None


def check_python(version: str, requires: str | None) -> Check:
    from packaging.specifiers import SpecifierSet

    if requires is None or SpecifierSet(requires).contains(version, prereleases=True):
        return Check("python", "OK", f"Python {version} ({sys.executable})")
    return Check(
        "python",
        "FAIL",
        f"Python {version}, but Slipstream needs {requires}",
        f"create the environment with a Python {requires} (e.g. python3.11 -m venv .venv; `make setup` uses python3)",
    )


def check_torch(info: TorchInfo | None) -> Check:
    if info is None:
        return Check("torch", "FAIL", "torch is not installed", "pip install -e . (or `make setup`)")
    if info.cuda is None:
        return Check("torch", "OK", f"torch {info.version}, CPU build: runs on CPU (vLLM's CPU build serves)")
    if info.num_gpus == 0:
        return Check(
            "torch",
            "WARN",
            f"torch {info.version} (CUDA {info.cuda}), but no GPU is visible: the run would be on CPU",
            "check `nvidia-smi` (driver) and CUDA_VISIBLE_DEVICES",
        )
    return Check("torch", "OK", f"torch {info.version}, CUDA {info.cuda}, {info.num_gpus} GPU(s)")


def check_nccl(info: TorchInfo | None) -> Check:
    if info is None or info.cuda is None:
        return Check("nccl", "OK", "not used: no CUDA build of torch (weights travel by gloo or the filesystem)")
    if info.nccl is None:
        return Check(
            "nccl",
            "FAIL",
            f"torch {info.version} (CUDA {info.cuda}) has no NCCL: weights.transport 'nccl' and GPU training need it",
            "install a CUDA wheel of torch from PyPI or download.pytorch.org (they ship NCCL)",
        )
    return Check("nccl", "OK", f"NCCL {info.nccl}")


def check_vllm(installed: tuple[str, str] | None, env: dict[str, str]) -> Check:
    from packaging.version import Version

    from slipstream.inference.vllm_support import (
        ALLOW_UNTESTED_ENV,
        INSTALL_FIX,
        SUPPORTED_RANGE,
        TESTED,
        is_supported,
    )

    if installed is None:
        return Check("vllm", "FAIL", "vLLM is not installed: inference cannot start", INSTALL_FIX)
    name, version = installed
    if is_supported(version):
        tested = "tested" if Version(version).base_version in TESTED else "in range, not tested itself"
        return Check("vllm", "OK", f"{name} {version} (supported: {SUPPORTED_RANGE}; {tested})")
    outside = f"{name} {version} is outside the supported range {SUPPORTED_RANGE}"
    if env.get(ALLOW_UNTESTED_ENV) == "1":
        return Check("vllm", "WARN", f"{outside}; started anyway ({ALLOW_UNTESTED_ENV}=1)", INSTALL_FIX)
    return Check("vllm", "FAIL", f"{outside}: runs refuse to start", f"{INSTALL_FIX}; or set {ALLOW_UNTESTED_ENV}=1")


def check_sandbox(available: bool, reason: str) -> Check:
    if available:
        return Check("sandbox", "OK", reason)
    return Check(
        "sandbox",
        "WARN",
        f"{reason}: environments that run model-written code (swe_fix, slipstream.sandbox) refuse to",
        "apt-get install bubblewrap (as root; `make setup` does it); other environments do not need it",
    )


def check_disk(path: Path, free_bytes: int) -> Check:
    free = f"{free_bytes / GIB:.1f} GiB free on the filesystem of {path}"
    fix = "free space, or put the run's output_dir on a larger filesystem (--output-dir DIR here)"
    if free_bytes < MIN_FREE_GIB * GIB:
        return Check("disk", "FAIL", f"{free}: under {MIN_FREE_GIB} GiB, even the demo does not fit", fix)
    if free_bytes < LOW_FREE_GIB * GIB:
        return Check("disk", "WARN", f"{free}: under {LOW_FREE_GIB} GiB, enough for small models only", fix)
    return Check("disk", "OK", free)


def check_ports(host: str, taken: dict[int, str]) -> Check:
    """`taken`: default ports found in use, each with the option that sets it."""
    if not taken:
        return Check("ports", "OK", f"the default ports are free on {host}")
    which = ", ".join(f"{port} ({option})" for port, option in taken.items())
    return Check(
        "ports",
        "WARN",
        f"in use on {host}: {which}",
        f"stop what listens there (ss -ltnp | grep :{next(iter(taken))}), or set {' / '.join(taken.values())} "
        "to a free port",
    )


def check_slurm(sbatch: str | None, works: bool, said: str) -> Check:
    """`said`: what `sbatch --version` printed (its version, or the last line of its error)."""
    if sbatch is None:
        return Check(
            "slurm",
            "FAIL",
            "sbatch is not on PATH: runs with [slurm] cannot be submitted",
            "run on the cluster's login node, or put Slurm's commands on PATH (e.g. `module load slurm`)",
        )
    if not works:
        return Check(
            "slurm",
            "FAIL",
            f"{sbatch} --version failed: {said or 'no output'}",
            "check Slurm's configuration here (slurm.conf, SLURM_CONF) and that slurmctld is reachable",
        )
    return Check("slurm", "OK", f"{said} ({sbatch})")


def probe_torch() -> TorchInfo | None:
    try:
        import torch
    except ImportError:
        return None
    cuda = torch.version.cuda
    num_gpus = torch.cuda.device_count() if cuda and torch.cuda.is_available() else 0
    nccl = None
    if cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return TorchInfo(torch.__version__, cuda, num_gpus, nccl)


def probe_vllm() -> tuple[str, str] | None:
    from slipstream.inference.vllm_support import installed_vllm

    return installed_vllm()


def probe_sandbox() -> tuple[bool, str]:
    from slipstream.sandbox.isolation import detect_isolation

    isolation = detect_isolation()
    return isolation.available, isolation.reason


def probe_free_disk(path: Path) -> tuple[Path, int]:
    """(the nearest existing folder of `path`, free bytes on its filesystem): the run directory may not exist yet."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path, shutil.disk_usage(path).free


def probe_taken_ports() -> tuple[str, dict[int, str]]:
    """(host, the default ports in use there, each with the option that sets it)."""
    from slipstream.config.inference import InferenceConfig
    from slipstream.config.rl import LaunchConfig
    from slipstream.utils.net import ports_free

    host = InferenceConfig.model_fields["host"].default
    ports = {
        InferenceConfig.model_fields["port"].default: "inference.port",
        LaunchConfig.model_fields["trainer_master_port"].default: "launch.trainer_master_port",
    }
    return host, {port: option for port, option in ports.items() if not ports_free(host, port, 1)}


def probe_sbatch() -> tuple[str | None, bool, str]:
    """(path of sbatch or None, whether `sbatch --version` works, its version or the last line of its error)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        return None, False, ""
    try:
        done = subprocess.run([sbatch, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return sbatch, False, str(e)
    lines = (done.stdout if done.returncode == 0 else done.stderr).strip().splitlines()
    return sbatch, done.returncode == 0, lines[-1] if lines else ""


def run_checks(output_dir: Path, slurm: bool) -> list[Check]:
    from slipstream.version import requires_python

    torch = probe_torch()
    checks = [
        check_python(platform.python_version(), requires_python()),
        check_torch(torch),
        check_nccl(torch),
        check_vllm(probe_vllm(), dict(os.environ)),
        check_sandbox(*probe_sandbox()),
        check_disk(*probe_free_disk(output_dir)),
        check_ports(*probe_taken_ports()),
    ]
    if slurm:
        checks.append(check_slurm(*probe_sbatch()))
    return checks


def main(argv: list[str]) -> int:
    from slipstream.config.rl import RLConfig

    parser = argparse.ArgumentParser(prog="slipstream doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=RLConfig.model_fields["output_dir"].default,
        help="the run directory whose filesystem's free space is checked (default: output_dir's default)",
    )
    parser.add_argument("--slurm", action="store_true", help="also check Slurm's sbatch (runs with [slurm])")
    args = parser.parse_args(argv)
    checks = run_checks(args.output_dir, args.slurm)
    for check in checks:
        print(check.line())
    return 1 if any(check.status == "FAIL" for check in checks) else 0
