"""Resource limits of one sandboxed command, and the `prlimit` arguments that enforce the per-process ones."""

from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one command run in a sandbox. Memory, CPU, file size, processes and open files are kernel rlimits
    (`prlimit`) of every process in the sandbox; wall time and output size are enforced by the parent."""

    wall_seconds: float = 60.0
    """Wall-clock limit of one command; the whole sandbox is killed when it expires."""
    cpu_seconds: int = 60
    """CPU-time limit per process (SIGXCPU at the limit, SIGKILL one second later)."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS): allocations beyond it fail (MemoryError, ENOMEM)."""
    max_output_bytes: int = 64 * 1024
    """Most bytes kept per stream (stdout, stderr); a command that writes more is killed and its output truncated."""
    max_file_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE): writes beyond it fail with EFBIG / SIGXFSZ."""
    max_processes: int = 64
    """Most processes (and threads) alive at once inside one sandbox (RLIMIT_NPROC in the sandbox's own user
    namespace, so concurrent sandboxes do not share the budget). Not enforced without isolation when run as root."""
    max_open_files: int = 256
    """Most open file descriptors per process (RLIMIT_NOFILE)."""
    tmp_mb: int = 64
    """Size of the private, memory-backed /tmp of each command (isolated mode only; gone when the command ends)."""

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_mb", "max_output_bytes", "max_file_mb", "max_processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")
        if self.max_open_files < 16:
            raise ValueError(f"SandboxLimits.max_open_files must be >= 16, got {self.max_open_files}")
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
