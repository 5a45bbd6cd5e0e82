"""Where an environment runs: `open_environment` builds it inside the orchestrator, or starts an env server for it
(envs/server/) and hands back a client that speaks the same protocol, per `orchestrator.env.server.mode`."""

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from slipstream.config.orchestrator import EnvConfig
from slipstream.envs.base import AnyEnvironment
from slipstream.envs.registry import build_env
from slipstream.rundir import RunDir

OWN_PROCESS_BY_DEFAULT = frozenset({"verifiers"})
"""Environments that mode `auto` runs in an env server: third-party code with its own dependencies."""


def runs_in_env_server(config: EnvConfig) -> bool:
    if config.server.mode == "auto":
        return config.name in OWN_PROCESS_BY_DEFAULT
    return config.server.mode == "process"


def env_server_log_name(env_name: str) -> str:
    """`logs/<this>.log` of the env server of `env_name` (an import path becomes a file-name-safe slug)."""
    return "env_server_" + re.sub(r"[^A-Za-z0-9_.-]+", "_", env_name)


@asynccontextmanager
async def open_environment(config: EnvConfig, output_dir: Path | str) -> AsyncIterator[AnyEnvironment]:
    """The environment of `config` for the duration of the block; an env server is stopped at its end."""
    if not runs_in_env_server(config):
        yield build_env(config.name, **config.args)
        return
    from slipstream.envs.server.client import EnvServerClient  # imports zmq: only where a server runs

    log_path = RunDir(output_dir).log_path(env_server_log_name(config.name))
    client = EnvServerClient(config.name, dict(config.args), config.server, log_path)
    try:
        await client.start()
        yield client
    finally:
        await client.close()
