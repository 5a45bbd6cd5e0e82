"""Running one sandbox command: wall-clock limit, capped output capture, the command's cgroup (joined before it runs
anything, watched for OOM kills and CPU time) and killing the whole process group and cgroup."""

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from slipstream.sandbox.cgroup import CommandCgroup

KILL_GRACE_S = 5.0
"""How long to wait for the pipes to close after the process group was killed."""
_CHUNK = 65536
_WATCH_S = 0.05
_GATE = 'read -r go <&{fd} && [ "$go" = go ] || exit 125; exec "$@" {fd}<&-'
"""Held by the first process until the parent has moved it into the command's cgroup (bash: fds above 9)."""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one command. `returncode` is 128+N when a signal N ended it (shell convention)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    """Which limit ended the command: "wall_time", "cpu_time", "memory" (the whole tree reached its cgroup memory
    cap), "output_limit", "file_size"; None otherwise (a per-process memory limit makes allocations fail inside the
    program, it does not kill it)."""
    truncated: bool = False
    """stdout or stderr was cut at `max_output_bytes`."""
    duration_s: float = 0.0
    limits_scope: str = "per_process"
    """How memory, processes and CPU were capped: "cgroup_v2" / "cgroup_v1" (the whole tree) or "per_process"
    (rlimits only: a command may use memory_mb per process, up to max_processes of them)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


class _Killer:
    def __init__(self, process: asyncio.subprocess.Process, cgroup: CommandCgroup | None) -> None:
        self.process = process
        self.cgroup = cgroup
        self.reason: str | None = None

    def kill(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.kill_group()

    def kill_group(self) -> None:
        # Also after the leader exited: background processes it left in its group (unsandboxed runs) die too.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # already gone between the check and the kill
            pass
        if self.cgroup is not None:
            self.cgroup.kill()


async def _watch(cgroup: CommandCgroup, killer: _Killer, cpu_seconds: float) -> None:
    """Kill the whole tree once the kernel OOM-killed any of it, or once its CPU time passes the limit."""
    while True:
        await asyncio.sleep(_WATCH_S)
        if cgroup.oom_kills():
            return killer.kill("memory")
        used = cgroup.cpu_seconds()
        if used is not None and used > cpu_seconds:
            return killer.kill("cpu_time")


async def _spawn(
    argv: list[str], cgroup: CommandCgroup | None, popen_kwargs: dict[str, object]
) -> asyncio.subprocess.Process:
    """Start `argv` in its own session; with a cgroup, it waits at a gate until it has been moved into it."""
    if cgroup is None:
        return await asyncio.create_subprocess_exec(*argv, **popen_kwargs)  # type: ignore[arg-type]
    gate_r, gate_w = os.pipe()
    try:
        bash = shutil.which("bash") or "/bin/bash"
        gated = [bash, "-c", _GATE.format(fd=gate_r), "slipstream-sandbox-gate", *argv]
        pass_fds = (*popen_kwargs.pop("pass_fds", ()), gate_r)  # type: ignore[misc]
        process = await asyncio.create_subprocess_exec(*gated, pass_fds=pass_fds, **popen_kwargs)  # type: ignore[arg-type]
        os.close(gate_r)
        gate_r = -1
        cgroup.add(process.pid)  # if this fails the gate closes unopened and the process exits (125)
        os.write(gate_w, b"go\n")
        return process
    finally:
        for fd in (gate_r, gate_w):
            if fd >= 0:
                os.close(fd)


class _Capture:
    """Bytes read from one stream, kept even if the reader is cancelled midway."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.cut = False


async def _pump(stream: asyncio.StreamReader, cap: int, capture: _Capture, on_overflow: Callable[[], None]) -> None:
    # Read to EOF even past the cap (discarding): asyncio only reports the exit once every pipe is closed.
    while chunk := await stream.read(_CHUNK):
        room = cap - len(capture.data)
        if len(chunk) > room and not capture.cut:
            capture.data += chunk[:room]
            capture.cut = True
            on_overflow()
        elif not capture.cut:
            capture.data += chunk


async def _feed(stream: asyncio.StreamWriter, data: bytes) -> None:
    try:
        if data:
            stream.write(data)
            await stream.drain()
        stream.close()
        await stream.wait_closed()
    except (BrokenPipeError, ConnectionResetError):  # the command exited without reading all of its stdin
        pass


def _close_transport(process: asyncio.subprocess.Process) -> None:
    # asyncio has no public way to give up on a subprocess's pipes; closing the transport does exactly that.
    transport = getattr(process, "_transport", None)
    if transport is not None:
        transport.close()


def _limit_reason(returncode: int) -> str | None:
    if returncode == 128 + signal.SIGXCPU:
        return "cpu_time"
    if returncode == 128 + signal.SIGXFSZ:
        return "file_size"
    return None


async def _wait_or_kill(tasks: list[asyncio.Future], killer: _Killer, wall_seconds: float) -> None:
    """Wait for exit and EOF on both pipes; at the wall-time limit kill the group and wait a little longer."""
    _, pending = await asyncio.wait(tasks, timeout=wall_seconds)
    if pending:
        killer.kill("wall_time")
        _, pending = await asyncio.wait(pending, timeout=KILL_GRACE_S)
    if pending:  # a grandchild that left the session (unsandboxed only) holds a pipe open: stop reading it
        _close_transport(killer.process)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def run_process(
    argv: list[str],
    *,
    cwd: str,
    env: dict[str, str],
    stdin: bytes,
    wall_seconds: float,
    max_output_bytes: int,
    popen_kwargs: dict[str, object],
    cgroup: CommandCgroup | None = None,
    cpu_seconds: float = float("inf"),
    limits_scope: str = "per_process",
) -> SandboxResult:
    """Run `argv` in its own session (and `cgroup`, which the caller creates and removes); kill the session and
    cgroup at `wall_seconds`, when a stream exceeds the cap, or when the cgroup reports an OOM kill or too much CPU."""
    start = time.perf_counter()
    pipe = asyncio.subprocess.PIPE
    kwargs = dict(popen_kwargs, stdin=pipe, stdout=pipe, stderr=pipe, cwd=cwd, env=env, start_new_session=True)
    process = await _spawn(argv, cgroup, kwargs)
    killer = _Killer(process, cgroup)
    out, err = _Capture(), _Capture()
    overflow = lambda: killer.kill("output_limit")  # noqa: E731
    tasks = [
        asyncio.ensure_future(_pump(process.stdout, max_output_bytes, out, overflow)),  # type: ignore[arg-type]
        asyncio.ensure_future(_pump(process.stderr, max_output_bytes, err, overflow)),  # type: ignore[arg-type]
        asyncio.ensure_future(process.wait()),
        asyncio.ensure_future(_feed(process.stdin, stdin)),  # type: ignore[arg-type]
    ]
    watcher = asyncio.ensure_future(_watch(cgroup, killer, cpu_seconds)) if cgroup is not None else None
    try:
        await _wait_or_kill(tasks, killer, wall_seconds)
    except BaseException:  # cancelled by the caller: nothing outlives its command, no pipe outlives the loop
        killer.kill_group()
        _close_transport(process)
        raise
    finally:
        for task in [*tasks, *([watcher] if watcher else [])]:
            task.cancel()
    returncode = await process.wait() if process.returncode is None else process.returncode
    killer.kill_group()
    returncode = 128 - returncode if returncode < 0 else returncode
    oom = cgroup is not None and cgroup.oom_kills() > 0  # also when the command survived losing a process to it
    reason = killer.reason or ("memory" if oom else _limit_reason(returncode))
    return SandboxResult(
        returncode=returncode,
        stdout=out.data.decode(errors="replace"),
        stderr=err.data.decode(errors="replace"),
        timed_out=killer.reason == "wall_time",
        killed_reason=reason,
        truncated=out.cut or err.cut,
        duration_s=time.perf_counter() - start,
        limits_scope=limits_scope,
    )
