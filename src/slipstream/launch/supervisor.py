"""Start child processes in their own process groups, watch them, and stop all of them together.

No orphans: every child leads its own session, so stopping a child signals its whole group; descendants
that leave the group (torchrun starts its workers in new sessions) are tracked on every check and signalled
too. Children also get SIGKILL if the launcher itself dies (PR_SET_PDEATHSIG); their descendants end themselves
then through the environment marker's watchdog (launch/watchdog.py).
"""

import ctypes
import os
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from slipstream.launch.plan import ProcessSpec

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux/glibc: process groups still give a clean stop


def _child_setup(cpus: tuple[int, ...]) -> Callable[[], None]:
    """What a child runs before its program: die with the launcher, and keep to `cpus` (if any; inherited by all it
    starts)."""

    def setup() -> None:
        _die_with_parent()
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup


class ChildFailed(RuntimeError):
    """A child process exited when it should not have."""

    def __init__(self, name: str, returncode: int, log_path: Path, log_offset: int = 0):
        self.name, self.returncode, self.log_path = name, returncode, log_path
        self.log_offset = log_offset
        """Where this start of the child began writing: logs are appended to across launches (resume) and
        restarts, and the failure is explained by this start's lines only."""
        how = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        super().__init__(f"{name} {how} (log: {log_path})")

    def report(self) -> list[str]:
        """What a launcher says about it: the failure with the last lines of this start's log, and the first error
        line in it when there is one."""
        lines = [f"error: {self}; last lines of its log:\n{tail(self.log_path, offset=self.log_offset)}"]
        if (cause := first_error(self.log_path, self.log_offset)) is not None:
            lines.append(f"first error in {self.log_path.name}: {cause}")
        return lines


class Supervisor:
    """Owns the children of one run."""

    def __init__(self, grace_s: float = 10.0, env: dict[str, str] | None = None):
        self.grace_s = grace_s
        self.env = dict(env or {})
        """Variables given to every child (e.g. the run's environment marker, rundir.launcher_env), under each
        spec's own."""
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_offsets: dict[str, int] = {}
        """Per child: size of its log when it was (last) started."""
        self.specs: dict[str, ProcessSpec] = {}
        self.descendants: dict[str, dict[int, float]] = {}
        """Per child: pid -> create time of every process seen below it (a pid is only signalled if it is still
        that one)."""

    def start(self, spec: ProcessSpec) -> None:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            self.log_offsets[spec.name] = log.seek(0, os.SEEK_END)
            self.procs[spec.name] = subprocess.Popen(
                spec.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env, **spec.env},
                start_new_session=True,
                preexec_fn=_child_setup(spec.cpus),
            )
        self.specs[spec.name] = spec

    def check(self, ignore: tuple[str, ...] = ()) -> list[str]:
        """Raise ChildFailed for a child that failed (except those in `ignore`); return the names of children that
        finished cleanly."""
        self._track_descendants()
        finished = []
        for name, proc in self.procs.items():
            rc = proc.poll()
            if rc is None or name in ignore:
                continue
            if rc != 0 or self.specs[name].must_run_to_end:
                raise ChildFailed(name, rc, self.specs[name].log_path, self.log_offsets.get(name, 0))
            finished.append(name)
        return finished

    def restart(self, name: str) -> None:
        """Start a child that died again, after killing what is left of it (its group and its descendants, which
        could hold its port or memory)."""
        proc = self.procs[name]
        self._track_descendants()
        _signal_group(proc, signal.SIGKILL)
        proc.wait()
        leftovers = self._signal_descendants(signal.SIGKILL, names=(name,))
        psutil.wait_procs(leftovers, timeout=self.grace_s)
        self.descendants.pop(name, None)
        self.start(self.specs[name])

    def _track_descendants(self) -> None:
        for name, proc in self.procs.items():
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    self.descendants.setdefault(name, {}).setdefault(child.pid, child.create_time())
            except psutil.Error:
                continue  # the child itself is gone; its descendants were recorded earlier

    def _signal_descendants(self, sig: int, names: tuple[str, ...] | None = None) -> list[psutil.Process]:
        """Signal the recorded descendants (of the children `names`, default all); return those signalled."""
        signalled = []
        for name, pids in self.descendants.items():
            if names is not None and name not in names:
                continue
            for pid, created in list(pids.items()):
                try:
                    p = psutil.Process(pid)
                    if p.create_time() == created:
                        p.send_signal(sig)
                        signalled.append(p)
                except psutil.Error:
                    pids.pop(pid, None)
        return signalled

    def stop_all(self) -> None:
        """SIGTERM every child's process group and descendants, then SIGKILL what is left after the grace period."""
        self._track_descendants()
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        self._signal_descendants(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)  # also reaps grandchildren left in the group
            proc.wait()
        self._signal_descendants(signal.SIGKILL)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


_ERROR_LINE = re.compile(r"^[\w.]*(?:Error|Exception)(?::\s|:$)")
"""A Python exception line (`OSError: ...`, `safetensors._safetensors_rust.SafetensorError: ...`)."""


def first_error(path: Path, offset: int = 0) -> str | None:
    """The first exception line of a log from byte `offset` on (the root cause, before launcher wrappers such as
    torchrun repeat it in their own terms), or None."""
    for line in _log_lines(path, offset) or []:
        if _ERROR_LINE.match(line) and "ChildFailedError" not in line:
            return line.rstrip()
    return None


def tail(path: Path, num_lines: int = 30, offset: int = 0) -> str:
    """The last `num_lines` lines of a log from byte `offset` on."""
    lines = _log_lines(path, offset)
    return "(no log written)\n" if lines is None else "".join(deque(lines, maxlen=num_lines))


def _log_lines(path: Path, offset: int) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines(keepends=True)
    except FileNotFoundError:
        return None


class StopRequested(Exception):
    """SIGINT or SIGTERM reached a launcher inside `supervising`."""


@contextmanager
def supervising(sup: Supervisor) -> Iterator[Supervisor]:
    """Within the block SIGINT and SIGTERM raise StopRequested (named after the signal); however the block ends,
    every child of `sup` is then stopped, SIGINT ignored meanwhile (a second Ctrl-C must not interrupt the clean
    stop), and the previous handlers come back."""

    def raise_stop(signum: int, frame: object) -> None:
        raise StopRequested(signal.Signals(signum).name)

    old = {s: signal.signal(s, raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield sup
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        sup.stop_all()
        for sig, handler in old.items():
            signal.signal(sig, handler)
