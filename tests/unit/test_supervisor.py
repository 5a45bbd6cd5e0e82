"""The supervisor names a failed child, and stopping leaves no process behind (grandchildren included)."""

import os
import sys
import time

import pytest

from slipstream.launch.plan import ProcessSpec
from slipstream.launch.supervisor import ChildFailed, Supervisor, tail


def _spec(tmp_path, name, code, must_run_to_end=True):
    return ProcessSpec(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", must_run_to_end=must_run_to_end)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_failed_child_is_named_with_its_log(tmp_path):
    sup = Supervisor(grace_s=2)
    sup.start(_spec(tmp_path, "server", "import time; time.sleep(60)"))
    sup.start(_spec(tmp_path, "worker", "print('boom happened'); raise SystemExit(3)", must_run_to_end=False))
    try:
        with pytest.raises(ChildFailed, match=r"worker exited with code 3") as info:
            for _ in range(100):
                sup.check()
                time.sleep(0.05)
        assert "boom happened" in tail(info.value.log_path)
    finally:
        sup.stop_all()
    assert all(p.poll() is not None for p in sup.procs.values())


def test_clean_exit_of_a_finite_child_is_not_a_failure(tmp_path):
    sup = Supervisor(grace_s=2)
    sup.start(_spec(tmp_path, "trainer", "pass", must_run_to_end=False))
    sup.procs["trainer"].wait()
    assert sup.check() == ["trainer"]
    sup.stop_all()


def test_stop_all_kills_grandchildren(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    sup = Supervisor(grace_s=1)
    sup.start(_spec(tmp_path, "parent", code))
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert _alive(grandchild)
    sup.stop_all()
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_stop_all_kills_descendants_that_left_the_group(tmp_path):
    """torchrun starts workers in their own sessions: killing the child's group alone would orphan them."""
    pid_file = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n"
    )
    sup = Supervisor(grace_s=1)
    sup.start(_spec(tmp_path, "agent", code))
    for _ in range(200):
        sup.check()
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    sup.check()  # the supervisor sees the worker while the agent is alive
    os.kill(sup.procs["agent"].pid, 9)  # the agent dies first; its worker is reparented, not killed
    sup.procs["agent"].wait()
    assert _alive(worker)
    sup.stop_all()
    for _ in range(100):
        if not _alive(worker):
            break
        time.sleep(0.05)
    assert not _alive(worker)


def test_restart_kills_what_is_left_of_the_dead_child_and_starts_it_again(tmp_path):
    """A killed vLLM leaves its engine processes (in its group, or in their own session) holding port and memory."""
    pid_file = tmp_path / "helper.pid"
    code = (
        "import os, subprocess, sys, time\n"
        "a = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        "b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(pid_file)!r}, 'a').write(f'{{a.pid}} {{b.pid}}\\n')\n"
        "time.sleep(120)\n"
    )
    sup = Supervisor(grace_s=5)
    sup.start(_spec(tmp_path, "inference", code))
    sup.start(_spec(tmp_path, "trainer", "import time; time.sleep(120)", must_run_to_end=False))
    try:
        for _ in range(200):
            sup.check()
            if pid_file.exists() and pid_file.read_text().endswith("\n"):
                break
            time.sleep(0.05)
        helpers = [int(p) for p in pid_file.read_text().split()]
        sup.check()  # the supervisor records the helpers while their parent is alive
        first = sup.procs["inference"]
        os.kill(first.pid, 9)
        first.wait()
        with pytest.raises(ChildFailed, match="inference was killed by signal 9"):
            sup.check()
        assert sup.check(ignore=("inference",)) == [] and all(_alive(p) for p in helpers)
        sup.restart("inference")
        assert not any(_alive(p) for p in helpers)
        assert sup.procs["inference"] is not first and sup.procs["inference"].poll() is None
        assert _alive(sup.procs["trainer"].pid)  # other children are left alone
        assert sup.check() == []
    finally:
        sup.stop_all()


def test_first_error_finds_the_root_cause_under_torchrun_noise(tmp_path):
    from slipstream.launch.supervisor import first_error

    log = tmp_path / "trainer.log"
    assert first_error(log) is None
    log.write_text(
        "step 3/10 | reward 0.2\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "safetensors._safetensors_rust.SafetensorError: Error while serializing: I/O error: No space left on device\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "OSError: later\n"
    )
    assert first_error(log) == (
        "safetensors._safetensors_rust.SafetensorError: Error while serializing: I/O error: No space left on device"
    )
    log.write_text("all fine\nError rate: low\n")
    assert first_error(log) is None


def test_a_failure_is_explained_by_this_launchs_lines_not_an_earlier_launchs(tmp_path):
    """Logs are appended across launches (resume): found by benchmarks/chaos.py, a resumed run whose trainer was
    SIGKILLed named the SIGTERM that an earlier launch's trainer got as its "first error"."""
    from slipstream.launch.supervisor import first_error

    spec = _spec(tmp_path, "trainer", "print('second launch'); raise SystemExit(4)", must_run_to_end=False)
    spec.log_path.write_text("SignalException: Process 3945 got signal: 15\nearlier launch\n")
    sup = Supervisor(grace_s=2)
    sup.start(spec)
    try:
        with pytest.raises(ChildFailed) as info:
            for _ in range(100):
                sup.check()
                time.sleep(0.05)
    finally:
        sup.stop_all()
    failed = info.value
    assert failed.log_offset == len("SignalException: Process 3945 got signal: 15\nearlier launch\n")
    assert first_error(failed.log_path, failed.log_offset) is None
    assert tail(failed.log_path, offset=failed.log_offset) == "second launch\n"
    assert "earlier launch" in tail(failed.log_path)
