"""`python -m slipstream.envs.server --address ADDR --spec JSON --parent-pid PID`: run one env server (started by the
orchestrator through `EnvServerProcess`; not a user command)."""

import argparse
import asyncio
import json

from slipstream.envs.server.server import serve
from slipstream.monitor.logs import setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m slipstream.envs.server", description=__doc__)
    parser.add_argument("--address", required=True, help="ZMQ address to bind, e.g. ipc:///tmp/x/env-0.sock")
    parser.add_argument("--spec", required=True, help='JSON {"name": ..., "args": {...}} of the environment')
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    ns = parser.parse_args()
    setup_logging("env_server")
    spec = json.loads(ns.spec)
    asyncio.run(serve(spec["name"], spec.get("args") or {}, ns.address, ns.parent_pid))


if __name__ == "__main__":
    main()
