"""The flake hunter (tests/flake_hunt.py) on test files generated in a temporary folder: it counts each test's failed
runs with their first lines, its CPU hog runs beside pytest, and no hog or pytest outlives a hunt or a Ctrl-C."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.flake_hunt import HOG_TAG, REPO, format_report, hunt

GENERATED_TESTS = """
import pathlib
import time

import pytest
from family_helpers import Family

CALLS = pathlib.Path(__file__).with_name("calls")


@pytest.fixture
def broken():
    raise RuntimeError("setup broke")


def test_passes():
    pass


def test_always_fails():
    assert False, "always"


def test_fails_on_odd_runs():
    run = int(CALLS.read_text()) + 1 if CALLS.exists() else 1
    CALLS.write_text(str(run))
    assert run % 2 == 0, f"odd run {run}"


def test_setup_error(broken):
    pass


@pytest.mark.parametrize("value", [1, 2])
class TestInClass:
    def test_value(self, value):
        assert value == 1, f"value {value}"


class TestGoodFamily(Family):
    ok = True


class TestBadFamily(Family):
    ok = False


def test_a_hog_is_busy_beside_the_run():
    hogs = [p for p in pathlib.Path("/proc").iterdir() if p.name.isdigit() and _is_hog(p)]
    assert hogs, "no hog"
    before = [_cpu_ticks(p) for p in hogs]
    time.sleep(0.5)
    assert any(_cpu_ticks(p) > b for p, b in zip(hogs, before)), "the hog is not busy"


def _is_hog(proc):
    try:
        return b"HOG_TAG" in (proc / "cmdline").read_bytes()
    except OSError:
        return False


def _cpu_ticks(proc):
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime
""".replace("HOG_TAG", HOG_TAG)
# A test class's tests defined in another module (as tests/unit/moe_family_helpers.py does): each keeps its own id.
FAMILY_HELPERS = """
class Family:
    def test_inherited(self):
        assert self.ok, "not ok"
"""


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_counts_failed_runs_per_test_with_first_lines(tmp_path):
    test_file = tmp_path / "test_generated.py"
    test_file.write_text(GENERATED_TESTS)
    (tmp_path / "family_helpers.py").write_text(FAMILY_HELPERS)
    lines = []
    # node ids are relative to pytest's rootdir, which for files outside the repository depends on where the
    # repository lives (a clone under /tmp shares /tmp with them): fixed here, as a hunt of the repository's tests has
    # the repository's pyproject.toml
    rootdir = ["--rootdir", str(tmp_path)]
    result = hunt([str(test_file)], runs=3, pytest_args=rootdir, out=tmp_path / "out", log=lines.append)

    failures = {node_id: [(run, msg) for run, msg in record.failures] for node_id, record in result.tests.items()}
    assert {node_id: record.runs for node_id, record in result.tests.items()} == dict.fromkeys(failures, 3)
    assert failures["test_generated.py::test_passes"] == []
    assert failures["test_generated.py::test_a_hog_is_busy_beside_the_run"] == []
    assert [run for run, _ in failures["test_generated.py::test_always_fails"]] == [1, 2, 3]
    assert all("always" in msg for _, msg in failures["test_generated.py::test_always_fails"])
    assert [run for run, _ in failures["test_generated.py::test_fails_on_odd_runs"]] == [1, 3]
    assert [msg for _, msg in failures["test_generated.py::test_fails_on_odd_runs"]] == [
        "AssertionError: odd run 1",
        "AssertionError: odd run 3",
    ]
    setup_error = ["setup: RuntimeError: setup broke"] * 3
    assert [msg for _, msg in failures["test_generated.py::test_setup_error"]] == setup_error
    assert failures["test_generated.py::TestInClass::test_value[1]"] == []
    assert len(failures["test_generated.py::TestInClass::test_value[2]"]) == 3
    assert failures["test_generated.py::TestGoodFamily::test_inherited"] == []
    not_ok = ["AssertionError: not ok"] * 3
    assert [msg for _, msg in failures["test_generated.py::TestBadFamily::test_inherited"]] == not_ok
    assert result.failed and not result.interrupted and not result.broken_runs
    assert len(result.hog_pids) == 3 and all(_gone(pid) for pid in result.hog_pids)
    assert [line.split(":")[0] for line in lines[1:]] == ["run 1/3", "run 2/3", "run 3/3"]

    report = format_report(result)
    assert "9 test(s) seen, 5 failed at least once" in report
    assert "  2/3 failed  test_generated.py::test_fails_on_odd_runs\n      run 1: AssertionError: odd run 1" in report


def test_a_broken_run_is_reported(tmp_path):
    result = hunt([str(tmp_path / "missing.py")], runs=1, hogs=0, out=tmp_path / "out", log=lambda line: None)
    assert result.failed and result.tests == {}
    assert result.broken_runs == [(1, "pytest exited with 4")]


def test_ctrl_c_stops_pytest_and_the_hog(tmp_path):
    started = tmp_path / "started"
    (tmp_path / "test_slow.py").write_text(
        f"import os, pathlib, time\n\ndef test_slow():\n"
        f"    pathlib.Path({str(started)!r}).write_text(str(os.getpid()))\n    time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "tests.flake_hunt", "-n", "2", "--out", str(tmp_path / "out")]
    hunter = subprocess.Popen(
        [*command, str(tmp_path / "test_slow.py")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            assert hunter.poll() is None, hunter.stdout.read().decode()
            time.sleep(0.1)
        pytest_pid = int(started.read_text())
        hogs = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _child_hog(p, hunter.pid)]
        assert len(hogs) == 1
        hunter.send_signal(signal.SIGINT)
        output = hunter.communicate(timeout=90)[0].decode()
    finally:
        if hunter.poll() is None:
            hunter.kill()
            hunter.wait()
    assert hunter.returncode == 130, output
    assert "run 1/2: interrupted" in output, output
    assert _gone(pytest_pid) and _gone(int(hogs[0].name))
    assert not (tmp_path / "out" / "run_2.log").exists()


def _child_hog(proc: Path, parent: int) -> bool:
    try:
        stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        return int(stat[1]) == parent and HOG_TAG.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
