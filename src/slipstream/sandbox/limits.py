"""Resource limits of one sandboxed command, and the `prlimit` arguments that enforce the per-process ones (the
whole-tree ones are a cgroup per command: sandbox/cgroup.py)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one command run in a sandbox. Memory, processes and CPU are capped for the command's whole process
    tree by a cgroup where the machine allows it (`Sandbox.tree_limits`), and per process by kernel rlimits
    (`prlimit`) everywhere; file size and open files are rlimits; wall time and output size are enforced by the
    parent."""

    wall_seconds: float = 60.0
    """Wall-clock limit of one command; the whole sandbox is killed when it expires."""
    cpu_seconds: int = 60
    """CPU-time limit: of the whole tree with a cgroup (killed, reason "cpu_time"), and of each process (SIGXCPU at
    the limit, SIGKILL one second later)."""
    cpus: float = 1.0
    """CPU bandwidth of the whole tree in cores (cgroup cpu controller; not capped without one)."""
    memory_mb: int = 1024
    """Memory of the whole tree with a cgroup (swap included; at the cap the kernel's OOM killer fires and the whole
    command is killed, reason "memory"), and address space per process (RLIMIT_AS: allocations beyond it fail with
    MemoryError / ENOMEM)."""
    max_output_bytes: int = 64 * 1024
    """Most bytes kept per stream (stdout, stderr); a command that writes more is killed and its output truncated."""
    max_file_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE): writes beyond it fail with EFBIG / SIGXFSZ."""
    max_processes: int = 64
    """Most processes (and threads) alive at once inside one sandbox: the cgroup's pids.max (plus the sandbox's own
    few processes) and RLIMIT_NPROC in the sandbox's own user namespace, so concurrent sandboxes do not share the
    budget. Without a cgroup and without isolation, a root caller gets no process cap."""
    max_open_files: int = 256
    """Most open file descriptors per process (RLIMIT_NOFILE)."""
    tmp_mb: int = 64
    """Size of the private, memory-backed /tmp of each command (isolated mode only; gone when the command ends)."""

    def __post_init__(self) -> None:
        for name in (
            "wall_seconds",
            "cpu_seconds",
            "cpus",
            "memory_mb",
            "max_output_bytes",
            "max_file_mb",
            "max_processes",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.max_open_files < 16:
            raise ValueError(f"SandboxLimits.max_open_files must be >= 16, got {self.max_open_files}")
        if self.cpus < 0.01:
            raise ValueError(f"SandboxLimits.cpus must be >= 0.01 (the kernel's smallest CPU quota), got {self.cpus}")
        if self.tmp_mb < 1:
            raise ValueError(f"SandboxLimits.tmp_mb must be >= 1, got {self.tmp_mb}")

    def prlimit_args(self) -> list[str]:
        """`prlimit` options (soft:hard) that set the per-process limits."""
        mib = 1024 * 1024
        return [
            f"--as={self.memory_mb * mib}",
            f"--cpu={self.cpu_seconds}:{self.cpu_seconds + 1}",
            f"--fsize={self.max_file_mb * mib}",
            f"--nproc={self.max_processes}",
            f"--nofile={self.max_open_files}",
            "--core=0",
        ]
