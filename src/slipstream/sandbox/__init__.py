"""Sandbox for tool calls and model-written code: a separate process with no network, CPU / memory / process limits
for its whole tree (a cgroup per command), wall-time / output limits, a seccomp filter and one writable directory
(bubblewrap), refusing to run untrusted code where it cannot isolate it. What applies where: docs/sandbox.md.

    sandbox = Sandbox(workdir, SandboxLimits(wall_seconds=30))
    result = await sandbox.arun("python3 -m unittest -q")   # or sandbox.run([...]) outside an event loop
"""

from slipstream.sandbox.isolation import INNER_WORKDIR, Isolation, detect_isolation
from slipstream.sandbox.limits import SandboxLimits
from slipstream.sandbox.process import SandboxResult
from slipstream.sandbox.sandbox import Sandbox, SandboxUnavailable

__all__ = [
    "INNER_WORKDIR",
    "Isolation",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailable",
    "detect_isolation",
]
