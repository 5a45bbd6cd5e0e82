"""One env server process: started as a child of the orchestrator (same process group, so the launcher's stop reaches
it), logging to its own file, stopped with SIGTERM then SIGKILL. Each start binds a fresh ipc address, so a
restarted server never receives requests meant for the one that died."""

import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

STOP_GRACE_S = 5.0


def describe_exit(returncode: int | None) -> str:
    """`exited with code 3` / `was killed by SIGKILL`."""
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: Path, num_chars: int = 2000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return text[-num_chars:].rstrip() or "(empty log)"


class EnvServerProcess:
    """Starts and stops env server processes for one environment (`name`, `args`); `start()` may be called again
    after the previous process exited (a restart)."""

    def __init__(self, name: str, args: dict[str, Any], log_path: Path) -> None:
        self.name, self.args, self.log_path = name, args, log_path
        self.spec = json.dumps({"name": name, "args": args})  # env.args come from TOML: JSON-compatible
        self._socket_dir = tempfile.mkdtemp(prefix="slipstream-env-")
        self.num_starts = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.address = ""

    async def start(self) -> str:
        """Start a server; returns the ZMQ address it binds."""
        self.address = f"ipc://{self._socket_dir}/env-{self.num_starts}.sock"
        self.num_starts += 1
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "slipstream.envs.server", "--address", self.address, "--spec", self.spec]
        argv += ["--parent-pid", str(os.getpid())]
        with open(self.log_path, "ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT
            )
        return self.address

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def wait(self) -> int:
        """Wait for the current process to exit; its return code."""
        assert self.proc is not None, "start() first"
        return await self.proc.wait()

    def describe(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        return f"env server of {self.name!r} (pid {self.pid}) {describe_exit(code)}"

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_GRACE_S; a no-op when it already exited."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()

    def remove_sockets(self) -> None:
        for path in Path(self._socket_dir).glob("*"):
            path.unlink(missing_ok=True)
        Path(self._socket_dir).rmdir()
