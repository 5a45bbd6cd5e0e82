"""Isolation with bubblewrap: detection (does it work on this machine?) and the command line of one sandbox.

A sandbox gets fresh user, pid, network (loopback only), ipc, uts and cgroup namespaces, a read-only view of the
system (/usr, the /bin, /lib links and an allowlist of /etc: loader, certificates, alternatives, Python's config,
with synthetic passwd, group, hosts and hostname that name no host account or machine), a private /dev, /proc and
memory-backed /tmp, one writable directory, the workdir, mounted at /workspace, a seccomp filter (sandbox/seccomp.py)
and only the environment variables `sandbox_env` lists. When the caller is root, the sandbox runs as `nobody`
(uid 65534): root inside a user namespace is still root to the files it can see.
"""

import contextlib
import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.sandbox.limits import SandboxLimits

SANDBOX_UID = 65534
"""uid/gid (`nobody`/`nogroup`) a root caller's sandboxes run as."""
INNER_WORKDIR = "/workspace"
"""Where the writable workdir appears inside the sandbox."""
_SYSTEM_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC_ALLOWLIST = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone", "ssl", "pki",
    "ca-certificates", "ca-certificates.conf", "nsswitch.conf", "host.conf", "gai.conf", "protocols", "services",
    "mime.types", "magic", "os-release", "inputrc", "bash.bashrc", "python3",
)  # fmt: skip
"""Entries of the host's /etc a sandbox sees (read-only, where they exist), plus /etc/python3.X. Everything else
there (machine-id, host accounts, credentials some tools keep in /etc, ...) stays invisible."""
_PROBE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Isolation:
    """Whether sandboxes can be isolated here, and how."""

    available: bool
    reason: str
    """What was found: why isolation is impossible, or what is used."""
    bwrap: str | None = None
    prlimit: str | None = None
    run_as: int | None = None
    """uid/gid the sandbox drops to before bwrap (root callers), None to keep the caller's."""


def sandbox_env(home: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed command (nothing is inherited from the caller)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "LANG": "C.UTF-8",
        "TMPDIR": "/tmp",
        "PYTHONUNBUFFERED": "1",
    }
    env.update(extra or {})
    return env


def _system_mounts() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    etc = [*ETC_ALLOWLIST, *sorted(p.name for p in Path("/etc").glob("python3.*"))]
    for name in etc:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for name in _SYSTEM_DIRS:
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


def synthetic_etc(uid: int) -> dict[str, bytes]:
    """/etc files written for the sandbox instead of the host's: no host account, group or machine name shows."""
    users = {0: "root", 65534: "nobody"}
    users.setdefault(uid, "sandbox")
    passwd = "".join(
        f"{name}:x:{n}:{n}:{name}:{INNER_WORKDIR if n == uid else '/'}:/bin/sh\n" for n, name in users.items()
    )
    return {
        "/etc/passwd": passwd.encode(),
        "/etc/group": "".join(f"{name}:x:{n}:\n" for n, name in users.items()).encode(),
        "/etc/hosts": b"127.0.0.1 localhost sandbox\n::1 localhost\n",
        "/etc/hostname": b"sandbox\n",
    }


@dataclass
class CommandFiles:
    """File descriptors one bwrap invocation reads (each command needs its own: bwrap consumes them)."""

    data: dict[str, int] = field(default_factory=dict)
    """Path inside the sandbox -> fd holding the file's content."""
    seccomp: int | None = None
    """fd holding the compiled seccomp BPF program."""

    @property
    def fds(self) -> tuple[int, ...]:
        return (*self.data.values(), *([] if self.seccomp is None else [self.seccomp]))


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)  # close-on-exec: only the command it is passed to (pass_fds) inherits it
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@contextlib.contextmanager
def command_files(uid: int, seccomp: bytes | None) -> Iterator[CommandFiles]:
    """Fresh fds with the synthetic /etc files and the seccomp program, closed on exit (after the spawn)."""
    files = CommandFiles()
    try:
        for path, data in synthetic_etc(uid).items():
            files.data[path] = _memfd("slipstream-sandbox-etc", data)
        if seccomp is not None:
            files.seccomp = _memfd("slipstream-seccomp", seccomp)
        yield files
    finally:
        for fd in files.fds:
            os.close(fd)


def bwrap_command(
    isolation: Isolation,
    workdir: Path,
    limits: SandboxLimits,
    env: dict[str, str],
    ro_binds: tuple[Path, ...] = (),
    files: CommandFiles | None = None,
) -> list[str]:
    """bwrap + prlimit prefix of a command run in `workdir` (append the command's argv); `files` must stay open
    until the command has started."""
    if not isolation.available or isolation.bwrap is None or isolation.prlimit is None:
        raise RuntimeError(f"bwrap_command needs working isolation: {isolation.reason}")
    argv = [isolation.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    argv += ["--new-session", "--hostname", "sandbox", "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    argv += _system_mounts()
    files = files or CommandFiles()
    for path, fd in files.data.items():
        argv += ["--ro-bind-data", str(fd), path]
    if files.seccomp is not None:
        argv += ["--seccomp", str(files.seccomp)]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb * 1024 * 1024), "--tmpfs", "/tmp"]
    for path in ro_binds:
        argv += ["--ro-bind", str(path), str(path)]
    argv += ["--bind", str(workdir), INNER_WORKDIR, "--remount-ro", "/", "--chdir", INNER_WORKDIR]
    # prlimit runs inside the sandbox: RLIMIT_NPROC then counts the processes of this sandbox's user namespace only.
    return argv + ["--", isolation.prlimit, *limits.prlimit_args(), "--"]


def preexec_user(isolation: Isolation) -> dict[str, object]:
    """Popen keyword arguments that drop a root caller to the sandbox uid/gid."""
    if isolation.run_as is None:
        return {}
    return {"user": isolation.run_as, "group": isolation.run_as, "extra_groups": []}


@functools.cache
def detect_isolation() -> Isolation:
    """Probe once per process whether bwrap sandboxes work here (binaries, user namespaces, mounts)."""
    bwrap, prlimit = shutil.which("bwrap"), shutil.which("prlimit")
    if bwrap is None:
        return Isolation(False, "bwrap is not installed (Debian package: bubblewrap)")
    if prlimit is None:
        return Isolation(False, "prlimit is not installed (Debian package: util-linux)")
    run_as = SANDBOX_UID if os.geteuid() == 0 else None
    candidate = Isolation(True, f"bubblewrap ({bwrap})", bwrap, prlimit, run_as)
    with tempfile.TemporaryDirectory(prefix="slipstream-sandbox-probe-") as tmp:
        if run_as is not None:
            os.chown(tmp, run_as, run_as)
        argv = bwrap_command(candidate, Path(tmp), SandboxLimits(), sandbox_env(INNER_WORKDIR))
        probe = "touch /workspace/probe && ! touch /probe 2>/dev/null && ! touch /usr/probe 2>/dev/null"
        try:
            done = subprocess.run(
                [*argv, "sh", "-c", probe],
                capture_output=True,
                timeout=_PROBE_TIMEOUT_S,
                **preexec_user(candidate),  # type: ignore[arg-type]
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return Isolation(False, f"bwrap probe could not run: {e}")
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
            version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
            return Isolation(
                False,
                f"{version or 'bwrap'} cannot create a sandbox here ({detail}); it needs bubblewrap >= 0.8 and "
                "user namespaces that an unprivileged user may create",
            )
    return candidate
