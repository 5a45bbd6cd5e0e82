"""Whole-tree limits of one sandboxed command: a cgroup per command caps memory, process count and CPU of every
process the command starts together (rlimits only cap each process on its own).

cgroup v2 is used where its memory and pids controllers can be delegated to us: the directory named by
`SLIPSTREAM_SANDBOX_CGROUP` (one we may write, e.g. a systemd unit with `Delegate=yes`), else our own cgroup when
it is the hierarchy's root. Else cgroup v1 (memory + pids hierarchies, root only). Where neither works, the sandbox
keeps only per-process rlimits and says so loudly (see `Sandbox.tree_limits`); nothing is silent.
"""

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.sandbox.limits import SandboxLimits

CGROUP_ENV = "SLIPSTREAM_SANDBOX_CGROUP"
"""Environment variable naming a delegated cgroup v2 directory under which per-command cgroups are created."""
OVERHEAD_PROCESSES = 3
"""Processes of the sandbox machinery itself in the cgroup (bwrap's monitor and init, the gate shell's exec chain)."""
_CPU_PERIOD_US = 100_000
_REQUIRED_V1 = ("memory", "pids")
_OPTIONAL_V1 = ("cpu", "cpuacct")


@dataclass(frozen=True)
class CgroupSupport:
    """How this machine caps a command's whole process tree."""

    version: int | None
    """2 or 1; None where no cgroup can be created (per-process rlimits only)."""
    reason: str
    """What is used, or why whole-tree limits are unavailable and how to get them."""
    parents: dict[str, Path] = field(default_factory=dict)
    """Controller ("unified" for v2) -> directory under which each command's cgroup is created."""

    @property
    def scope(self) -> str:
        return f"cgroup_v{self.version}" if self.version else "per_process"


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                found.append((left.split()[4], fstype, set(options.split(","))))
    return found


def _own_paths() -> dict[str, str]:
    """Controller ("unified" for v2) -> our cgroup path, from /proc/self/cgroup."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else ["unified"]:
                paths[name] = path
    return paths


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _probe(parents: dict[str, Path], version: int) -> None:
    """Create, limit and remove one cgroup under each parent (raises OSError where we may not)."""
    limits = SandboxLimits(memory_mb=64, max_processes=4)
    group = CommandCgroup(CgroupSupport(version, "probe", parents), limits)
    group.remove_now()


def _detect_v2(mounts: list[tuple[str, str, set[str]]]) -> CgroupSupport:
    unified = [point for point, fstype, _ in mounts if fstype == "cgroup2"]
    if not unified:
        return CgroupSupport(None, "no cgroup v2 hierarchy is mounted")
    own = unified[0] + _own_paths().get("unified", "/")
    base = Path(os.environ.get(CGROUP_ENV) or own)
    try:
        available = (base / "cgroup.controllers").read_text().split()
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            return CgroupSupport(None, f"cgroup v2 at {base} lacks the {'/'.join(missing)} controller(s)")
        wanted = [c for c in ("memory", "pids", "cpu") if c in available]
        enabled = (base / "cgroup.subtree_control").read_text().split()
        if any(c not in enabled for c in wanted):
            _write(base / "cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        _probe({"unified": base}, 2)
    except OSError as e:
        return CgroupSupport(
            None,
            f"cannot create a cgroup v2 under {base} ({e.strerror or e}): set {CGROUP_ENV} to a delegated cgroup v2 "
            "directory holding no processes itself, with memory and pids available (e.g. systemd Delegate=yes)",
        )
    return CgroupSupport(2, f"cgroup v2 under {base}", {"unified": base})


def _detect_v1(mounts: list[tuple[str, str, set[str]]]) -> CgroupSupport:
    own = _own_paths()
    parents = {}
    for controller in _REQUIRED_V1 + _OPTIONAL_V1:
        points = [point for point, fstype, options in mounts if fstype == "cgroup" and controller in options]
        if points and controller in own:
            parents[controller] = Path(points[0] + own[controller])
    missing = [c for c in _REQUIRED_V1 if c not in parents]
    if missing:
        return CgroupSupport(None, f"no cgroup v1 {'/'.join(missing)} hierarchy is mounted")
    try:
        _probe(parents, 1)
    except OSError as e:
        return CgroupSupport(None, f"cannot create a cgroup v1 under {parents['memory']} ({e.strerror or e})")
    extra = "" if "cpu" in parents else " (no cpu controller: CPU bandwidth not capped)"
    return CgroupSupport(1, f"cgroup v1 under {parents['memory']}{extra}", parents)


@functools.cache
def detect_cgroups() -> CgroupSupport:
    """Probe once per process whether commands can get their own cgroup here, v2 first."""
    mounts = _mounts()
    v2 = _detect_v2(mounts)
    if v2.version:
        return v2
    v1 = _detect_v1(mounts)
    if v1.version:
        return v1
    return CgroupSupport(
        None,
        f"{v2.reason}; {v1.reason}. Only per-process limits apply: memory_mb per process (RLIMIT_AS) and "
        "max_processes (RLIMIT_NPROC), so a command may use up to memory_mb x max_processes in total",
    )


class CommandCgroup:
    """One command's cgroup: created with its limits, joined by the command's first process before it runs anything,
    watched (OOM kills, CPU time), killed as a whole and removed."""

    def __init__(self, support: CgroupSupport, limits: SandboxLimits) -> None:
        self.version = support.version
        name = f"slipstream-sandbox-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.dirs = {controller: parent / name for controller, parent in support.parents.items()}
        for path in dict.fromkeys(self.dirs.values()):
            path.mkdir()
        try:
            self._set_limits(limits)
        except OSError:
            self.remove_now()
            raise

    def _file(self, controller: str, name: str) -> Path:
        return self.dirs["unified" if self.version == 2 else controller] / name

    def _set_limits(self, limits: SandboxLimits) -> None:
        memory = str(limits.memory_mb * 1024 * 1024)
        pids = str(limits.max_processes + OVERHEAD_PROCESSES)
        if self.version == 2:
            for name, value in (("memory.max", memory), ("memory.swap.max", "0"), ("memory.oom.group", "1")):
                if name == "memory.max" or self._file("memory", name).exists():
                    _write(self._file("memory", name), value)
            _write(self._file("pids", "pids.max"), pids)
            if self._file("cpu", "cpu.max").exists():
                _write(self._file("cpu", "cpu.max"), f"{round(limits.cpus * _CPU_PERIOD_US)} {_CPU_PERIOD_US}")
            return
        _write(self._file("memory", "memory.limit_in_bytes"), memory)
        if self._file("memory", "memory.memsw.limit_in_bytes").exists():  # no swapping past the cap either
            _write(self._file("memory", "memory.memsw.limit_in_bytes"), memory)
        _write(self._file("pids", "pids.max"), pids)
        if "cpu" in self.dirs:
            _write(self._file("cpu", "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
            _write(self._file("cpu", "cpu.cfs_quota_us"), str(round(limits.cpus * _CPU_PERIOD_US)))

    def add(self, pid: int) -> None:
        """Move `pid` (not yet running the command) into this cgroup."""
        for path in dict.fromkeys(self.dirs.values()):
            _write(path / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory cap."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        for line in self._file("memory", name).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def cpu_seconds(self) -> float | None:
        """CPU time used by the whole tree so far (None where cgroup v1 has no cpuacct hierarchy)."""
        if self.version == 2:
            for line in self._file("cpu", "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return None
        if "cpuacct" not in self.dirs:
            return None
        return int(self._file("cpuacct", "cpuacct.usage").read_text()) / 1e9

    def pids(self) -> list[int]:
        path = self._file("pids", "cgroup.procs")
        try:
            return [int(p) for p in path.read_text().split()]
        except FileNotFoundError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (the tree cannot escape it: the sandbox sees no cgroupfs)."""
        kill_file = self._file("pids", "cgroup.kill")
        if self.version == 2 and kill_file.exists():
            _write(kill_file, "1")
            return
        for _ in range(3):  # processes forked while we kill get killed on the next pass
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove_now(self, timeout_s: float = 2.0) -> None:
        """Kill what is left and remove the cgroup directories (dying processes may hold them a moment)."""
        deadline = time.monotonic() + timeout_s
        for path in dict.fromkeys(self.dirs.values()):
            while path.exists():
                try:
                    path.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    self.kill()
                    time.sleep(0.01)
