"""Sandbox isolation: no network, one writable directory, nothing inherited; refusal where isolation is impossible.

Isolation tests need bubblewrap and FAIL (never skip) with the probe's reason and the fix where the machine cannot
isolate; the refusal and opt-out tests run everywhere.
"""

import asyncio
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from slipstream.sandbox import Isolation, Sandbox, SandboxLimits, SandboxUnavailable, detect_isolation
from slipstream.sandbox import sandbox as sandbox_module

ISOLATION = detect_isolation()
needs_isolation = pytest.mark.usefixtures("require_isolation")  # fails, never skips, without isolation


@pytest.fixture
def tmp_path():
    """A workdir the sandbox user can reach (pytest's own tmp_path sits under a directory private to root)."""
    path = tempfile.mkdtemp(prefix="slipstream-test-sandbox-")
    yield Path(path)
    shutil.rmtree(path)


_CONNECT = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
try:
    socket.create_connection((host, port), timeout=3).close()
    print("connected")
except OSError as e:
    print("blocked", e.errno)
"""


@pytest.fixture
def host_server():
    """A TCP server on the host's loopback that accepts connections."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    accepted = []

    def accept():
        try:
            conn, _ = server.accept()
            accepted.append(conn)
        except OSError:  # closed by the fixture's teardown
            pass

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1], accepted
    server.close()


@needs_isolation
def test_network_is_blocked(tmp_path, host_server):
    port, accepted = host_server
    sandbox = Sandbox(tmp_path)
    # The host's loopback is not the sandbox's: its own lo has nothing listening.
    assert sandbox.run(["python3", "-c", _CONNECT, "127.0.0.1", str(port)]).stdout.startswith("blocked")
    assert not accepted
    # No route to anything outside (whether or not the host itself has internet access).
    assert sandbox.run(["python3", "-c", _CONNECT, "1.1.1.1", "53"]).stdout.startswith("blocked")
    interfaces = sandbox.run("tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").stdout.split()
    assert interfaces == ["lo"]


@needs_isolation
def test_writes_outside_the_workdir_fail(tmp_path):
    tmp_path.chmod(0o711)
    workdir = tmp_path / "work"
    workdir.mkdir()
    sandbox = Sandbox(workdir)
    assert sandbox.run("echo hi > inside.txt && cat inside.txt").stdout == "hi\n"
    assert (workdir / "inside.txt").read_text() == "hi\n"
    for target in ("/etc/x", "/usr/x", "/x", "/root/x", "/home/x", "/proc/x", f"{tmp_path}/outside.txt"):
        result = sandbox.run(f"echo pwned > {target}")
        assert result.returncode != 0, target
    assert not (tmp_path / "outside.txt").exists()
    # /tmp is private to the command and memory-backed: it never reaches the host.
    marker = f"slipstream-sandbox-{os.getpid()}"
    assert sandbox.run(f"echo x > /tmp/{marker} && cat /tmp/{marker}").stdout == "x\n"
    assert not os.path.exists(f"/tmp/{marker}")


@needs_isolation
def test_host_secrets_and_environment_are_invisible(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_TEST_SECRET", "hunter2")
    sandbox = Sandbox(tmp_path, env={"EXTRA": "visible"})
    env = sandbox.run("env").stdout
    assert "hunter2" not in env and "EXTRA=visible" in env
    assert sandbox.run("ls /root").returncode != 0
    assert sandbox.run(f"ls {os.getcwd()}").returncode != 0  # the repository is not mounted
    if ISOLATION.run_as is not None:
        assert sandbox.run("id -u").stdout.strip() == str(ISOLATION.run_as)
        assert sandbox.run("cat /etc/shadow").returncode != 0


@needs_isolation
def test_run_arun_stdin_and_exit_codes(tmp_path):
    sandbox = Sandbox(tmp_path)
    assert sandbox.inner_workdir == "/workspace"
    result = sandbox.run(["python3", "-c", "import sys; print(sys.stdin.read()[::-1])"], stdin="abc")
    assert result.ok and result.stdout == "cba\n"
    failed = sandbox.run("echo out; echo err >&2; exit 3")
    assert (failed.returncode, failed.stdout, failed.stderr, failed.killed_reason) == (3, "out\n", "err\n", None)

    async def several():
        return await asyncio.gather(*(sandbox.arun(f"echo {i}") for i in range(8)))

    assert [r.stdout for r in asyncio.run(several())] == [f"{i}\n" for i in range(8)]

    async def inside_loop():
        sandbox.run("true")

    with pytest.raises(RuntimeError, match="arun"):
        asyncio.run(inside_loop())


def _no_isolation(monkeypatch):
    monkeypatch.setattr(sandbox_module, "detect_isolation", lambda: Isolation(False, "test: no namespaces"))
    monkeypatch.setattr(sandbox_module, "_warned_unsandboxed", False)


def test_refuses_untrusted_code_without_isolation(tmp_path, monkeypatch):
    _no_isolation(monkeypatch)
    with pytest.raises(SandboxUnavailable, match="test: no namespaces.*allow_unsandboxed=True"):
        Sandbox(tmp_path)


def test_explicit_opt_out_warns_loudly_and_still_limits(tmp_path, monkeypatch):
    _no_isolation(monkeypatch)
    with pytest.warns(RuntimeWarning, match="WITHOUT A SANDBOX"):
        sandbox = Sandbox(tmp_path, SandboxLimits(max_output_bytes=100), allow_unsandboxed=True)
    assert not sandbox.isolated and sandbox.inner_workdir == str(tmp_path.resolve())
    assert sandbox.run("pwd").stdout.strip() == str(tmp_path.resolve())
    assert sandbox.run("yes").truncated
    assert sandbox.run("sleep 20", timeout=0.5).killed_reason == "wall_time"


def test_opt_out_gives_up_on_pipes_held_by_escaped_grandchildren(tmp_path, monkeypatch):
    _no_isolation(monkeypatch)
    monkeypatch.setattr("slipstream.sandbox.process.KILL_GRACE_S", 0.5)
    with pytest.warns(RuntimeWarning):
        sandbox = Sandbox(tmp_path, allow_unsandboxed=True)
    result = sandbox.run("setsid sleep 3 & echo started; sleep 20", timeout=0.5)
    assert result.timed_out and result.stdout == "started\n" and result.duration_s < 3


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="max_open_files"):
        SandboxLimits(max_open_files=3)
    with pytest.raises(ValueError, match="not an existing directory"):
        Sandbox(tmp_path / "missing", allow_unsandboxed=True)


def test_detection_explains_why_isolation_is_impossible(tmp_path, monkeypatch):
    from slipstream.sandbox import isolation

    fake = tmp_path / "bwrap"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = --version ]; then echo "bubblewrap 0.6.1"; exit 0; fi\n'
        'echo "bwrap: No permissions to create new namespace" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    tmp_path.chmod(0o755)
    which = {"bwrap": str(fake), "prlimit": "/usr/bin/prlimit"}
    monkeypatch.setattr(isolation.shutil, "which", which.get)
    found = isolation.detect_isolation.__wrapped__()
    assert not found.available
    assert "bubblewrap 0.6.1" in found.reason and "No permissions to create new namespace" in found.reason
    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    assert "Debian package: bubblewrap" in isolation.detect_isolation.__wrapped__().reason


def test_security_tests_fail_rather_than_skip_without_isolation(tmp_path):
    """Where bwrap is missing, a test needing isolation fails and says how to install it."""
    import subprocess
    import sys

    test = Path(tmp_path) / "test_needs.py"
    test.write_text("import pytest\n\n@pytest.mark.usefixtures('require_isolation')\ndef test_x():\n    pass\n")
    conftest = Path(__file__).resolve().parents[1] / "conftest.py"
    (Path(tmp_path) / "conftest.py").write_text(conftest.read_text())
    root = str(Path(__file__).resolve().parents[2])  # the copied conftest imports tests.cores
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": pythonpath}  # no bwrap on PATH
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", str(test)],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert "1 error" in done.stdout and "apt-get install bubblewrap" in done.stdout and "skipped" not in done.stdout
