"""The env server: one environment in its own process, answering the environment protocol over a ZMQ ROUTER socket.

The orchestrator starts it (`python -m slipstream.envs.server`) and talks to it through `EnvServerClient`. Per-rollout
state stays here, under a key the client holds; every call runs as its own asyncio task, so slow rewards of one
rollout never hold up another. An exception of the environment fails that call only (the reply carries it, the log
its traceback). The server exits when its parent (the orchestrator) is gone, so it never outlives a run.
"""

import asyncio
import itertools
import logging
import os
import traceback
from typing import Any

import zmq
import zmq.asyncio

from slipstream.envs.base import RewardResult, State, Task
from slipstream.envs.multiturn import as_multi_turn
from slipstream.envs.registry import build_env
from slipstream.envs.server import wire

logger = logging.getLogger("slipstream.env_server")

PARENT_POLL_S = 1.0


class EnvHost:
    """The environment and its live rollout states; `handle` answers one request."""

    def __init__(self, name: str, args: dict[str, Any]) -> None:
        self.env = as_multi_turn(build_env(name, **args))
        self.tasks: dict[str, list[Task]] = {}
        for split in ("train", "eval"):
            try:
                self.tasks[split] = list(self.env.tasks(split))
            except ValueError:
                continue  # the environment has no such split
        self.states: dict[int, tuple[Task, State]] = {}
        self._keys = itertools.count()

    def info(self) -> wire.EnvInfo:
        tasks = {
            split: [
                wire.WireTask(
                    id=t.id,
                    prompt=wire.to_builtins(t.prompt, f"task {t.id}'s prompt"),
                    answer=wire.to_builtins(t.answer, f"task {t.id}'s answer"),
                    info=wire.to_builtins(t.info, f"task {t.id}'s info"),
                )
                for t in split_tasks
            ]
            for split, split_tasks in self.tasks.items()
        }
        return wire.EnvInfo(
            name=self.env.name,
            max_turns=self.env.max_turns,
            tools=wire.to_builtins(self.env.tools, "the environment's tools"),
            rollout_timeout_s=self.env.rollout_timeout_s,
            tasks=tasks,
            pid=os.getpid(),
        )

    async def handle(self, request: wire.Request) -> Any:
        if request.version != wire.WIRE_VERSION:
            raise ValueError(f"wire version {request.version}; this env server speaks {wire.WIRE_VERSION}")
        args = request.args
        if request.method == "info":
            return self.info()
        if request.method == "setup_state":
            task = self.tasks[args["split"]][args["index"]]
            state = await self.env.setup_state(task)
            key = next(self._keys)
            self.states[key] = (task, state)
            return {"key": key}
        if request.method == "env_response":
            _, state = self.states[args["key"]]
            messages, done = await self.env.env_response(args["messages"], state)
            return {"messages": wire.to_builtins(messages, "env_response's messages"), "done": done}
        if request.method == "reward":
            task, state = self.states[args["key"]]
            reward = await self.env.reward(task, state)
            if not isinstance(reward, RewardResult):
                raise TypeError(f"reward must return a RewardResult, got {reward!r:.200}")
            return wire.WireReward(value=reward.value, metrics=dict(reward.metrics))
        if request.method == "cleanup":
            entry = self.states.pop(args["key"], None)
            if entry is not None:
                await self.env.cleanup(entry[1])
            return None
        raise ValueError(f"unknown method {request.method!r}; methods: {', '.join(wire.METHODS)}")


async def _answer(host: EnvHost, socket: zmq.asyncio.Socket, identity: bytes, data: bytes) -> None:
    request_id = -1
    try:
        request = wire.decode_request(data)
        request_id = request.id
        reply = wire.Reply(id=request_id, ok=True, result=await host.handle(request))
    except Exception as e:  # noqa: BLE001 - any failure of the environment goes back to the one call that caused it
        logger.warning("call %s failed:\n%s", request_id, "".join(traceback.format_exception(e)).rstrip())
        reply = wire.Reply(id=request_id, ok=False, error=f"{type(e).__name__}: {e}")
    await socket.send_multipart([identity, wire.encode(reply)])


async def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_POLL_S)
    logger.warning("parent process %d is gone; env server exits", parent_pid)


async def serve(name: str, args: dict[str, Any], address: str, parent_pid: int) -> None:
    """Load environment `name` with `args`, then answer requests on `address` until the parent process exits."""
    host = EnvHost(name, args)
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(address)
    logger.info("environment %r (%s) serving on %s, pid %d", host.env.name, name, address, os.getpid())
    calls: set[asyncio.Task] = set()
    watcher = asyncio.create_task(_exit_with_parent(parent_pid))
    try:
        while not watcher.done():
            receive = asyncio.ensure_future(socket.recv_multipart())
            await asyncio.wait([receive, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not receive.done():
                receive.cancel()
                break
            identity, data = receive.result()
            call = asyncio.create_task(_answer(host, socket, identity, data))
            calls.add(call)
            call.add_done_callback(calls.discard)
    finally:
        for call in calls:
            call.cancel()
        socket.close()
        context.term()
