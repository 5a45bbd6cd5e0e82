"""The one owner of a run directory's layout: paths and markers of every plane (rollouts, weights, checkpoints,
logs, configs, metrics, evaluations, plots), listing step folders, pruning published weights, and the run lock
with the environment marker that make one live run per directory."""

import fcntl
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from slipstream.utils.fs import fsync_dir

READY = "READY"
"""Marker of a complete published `weights/step_N/` folder."""
PROBE = "probe.json"
"""The trainer's log-prob probe inside `weights/step_N/` (checked against inference after a load)."""
COMMITTED = "COMMITTED"
"""Marker of a committed checkpoint: `checkpoints/step_N/COMMITTED` and `checkpoints/step_N/<part>/COMMITTED`."""
TRAINER_PART = "trainer"
ORCHESTRATOR_PART = "orchestrator"
METRICS_FILE = "metrics.jsonl"
WEIGHT_CHECKS_FILE = "weight_checks.jsonl"
ONLINE_EVAL_FILE = "eval/online.jsonl"
"""JSON-lines files of the run, relative to its root (transport/checkpoints.py truncates them at resume)."""
RUN_DIR_ENV = "SLIPSTREAM_RUN_DIR"
"""Set by `slipstream rl` for every child: the resolved run directory, so its processes can be found by a scan."""
LAUNCHER_ENV = "SLIPSTREAM_LAUNCHER"
"""Set by `slipstream rl` for every child: `<pid>:<create_time>` of the launcher (launch/watchdog.py)."""
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dirs(folder: Path) -> dict[int, Path]:
    """step -> path of the `step_N` folders directly in `folder` (none when it does not exist). Temporary folders
    of writers (dot-names) never match."""
    if not Path(folder).is_dir():
        return {}
    return {int(m.group(1)): p for p in Path(folder).iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()}


class RunDir:
    """Paths of one run directory (`output_dir`); building them does not touch the filesystem."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    @property
    def rollouts_root(self) -> Path:
        return self.root / "rollouts"

    @property
    def weights_root(self) -> Path:
        return self.root / "weights"

    @property
    def checkpoints_root(self) -> Path:
        return self.root / "checkpoints"

    @property
    def config_dir(self) -> Path:
        return self.root / "config"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    @property
    def plots_dir(self) -> Path:
        return self.root / "plots"

    @property
    def metrics_path(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def weight_checks_path(self) -> Path:
        return self.root / WEIGHT_CHECKS_FILE

    @property
    def online_eval_path(self) -> Path:
        return self.root / ONLINE_EVAL_FILE

    @property
    def admin_token_path(self) -> Path:
        return self.root / "admin_token"

    @property
    def lock_path(self) -> Path:
        return self.root / ".lock"

    def rollouts_dir(self, step: int) -> Path:
        return self.rollouts_root / f"step_{step}"

    def batch_path(self, step: int, rank: int) -> Path:
        return self.rollouts_dir(step) / f"rank_{rank}.msgpack"

    def weights_dir(self, step: int) -> Path:
        return self.weights_root / f"step_{step}"

    def ready_marker(self, step: int) -> Path:
        return self.weights_dir(step) / READY

    def probe_path(self, step: int) -> Path:
        return self.weights_dir(step) / PROBE

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints_root / f"step_{step}"

    def checkpoint_marker(self, step: int) -> Path:
        return self.checkpoint_dir(step) / COMMITTED

    def checkpoint_part_dir(self, step: int, part: str) -> Path:
        return self.checkpoint_dir(step) / part

    def checkpoint_part_tmp_dir(self, step: int, part: str) -> Path:
        """Where a part is written before it is renamed to `checkpoint_part_dir` (a dot-name: never listed)."""
        return self.checkpoint_dir(step) / f".{part}.tmp"

    def eval_result_path(self, step: int) -> Path:
        """`slipstream eval` results of the run's step."""
        return self.eval_dir / f"step_{step}.json"

    def log_path(self, name: str) -> Path:
        """`logs/<name>.log` (name: a process such as `trainer`, or `eval_step_3_inference`)."""
        return self.logs_dir / f"{name}.log"

    def config_path(self, name: str) -> Path:
        """`config/<name>.toml`: the resolved config of the run (`rl`) or of one process."""
        return self.config_dir / f"{name}.toml"

    def published_steps(self) -> list[int]:
        """Steps with complete published weights (READY marker), ascending."""
        return sorted(s for s, p in step_dirs(self.weights_root).items() if (p / READY).exists())

    def committed_checkpoint_steps(self) -> list[int]:
        """Steps whose whole-run checkpoint is committed (`checkpoints/step_N/COMMITTED`), ascending."""
        return sorted(s for s, p in step_dirs(self.checkpoints_root).items() if (p / COMMITTED).is_file())


def remove_tree(path: Path) -> None:
    """Delete a folder so that no half-deleted copy is ever seen under its name: rename it away first."""
    doomed = path.with_name(f".deleting_{path.name}")
    if doomed.exists():
        shutil.rmtree(doomed)
    path.rename(doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)


def weights_to_keep(
    published: list[int],
    served: int,
    loading: set[int],
    pending_eval: set[int],
    checkpoint_steps_needed: set[int],
    keep_recent: int,
) -> set[int]:
    """Published weight steps that must stay: the served version and every newer one, versions being loaded or
    verified, versions pending an online evaluation, checkpoint steps resume may need (see
    transport/checkpoints.resume_weight_steps), and the `keep_recent` newest. Pure."""
    if keep_recent < 0:
        raise ValueError(f"keep_recent must be >= 0 (weights.keep_weights), got {keep_recent}")
    ordered = sorted(published)
    keep = {s for s in ordered if s >= served}
    keep |= (loading | pending_eval | checkpoint_steps_needed) & set(ordered)
    if keep_recent:
        keep |= set(ordered[-keep_recent:])
    return keep


def prune_weights(run: RunDir, keep: set[int]) -> list[int]:
    """Delete the `weights/step_N` folders not in `keep` (renamed away, then deleted); return the deleted steps.
    Never touches a step newer than every kept one (published after `keep` was computed) nor a temporary
    folder being written; with an empty `keep` nothing is deleted."""
    if not keep:
        return []
    newest_kept = max(keep)
    doomed = sorted(s for s in step_dirs(run.weights_root) if s not in keep and s < newest_kept)
    for step in doomed:
        remove_tree(run.weights_dir(step))
    return doomed


class RunLockedError(RuntimeError):
    """Another live `slipstream rl` holds the run directory."""


class RunLock:
    """Exclusive `flock` on `<run>/.lock` for a whole run, holding the owner's pid and start time. The kernel drops
    it when the holder dies, even by SIGKILL, so a stale file never blocks a new run."""

    def __init__(self, run: RunDir) -> None:
        self.path = run.lock_path
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock without waiting; raise RunLockedError naming the holder and how to end it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, started = _holder(os.pread(fd, 4096, 0).decode(errors="replace"))
            os.close(fd)
            raise RunLockedError(
                f"run directory {self.path.parent} is in use by another `slipstream rl` (pid {pid}, started "
                f"{started}; lock file {self.path}); wait for it to finish, or stop it with `kill {pid}` (SIGTERM "
                "stops all of its processes), then start again"
            ) from None
        me = psutil.Process()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{me.pid} {me.create_time()!r}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays: deleting it would race with a newcomer locking the old inode)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(text: str) -> tuple[str, str]:
    """(pid, start time) from a lock file's `<pid> <create_time>` ("unknown" / "?" when unreadable)."""
    fields = text.split()
    try:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(fields[1])))
    except (IndexError, ValueError):
        started = "?"
    return (fields[0] if fields else "unknown"), started


@dataclass(frozen=True)
class RunProcess:
    """A live process whose environment marks it as part of a run (RUN_DIR_ENV)."""

    pid: int
    name: str
    cmdline: str

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}: {self.cmdline[:80]})"


def run_processes(run: RunDir) -> list[RunProcess]:
    """This user's live processes (other than this one) started for the run directory `run`, found by the
    RUN_DIR_ENV marker in their environment (`/proc/<pid>/environ`)."""
    target = str(run.root.resolve())
    uid, me = os.getuid(), os.getpid()
    found = []
    for proc in psutil.process_iter(["pid", "name", "uids", "status"]):
        info = proc.info
        if info["pid"] == me or info["uids"] is None or info["uids"].real != uid:
            continue
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            if proc.environ().get(RUN_DIR_ENV) != target:
                continue
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue  # exited meanwhile, or not readable
        found.append(RunProcess(info["pid"], info["name"] or "?", cmdline))
    return found


def wait_no_run_processes(run: RunDir, timeout_s: float, poll_s: float = 0.25) -> None:
    """Wait up to `timeout_s` for the processes of an earlier run of `run` to exit (their watchdogs end them within
    a second of their launcher's death); raise RunLockedError naming those still alive and how to end them."""
    deadline = time.monotonic() + timeout_s
    while alive := run_processes(run):
        if time.monotonic() >= deadline:
            listing = "; ".join(p.describe() for p in alive)
            raise RunLockedError(
                f"processes of an earlier run of {run.root} are still alive: {listing}. End them with "
                f"`kill {' '.join(str(p.pid) for p in alive)}` (`kill -9` if they do not exit), then start again"
            )
        time.sleep(poll_s)


def launcher_env(run: RunDir) -> dict[str, str]:
    """The environment marker `slipstream rl` gives every child: this run directory and this launcher's identity."""
    me = psutil.Process()
    return {RUN_DIR_ENV: str(run.root.resolve()), LAUNCHER_ENV: f"{me.pid}:{me.create_time()!r}"}
