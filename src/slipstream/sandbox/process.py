"""Running one sandbox command: wall-clock limit, capped output capture, and killing the whole process group."""

import asyncio
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

KILL_GRACE_S = 5.0
"""How long to wait for the pipes to close after the process group was killed."""
_CHUNK = 65536


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one command. `returncode` is 128+N when a signal N ended it (shell convention)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    """Which limit ended the command: "wall_time", "cpu_time", "output_limit", "file_size"; None otherwise
    (a memory limit makes allocations fail inside the program, it does not kill it)."""
    truncated: bool = False
    """stdout or stderr was cut at `max_output_bytes`."""
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_reason is None


class _Killer:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
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
) -> SandboxResult:
    """Run `argv` in its own session; kill the session at `wall_seconds` or when a stream exceeds the cap."""
    start = time.perf_counter()
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        **popen_kwargs,  # type: ignore[arg-type]
    )
    killer = _Killer(process)
    out, err = _Capture(), _Capture()
    overflow = lambda: killer.kill("output_limit")  # noqa: E731
    tasks = [
        asyncio.ensure_future(_pump(process.stdout, max_output_bytes, out, overflow)),  # type: ignore[arg-type]
        asyncio.ensure_future(_pump(process.stderr, max_output_bytes, err, overflow)),  # type: ignore[arg-type]
        asyncio.ensure_future(process.wait()),
        asyncio.ensure_future(_feed(process.stdin, stdin)),  # type: ignore[arg-type]
    ]
    try:
        await _wait_or_kill(tasks, killer, wall_seconds)
    except BaseException:  # cancelled by the caller: nothing outlives its command, no pipe outlives the loop
        killer.kill_group()
        _close_transport(process)
        raise
    finally:
        for task in tasks:
            task.cancel()
    returncode = await process.wait() if process.returncode is None else process.returncode
    killer.kill_group()
    returncode = 128 - returncode if returncode < 0 else returncode
    reason = killer.reason or _limit_reason(returncode)
    return SandboxResult(
        returncode=returncode,
        stdout=out.data.decode(errors="replace"),
        stderr=err.data.decode(errors="replace"),
        timed_out=killer.reason == "wall_time",
        killed_reason=reason,
        truncated=out.cut or err.cut,
        duration_s=time.perf_counter() - start,
    )
