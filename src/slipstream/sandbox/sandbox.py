"""`Sandbox`: run untrusted commands (tool calls, model-written code) in one writable directory, isolated and limited.

Where isolation is impossible the constructor refuses, unless the caller opts out with `allow_unsandboxed=True`;
then commands run directly (same limits except the process count, no isolation) after a loud warning. Where the
machine cannot give each command its own cgroup, or lacks libseccomp, sandboxes still run, with a loud warning
saying which protection is missing (`Sandbox.tree_limits`, `SandboxResult.limits_scope`).
"""

import asyncio
import logging
import os
import shutil
import stat
import warnings
from collections.abc import Sequence
from pathlib import Path

from slipstream.sandbox.cgroup import CgroupSupport, CommandCgroup, detect_cgroups
from slipstream.sandbox.isolation import (
    INNER_WORKDIR,
    CommandFiles,
    Isolation,
    bwrap_command,
    command_files,
    detect_isolation,
    preexec_user,
    sandbox_env,
)
from slipstream.sandbox.limits import SandboxLimits
from slipstream.sandbox.process import SandboxResult, run_process
from slipstream.sandbox.seccomp import seccomp_program, seccomp_unavailable_reason

logger = logging.getLogger(__name__)
_warned_unsandboxed = False
_warned_missing: set[str] = set()


class SandboxUnavailable(RuntimeError):
    """Untrusted code cannot be isolated on this machine and the caller did not opt out."""


def _warn_unsandboxed(reason: str) -> None:
    global _warned_unsandboxed
    if _warned_unsandboxed:
        return
    _warned_unsandboxed = True
    message = (
        f"RUNNING UNTRUSTED CODE WITHOUT A SANDBOX (allow_unsandboxed=True): {reason}. Commands can read and write "
        "every file this user can, use the network and signal its processes; only rlimits and timeouts apply."
    )
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _warn_missing(what: str, message: str) -> None:
    """Warn once per process that a protection is missing (log + RuntimeWarning), never silently."""
    if what in _warned_missing:
        return
    _warned_missing.add(what)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


class Sandbox:
    """Runs commands in `workdir` (the only writable directory), one fresh sandbox per command."""

    def __init__(
        self,
        workdir: str | Path,
        limits: SandboxLimits | None = None,
        *,
        allow_unsandboxed: bool = False,
        ro_binds: Sequence[str | Path] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        """`ro_binds`: extra host paths visible read-only at the same place (e.g. a virtualenv); `env`: extra
        environment variables (the sandbox inherits none from the caller)."""
        self.workdir = Path(workdir).resolve()
        if not self.workdir.is_dir():
            raise ValueError(f"sandbox workdir {self.workdir} is not an existing directory")
        self.limits = limits or SandboxLimits()
        self.isolation: Isolation = detect_isolation()
        if not self.isolation.available:
            if not allow_unsandboxed:
                raise SandboxUnavailable(
                    f"cannot isolate untrusted code on this machine: {self.isolation.reason}. Install bubblewrap "
                    "and allow user namespaces, or pass allow_unsandboxed=True to run it WITHOUT isolation."
                )
            if shutil.which("prlimit") is None:
                raise SandboxUnavailable("prlimit is not installed (Debian package util-linux): limits cannot apply")
            _warn_unsandboxed(self.isolation.reason)
        self.tree_limits: CgroupSupport = detect_cgroups()
        """Whether memory, processes and CPU are capped for each command's whole tree (a cgroup) or per process."""
        if self.tree_limits.version is None:
            _warn_missing("cgroup", f"SANDBOX LIMITS ARE PER PROCESS ONLY: {self.tree_limits.reason}")
        self.seccomp = seccomp_program() if self.isolated else None
        if self.isolated and self.seccomp is None:
            _warn_missing("seccomp", f"SANDBOXES RUN WITHOUT A SECCOMP FILTER: {seccomp_unavailable_reason()}")
        self.ro_binds = tuple(Path(p).resolve() for p in ro_binds)
        for path in self.ro_binds:
            if not path.exists():
                raise ValueError(f"sandbox ro_binds: {path} does not exist")
        self.extra_env = dict(env or {})
        if self.isolated and self.isolation.run_as is not None:
            _check_traversable(self.workdir)
            self.claim_workdir()

    @property
    def isolated(self) -> bool:
        return self.isolation.available

    @property
    def inner_workdir(self) -> str:
        """Path of the workdir as commands see it."""
        return INNER_WORKDIR if self.isolated else str(self.workdir)

    def claim_workdir(self) -> None:
        """Give the workdir tree to the sandbox user (root callers), so that files the host wrote are writable."""
        uid = self.isolation.run_as
        if uid is None:
            return
        for root, dirs, files in os.walk(self.workdir):
            os.chown(root, uid, uid, follow_symlinks=False)
            for name in dirs + files:
                os.chown(os.path.join(root, name), uid, uid, follow_symlinks=False)

    def command(self, command: Sequence[str] | str, files: CommandFiles | None = None) -> list[str]:
        """Full argv of `command` (an argv list, or a bash script string) with isolation and per-process limits
        applied; `files` (from `isolation.command_files`) adds the synthetic /etc files and the seccomp filter."""
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise ValueError("sandbox command is empty")
        env = sandbox_env(self.inner_workdir, self.extra_env)
        if self.isolated:
            return bwrap_command(self.isolation, self.workdir, self.limits, env, self.ro_binds, files) + argv
        return ["prlimit", *self.limits.prlimit_args(), "--", *argv]

    async def arun(
        self, command: Sequence[str] | str, stdin: str | bytes | None = None, timeout: float | None = None
    ) -> SandboxResult:
        """Run `command` to completion or until a limit ends it; `timeout` overrides `limits.wall_seconds`."""
        wall = self.limits.wall_seconds if timeout is None else timeout
        if not wall > 0:
            raise ValueError(f"sandbox timeout must be > 0 seconds, got {wall}")
        data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")
        popen_kwargs = preexec_user(self.isolation) if self.isolated else {}
        cgroup = CommandCgroup(self.tree_limits, self.limits) if self.tree_limits.version else None
        uid = self.isolation.run_as if self.isolation.run_as is not None else os.getuid()
        try:
            with command_files(uid, self.seccomp) as files:
                argv = self.command(command, files if self.isolated else None)
                return await run_process(
                    argv,
                    cwd=str(self.workdir),
                    env=sandbox_env(self.inner_workdir, self.extra_env),
                    stdin=data,
                    wall_seconds=wall,
                    max_output_bytes=self.limits.max_output_bytes,
                    popen_kwargs={**popen_kwargs, "pass_fds": files.fds if self.isolated else ()},
                    cgroup=cgroup,
                    cpu_seconds=self.limits.cpu_seconds,
                    limits_scope=self.tree_limits.scope,
                )
        finally:
            if cgroup is not None:
                cgroup.remove_now()

    def run(
        self, command: Sequence[str] | str, stdin: str | bytes | None = None, timeout: float | None = None
    ) -> SandboxResult:
        """Blocking `arun`, for code outside an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arun(command, stdin, timeout))
        raise RuntimeError("Sandbox.run() was called inside a running event loop; use `await sandbox.arun(...)`")


def _check_traversable(workdir: Path) -> None:
    """The sandbox user must be able to reach the workdir through its parents."""
    for parent in workdir.parents:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise ValueError(
                f"sandbox workdir {workdir} is unreachable for the sandbox user: {parent} is not searchable by others "
                "(chmod o+x it, or put workdirs elsewhere, e.g. under /tmp)"
            )
