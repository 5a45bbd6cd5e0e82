"""Run the simulator: in a background thread for tests (`serve_in_thread`) or as a process (`main`)."""

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from slipstream.launch.watchdog import start_from_env
from slipstream_sim.app import SimServer
from slipstream_sim.config import SimConfig, latency_percentiles


@contextmanager
def serve_in_thread(
    server: SimServer, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 10.0
) -> Iterator[str]:
    """Serve `server` with uvicorn in a daemon thread; yields the base URL (port 0: a free port).

    On exit every in-flight request is aborted and the server stops. A SimServer can be served once.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(server.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5)
    uv = uvicorn.Server(config)
    loop_ready: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        async def serve() -> None:
            loop_ready.append(asyncio.get_running_loop())
            await uv.serve(sockets=[sock])

        asyncio.run(serve())

    thread = threading.Thread(target=run, name="slipstream-sim-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not uv.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"simulated inference server did not start on {host}:{port} within {start_timeout_s}s"
                )
            time.sleep(0.005)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        if loop_ready and thread.is_alive():
            loop_ready[0].call_soon_threadsafe(server.engine.close)
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()


def build_parser() -> argparse.ArgumentParser:
    """`--host`, `--port`, `--print-latency`, and one `--field-name` option per SimConfig field."""
    parser = argparse.ArgumentParser(
        prog="python -m slipstream_sim",
        description="OpenAI-compatible inference server without a model, for tests and benchmarks.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    parser.add_argument("--print-latency", action="store_true", help="print the empirical latency p50/p99 and exit")
    for name, field in SimConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        text = f"{field.description} (default: {field.default})"
        if field.annotation is bool:
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
        else:
            parser.add_argument(flag, dest=name, help=text)
    return parser


def main(argv: list[str] | None = None) -> int:
    start_from_env()  # under `slipstream rl`, exit with the launcher
    args = build_parser().parse_args(argv)
    fields = {name: getattr(args, name) for name in SimConfig.model_fields if getattr(args, name) is not None}
    config = SimConfig.model_validate(fields)
    if args.print_latency:
        print(latency_percentiles(config))
        return 0
    print(f"slipstream sim inference server on http://{args.host}:{args.port} ({config.model_dump()})", flush=True)
    uvicorn.run(SimServer(config).app, host=args.host, port=args.port, log_level="warning", lifespan="off")
    return 0
