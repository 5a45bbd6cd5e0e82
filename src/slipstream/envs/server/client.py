"""The orchestrator's side of an env server: `EnvServerClient` implements the multi-turn environment protocol by
calling the server, and supervises its process.

Crash path: when the server process dies, every call in flight fails with `EnvServerLost`, and so does any later
call for a rollout whose state lived in that process; the rollout driver turns these into failed rollouts (counted,
never trained). Then, per `EnvServerConfig.on_crash`, a new server is started (new rollouts wait for it) or
`supervise()` raises `EnvServerDown`, which stops the run with the server's exit status and log.
"""

import asyncio
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from slipstream.config.orchestrator import EnvServerConfig
from slipstream.envs.base import Message, RewardResult, State, Task, ToolSchema
from slipstream.envs.server import wire
from slipstream.envs.server.process import EnvServerProcess, log_tail

logger = logging.getLogger(__name__)


class EnvServerLost(RuntimeError):
    """A call could not complete because the env server serving it died; its rollout fails."""


class EnvServerDown(RuntimeError):
    """The env server died (or never came up) and is not started again: the run stops."""


class _Connection:
    """A DEALER socket to one server process, with the calls waiting for its replies."""

    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)
        self.pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader = asyncio.create_task(self._read())

    async def call(self, method: str, args: dict[str, Any]) -> Any:
        request = wire.Request(id=next(self._ids), method=method, args=args)
        future = asyncio.get_running_loop().create_future()
        self.pending[request.id] = future
        try:
            await self.socket.send(wire.encode(request))
            reply: wire.Reply = await future
        finally:
            self.pending.pop(request.id, None)
        if not reply.ok:
            raise RuntimeError(f"env server: {reply.error}")
        return reply.result

    async def _read(self) -> None:
        while True:
            reply = wire.decode_reply(await self.socket.recv())
            future = self.pending.get(reply.id)
            if future is not None and not future.done():
                future.set_result(reply)

    def fail_all(self, error: Exception) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)

    def close(self) -> None:
        self._reader.cancel()
        self.socket.close()


class EnvServerClient:
    """An environment running in an env server, seen through the multi-turn protocol. `await start()` before use,
    run `supervise()` for the whole run, `await close()` at the end."""

    def __init__(self, name: str, args: dict[str, Any], config: EnvServerConfig, log_path: Path) -> None:
        self.config, self.log_path = config, log_path
        self.process = EnvServerProcess(name, args, log_path)
        self._context = zmq.asyncio.Context()
        self._connection: _Connection | None = None
        self._generation = 0
        """Number of server processes that died so far: a rollout's state belongs to the generation it began in."""
        self._up = asyncio.Event()
        self._down: EnvServerDown | None = None
        self._tasks: dict[str, list[Task]] = {}
        self._task_refs: dict[int, tuple[str, int]] = {}
        self._closing = False
        self._exit: asyncio.Future[str] | None = None
        """Resolves (to how the process ended) once the current server exited and what it held was failed."""
        self.num_crashes = self.num_restarts = self.num_lost_rollouts = 0
        self.name, self.max_turns, self.rollout_timeout_s = name, 1, 0.0
        self.tools: list[ToolSchema] = []

    async def start(self) -> None:
        """Start the server and load the environment's description (tasks, turn limit, tools)."""
        info = await self._launch()
        self.name, self.max_turns, self.rollout_timeout_s = info.name, info.max_turns, info.rollout_timeout_s
        self.tools = list(info.tools)
        for split, wire_tasks in info.tasks.items():
            self._tasks[split] = [Task(id=t.id, prompt=t.prompt, answer=t.answer, info=t.info) for t in wire_tasks]
            self._task_refs |= {id(task): (split, i) for i, task in enumerate(self._tasks[split])}
        self._up.set()

    async def _launch(self) -> wire.EnvInfo:
        """Start a server process and wait (startup_timeout_s) until it answers `info`."""
        address = await self.process.start()
        self._connection = _Connection(self._context, address)
        info = asyncio.ensure_future(self._connection.call("info", {}))
        exited = asyncio.ensure_future(self.process.wait())
        done, _ = await asyncio.wait(
            [info, exited], timeout=self.config.startup_timeout_s, return_when="FIRST_COMPLETED"
        )
        if info not in done:
            info.cancel()
            exited.cancel()
            self._connection.close()
            self._connection = None
            await self.process.stop()
            timeout = self.config.startup_timeout_s
            what = (
                "exited while loading" if exited in done else f"did not answer within startup_timeout_s = {timeout:g} s"
            )
            raise EnvServerDown(
                f"the env server of environment {self.process.name!r} {what}; its log {self.log_path} ends with:\n"
                f"{log_tail(self.log_path)}"
            )
        exited.cancel()
        self._exit = asyncio.ensure_future(self._fail_on_exit())
        try:
            parsed = wire.convert(info.result(), wire.EnvInfo)
        except RuntimeError as e:
            raise EnvServerDown(f"environment {self.process.name!r} failed to load in its env server: {e}") from e
        logger.info("environment %r runs in env server pid %d (log %s)", parsed.name, parsed.pid, self.log_path)
        return parsed

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in self._tasks:
            raise ValueError(f"{self.name} has no split {split!r}; splits: {', '.join(self._tasks)}")
        return self._tasks[split]

    async def _call(self, generation: int, method: str, args: dict[str, Any]) -> Any:
        if generation != self._generation or self._connection is None:
            self.num_lost_rollouts += method != "cleanup"
            raise EnvServerLost(f"the env server holding this rollout's state died (log: {self.log_path})")
        try:
            return await self._connection.call(method, args)
        except EnvServerLost:
            self.num_lost_rollouts += 1
            raise

    async def setup_state(self, task: Task) -> State:
        ref = self._task_refs.get(id(task))
        if ref is None:
            raise ValueError(f"task {task.id} is not one of environment {self.name!r}'s tasks (from its tasks())")
        await self._wait_up()
        generation = self._generation
        result = await self._call(generation, "setup_state", {"split": ref[0], "index": ref[1]})
        return {"key": result["key"], "generation": generation}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        args = {"key": state["key"], "messages": wire.to_builtins(messages, "the conversation")}
        result = await self._call(state["generation"], "env_response", args)
        return result["messages"], result["done"]

    async def reward(self, task: Task, state: State) -> RewardResult:
        result = wire.convert(await self._call(state["generation"], "reward", {"key": state["key"]}), wire.WireReward)
        return RewardResult(value=result.value, metrics=dict(result.metrics))

    async def cleanup(self, state: State) -> None:
        if state["generation"] == self._generation:  # a dead server took its states with it
            await self._call(state["generation"], "cleanup", {"key": state["key"]})

    async def _wait_up(self) -> None:
        try:
            async with asyncio.timeout(self.config.startup_timeout_s):
                await self._up.wait()
        except TimeoutError:
            raise EnvServerLost(f"no env server of {self.name!r} came back within startup_timeout_s") from None
        if self._down is not None:
            raise EnvServerLost(str(self._down))

    async def _fail_on_exit(self) -> str:
        """Wait for the server process to exit; unless closing, fail the calls and states it held. Runs from each
        start, supervised or not, so no call waits on a dead server."""
        await self.process.wait()
        died = self.process.describe()
        if self._closing:
            return died
        self._up.clear()
        self.num_crashes += 1
        self._generation += 1
        assert self._connection is not None  # set by _launch
        self._connection.fail_all(EnvServerLost(f"{died}; the rollouts it served fail (log: {self.log_path})"))
        self._connection.close()
        self._connection = None
        return died

    async def supervise(self) -> None:
        """Watch the server for the whole run: after its death, restart it or raise EnvServerDown
        (orchestrator.env.server.on_crash)."""
        while True:
            assert self._exit is not None, "start() first"
            died = await asyncio.shield(self._exit)
            if self._closing:
                return
            if self.config.on_crash == "stop" or self.num_restarts >= self.config.max_restarts:
                self._down = EnvServerDown(self._stop_message(died))
                self._up.set()  # rollouts waiting for a server see it is down
                raise self._down
            self.num_restarts += 1
            logger.warning(
                "%s; its in-flight rollouts fail; restart %d of %d", died, self.num_restarts, self.config.max_restarts
            )
            info = await self._launch()
            self._check_same_tasks(info)
            self._up.set()

    def _stop_message(self, died: str) -> str:
        if self.config.on_crash == "stop":
            why = "orchestrator.env.server.on_crash = 'stop'"
        else:
            why = f"it was restarted max_restarts = {self.config.max_restarts} times already"
        return (
            f"{died}; stopping the run ({why}). Its in-flight rollouts failed and were not trained. Its log "
            f"{self.log_path} ends with:\n{log_tail(self.log_path)}"
        )

    def _check_same_tasks(self, info: wire.EnvInfo) -> None:
        now = {split: [t.id for t in tasks] for split, tasks in info.tasks.items()}
        before = {split: [t.id for t in tasks] for split, tasks in self._tasks.items()}
        if now != before:
            raise EnvServerDown(
                f"the restarted env server of {self.name!r} lists other tasks than the first one; an environment run "
                "in an env server must list the same tasks every time it is built"
            )

    def counters(self) -> dict[str, float]:
        """Cumulative env server counts for the run's metrics."""
        return {
            "env_server/crashes": float(self.num_crashes),
            "env_server/restarts": float(self.num_restarts),
            "env_server/lost_rollouts": float(self.num_lost_rollouts),
        }

    async def close(self) -> None:
        self._closing = True
        if self._connection is not None:
            self._connection.close()
        await self.process.stop()
        if self._exit is not None:
            await self._exit
        self._context.term()
        self.process.remove_sockets()
