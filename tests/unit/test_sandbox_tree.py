"""Sandbox limits of the whole process tree (a cgroup per command), the seccomp filter, and what of the host a
sandbox can read.

Whole-tree tests need a cgroup this process may create (cgroup v2 delegated through SLIPSTREAM_SANDBOX_CGROUP, or
cgroup v1 as root) and FAIL, never skip, saying so where there is none; the fallback test runs everywhere.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slipstream.sandbox import Sandbox, SandboxLimits, detect_isolation
from slipstream.sandbox import cgroup as cgroup_module
from slipstream.sandbox import sandbox as sandbox_module
from slipstream.sandbox.cgroup import OVERHEAD_PROCESSES, CgroupSupport, CommandCgroup, detect_cgroups

CGROUPS = detect_cgroups()
needs_isolation = pytest.mark.usefixtures("require_isolation")  # fails, never skips, without isolation


@pytest.fixture
def require_tree_limits() -> None:
    if CGROUPS.version is None:
        pytest.fail(
            f"whole-tree sandbox limits are unavailable here ({CGROUPS.reason}); run as root on a cgroup v1 host "
            f"or set {cgroup_module.CGROUP_ENV} to a delegated cgroup v2; these tests do not skip",
            pytrace=False,
        )


needs_tree_limits = pytest.mark.usefixtures("require_isolation", "require_tree_limits")


@pytest.fixture
def tmp_path():
    """A workdir the sandbox user can reach (pytest's own tmp_path sits under a directory private to root)."""
    path = tempfile.mkdtemp(prefix="slipstream-test-sandbox-")
    yield Path(path)
    shutil.rmtree(path)


# Each process holds `argv[1]` MiB of touched memory, says so, then sleeps `argv[2]` seconds.
_HOLD = (
    "import sys, time; b = b'x' * (int(sys.argv[1]) << 20); print('held', flush=True); time.sleep(float(sys.argv[2]))"
)


def _leftover_cgroups() -> list[str]:
    prefix = f"slipstream-sandbox-{os.getpid()}-"
    return [p.name for parent in CGROUPS.parents.values() for p in parent.iterdir() if p.name.startswith(prefix)]


@needs_tree_limits
def test_memory_cap_stops_the_whole_tree(tmp_path):
    sandbox = Sandbox(tmp_path, SandboxLimits(memory_mb=256, wall_seconds=30))
    one = sandbox.run(["python3", "-c", _HOLD, "64", "0"])
    assert one.ok and one.stdout == "held\n" and one.limits_scope == CGROUPS.scope
    # 8 x 64 MiB: every process stays under the 256 MiB per-process limit, the tree does not.
    eight = 'for i in 1 2 3 4 5 6 7 8; do python3 -c "$0" 64 8765.25 & done; wait'
    start = time.perf_counter()
    many = sandbox.run(["bash", "-c", eight, _HOLD])
    assert many.killed_reason == "memory" and many.returncode == 137 and not many.timed_out
    assert time.perf_counter() - start < 10
    assert not _processes_with("8765.25")  # stopped as a whole: no survivor keeps sleeping
    assert not _leftover_cgroups()


@needs_tree_limits
def test_process_cap_counts_the_whole_tree(tmp_path):
    limits = SandboxLimits(max_processes=10)
    group = CommandCgroup(CGROUPS, limits)
    try:
        pids_max = next(p for p in group.dirs.values() if (p / "pids.max").exists()) / "pids.max"
        assert pids_max.read_text().strip() == str(10 + OVERHEAD_PROCESSES)
    finally:
        group.remove_now()
    # A chain: each process starts the next one, until the tree's budget refuses (EAGAIN) 30 levels deep.
    chain = (
        "import subprocess, sys\ndepth = int(sys.argv[2])\nif depth == 30:\n    print('reached 30')\nelse:\n"
        "    try:\n        subprocess.run([sys.executable, '-c', *sys.argv[1:2] * 2, str(depth + 1)], check=False)\n"
        "    except OSError:\n        print('refused at depth', depth)\n"
    )
    result = Sandbox(tmp_path, limits).run(["python3", "-c", chain, chain, "0"], timeout=20)
    assert result.stdout.startswith("refused at depth") and not result.timed_out
    assert int(result.stdout.split()[-1]) < 10
    assert not _leftover_cgroups()


@needs_tree_limits
def test_cpu_time_counts_the_whole_tree(tmp_path):
    # 3 processes of 0.8 s CPU each: under the 1 s limit per process, over it together.
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.8:\n    pass"
    sandbox = Sandbox(tmp_path, SandboxLimits(cpu_seconds=1, cpus=2.0, wall_seconds=20))
    result = sandbox.run(["bash", "-c", 'for i in 1 2 3; do python3 -c "$0" & done; wait', spin])
    assert result.killed_reason == "cpu_time" and not result.timed_out


def test_without_cgroups_limits_are_per_process_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_module, "detect_cgroups", lambda: CgroupSupport(None, "test: no cgroups"))
    monkeypatch.setattr(sandbox_module, "_warned_missing", set())
    allow = not detect_isolation().available
    with pytest.warns(RuntimeWarning, match="PER PROCESS ONLY: test: no cgroups"):
        sandbox = Sandbox(tmp_path, SandboxLimits(memory_mb=256), allow_unsandboxed=allow)
    assert sandbox.tree_limits.scope == "per_process"
    small = sandbox.run(["python3", "-c", _HOLD, "20", "0"])
    assert small.ok and small.limits_scope == "per_process"
    big = sandbox.run(["python3", "-c", _HOLD, "600", "0"])  # the per-process cap still applies
    assert big.returncode != 0 and "MemoryError" in big.stderr


def test_detection_explains_the_fallback(monkeypatch):
    monkeypatch.setattr(cgroup_module, "_mounts", lambda: [])
    found = cgroup_module.detect_cgroups.__wrapped__()
    assert found.version is None and found.scope == "per_process"
    assert "no cgroup v2 hierarchy" in found.reason and "memory_mb x max_processes" in found.reason


@needs_isolation
def test_seccomp_filter_denies_what_agent_code_never_needs(tmp_path):
    traceme = (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno())"
    )
    outside = subprocess.run([sys.executable, "-c", traceme], capture_output=True, text=True, check=True)
    assert outside.stdout.split()[0] == "0"  # PTRACE_TRACEME works without the filter
    sandbox = Sandbox(tmp_path)
    assert sandbox.run(["python3", "-c", traceme]).stdout.split() == ["-1", "1"]  # EPERM
    assert "Seccomp:\t2" in sandbox.run("cat /proc/self/status").stdout
    assert sandbox.run(["python3", "-c", "import subprocess; print('ok')"]).stdout == "ok\n"


@needs_isolation
def test_host_files_and_environment_stay_out(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TEST_SECRET", "hunter2")
    sandbox = Sandbox(tmp_path, env={"EXTRA": "visible"})
    env = dict(line.split("=", 1) for line in sandbox.run("env -0 | tr '\\0' '\\n'").stdout.splitlines())
    assert set(env) - {"PWD", "SHLVL", "_"} == {"PATH", "HOME", "LANG", "TMPDIR", "PYTHONUNBUFFERED", "EXTRA"}
    assert env["HOME"] == "/workspace"
    for host_only in ("/etc/machine-id", "/etc/shadow", "/etc/environment", "/etc/fstab", "/sys/fs", os.getcwd()):
        assert sandbox.run(["test", "-e", host_only]).returncode == 1, host_only
    passwd = sandbox.run("cat /etc/passwd").stdout
    assert {line.split(":")[0] for line in passwd.splitlines()} <= {"root", "nobody", "sandbox"}
    assert sandbox.run("cat /etc/hostname; hostname").stdout == "sandbox\nsandbox\n"
    assert sandbox.run(["python3", "-c", "import ssl, json; print('ok')"]).stdout == "ok\n"


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
