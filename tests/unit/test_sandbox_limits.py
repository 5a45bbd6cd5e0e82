"""Sandbox limits: wall time, CPU time, memory, output size, file size and process count are each enforced.

Needs working isolation (bubblewrap); fails with the probe's reason and the fix where the machine cannot isolate.
"""

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from slipstream.sandbox import Sandbox, SandboxLimits, detect_isolation

ISOLATION = detect_isolation()
needs_isolation = pytest.mark.usefixtures("require_isolation")  # fails, never skips, without isolation


@pytest.fixture
def tmp_path():
    """A workdir the sandbox user can reach (pytest's own tmp_path sits under a directory private to root)."""
    path = tempfile.mkdtemp(prefix="slipstream-test-sandbox-")
    yield Path(path)
    shutil.rmtree(path)


pytestmark = needs_isolation


def _sandbox(tmp_path, **limits) -> Sandbox:
    return Sandbox(tmp_path, SandboxLimits(**limits))


def test_wall_time_kills_the_whole_sandbox(tmp_path):
    sandbox = _sandbox(tmp_path)
    start = time.perf_counter()
    result = sandbox.run("sleep 30 & sleep 30 & wait", timeout=1.0)
    assert result.timed_out and result.killed_reason == "wall_time"
    assert result.returncode == 137
    assert time.perf_counter() - start < 5


def test_cpu_time_limit(tmp_path):
    sandbox = _sandbox(tmp_path, cpu_seconds=1, wall_seconds=20)
    result = sandbox.run(["python3", "-c", "while True: pass"])
    assert result.killed_reason == "cpu_time" and not result.timed_out
    assert result.duration_s < 10


def test_memory_limit(tmp_path):
    sandbox = _sandbox(tmp_path, memory_mb=256)
    small = sandbox.run(["python3", "-c", "b = bytearray(20 * 2**20); print(len(b))"])
    assert small.ok and small.stdout.strip() == str(20 * 2**20)
    big = sandbox.run(["python3", "-c", "b = bytearray(600 * 2**20)"])
    assert big.returncode != 0 and "MemoryError" in big.stderr


def test_output_is_truncated_at_the_limit(tmp_path):
    sandbox = _sandbox(tmp_path, max_output_bytes=1000)
    flood = sandbox.run("yes")
    assert flood.truncated and flood.killed_reason == "output_limit"
    assert len(flood.stdout) == 1000 and flood.stdout.startswith("y\ny\n")
    flood_err = sandbox.run("yes >&2")
    assert flood_err.truncated and len(flood_err.stderr) == 1000
    small = sandbox.run("printf 'x%.0s' $(seq 1 999)")
    assert small.ok and not small.truncated and len(small.stdout) == 999


def test_file_size_limit(tmp_path):
    sandbox = _sandbox(tmp_path, max_file_mb=1)
    ok = sandbox.run(["python3", "-c", "open('small', 'wb').write(b'x' * 500_000)"])
    assert ok.ok and (tmp_path / "small").stat().st_size == 500_000
    big = sandbox.run(["python3", "-c", "open('big', 'wb').write(b'x' * 3_000_000)"])
    assert big.returncode != 0 and "File too large" in big.stderr
    shell = sandbox.run("head -c 3000000 /dev/zero > big2")
    assert shell.returncode != 0 and shell.killed_reason == "file_size"


def test_process_limit_is_per_sandbox(tmp_path):
    spawn = (
        "import subprocess\nprocs = []\ntry:\n    for _ in range({n}):\n"
        "        procs.append(subprocess.Popen(['sleep', '2']))\n    print('spawned', len(procs))\n"
        "except OSError as e:\n    print('refused after', len(procs), e.errno)\n"
    )
    sandbox = _sandbox(tmp_path, max_processes=10)
    assert "refused after" in sandbox.run(["python3", "-c", spawn.format(n=30)]).stdout

    async def three_at_once():
        return await asyncio.gather(*(sandbox.arun(["python3", "-c", spawn.format(n=6)]) for _ in range(3)))

    # 3 x 6 processes exceed 10 together but not per sandbox: the budget is not shared.
    assert all("spawned 6" in r.stdout for r in asyncio.run(three_at_once()))


def test_cancellation_kills_the_command(tmp_path):
    sandbox = _sandbox(tmp_path)
    marker = "4321.5"

    async def cancel_soon():
        task = asyncio.ensure_future(sandbox.arun(f"sleep {marker}"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    time.sleep(0.2)
    assert not _processes_with(marker)


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
