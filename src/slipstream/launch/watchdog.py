"""Die with the launcher: every process of a `slipstream rl` run (trainer ranks, orchestrator, each vLLM process via
the vLLM plugin) watches the launcher named in SLIPSTREAM_LAUNCHER and SIGKILLs itself once it is gone, so no
orphan outlives a launcher killed by SIGKILL (which no signal handler or PR_SET_PDEATHSIG of a grandchild covers)."""

import os
import signal
import sys
import threading
import time

import psutil

from slipstream.rundir import LAUNCHER_ENV

POLL_S = 0.5
"""How often the launcher is checked: an orphan lives at most about this long."""
_CREATE_TIME_TOLERANCE_S = 0.005
"""Create times are read from /proc in 10 ms ticks; a recycled pid has another."""

_lock = threading.Lock()
_started_in_pid: int | None = None
"""Pid of the process whose watchdog thread runs (a forked child has none: threads do not survive fork)."""


def parse_launcher(value: str) -> tuple[int, float]:
    """`<pid>:<create_time>` -> (pid, create_time); raise ValueError naming the variable when malformed."""
    try:
        pid, created = value.split(":", 1)
        return int(pid), float(created)
    except ValueError:
        raise ValueError(
            f"{LAUNCHER_ENV}={value!r} is not `<pid>:<create_time>`; unset it (only `slipstream rl` sets it)"
        ) from None


def launcher_alive(pid: int, create_time: float) -> bool:
    """Whether process `pid` still is the one created at `create_time` and not a zombie."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > _CREATE_TIME_TOLERANCE_S:
            return False  # the pid was recycled
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True  # it exists; only its details are hidden


def start_from_env() -> bool:
    """If LAUNCHER_ENV is set, start (once per process, again in forked children) a daemon thread that SIGKILLs
    this process when the launcher is gone; return whether a watchdog runs. Safe to call from any thread."""
    global _started_in_pid
    value = os.environ.get(LAUNCHER_ENV)
    if not value:
        return False
    pid, create_time = parse_launcher(value)
    with _lock:
        if _started_in_pid == os.getpid():
            return True
        if _started_in_pid is None:
            os.register_at_fork(after_in_child=_restart_in_child)
        _started_in_pid = os.getpid()
    if not launcher_alive(pid, create_time):
        _die(pid)
    thread = threading.Thread(target=_watch, args=(pid, create_time), name="slipstream-watchdog", daemon=True)
    thread.start()
    return True


def _restart_in_child() -> None:
    global _lock, _started_in_pid
    _lock = threading.Lock()  # another thread may have held it at the fork
    _started_in_pid = None
    start_from_env()


def _watch(pid: int, create_time: float) -> None:
    while launcher_alive(pid, create_time):
        time.sleep(POLL_S)
    _die(pid)


def _die(launcher_pid: int) -> None:
    """SIGKILL this process (every thread, without cleanup that could hang on dead peers)."""
    print(f"[slipstream] launcher (pid {launcher_pid}) is gone; pid {os.getpid()} exits", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
