"""Where a weight update's pause goes while tokens stream: one GPU, Slipstream's vLLM server, and a client that
streams the RL loop's load (128 rollouts: 8 requests x n=16, every completion forced to `--max-tokens`, assembled
chunk by chunk as the orchestrator does) while it pauses and resumes the server once a second, as a weight update
does (with nothing loaded in between).

For each pause it records the time the client waited for /pause, the part the server spent on it
(X-Slipstream-Handled-Ms), the server's event-loop lateness since the last admin call and the client's own loop
lateness. Modes (`--modes`):
- `same-loop`: the admin calls share the streaming client's event loop (the orchestrator today);
- `own-thread`: the admin calls run on a thread with its own event loop and HTTP client;
- `stream-interval-N`: same-loop against a server started with `--stream-interval N` (vLLM sends N tokens a chunk).

    python benchmarks/pause_latency.py --model DIR [--modes same-loop own-thread stream-interval-8] [--seconds 20]

Prints one JSON line per mode (medians and worst over the pauses) and writes OUT/pause_latency.json.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from slipstream.orchestrator.client import InferenceClient  # noqa: E402
from slipstream.rollout.streaming import StreamedChat  # noqa: E402
from slipstream.utils.loop_lag import LoopLag  # noqa: E402

PAUSE = {"mode": "keep", "clear_cache": "false"}


async def stream_load(client: InferenceClient, prompts: list, n: int, max_tokens: int, stop: asyncio.Event) -> int:
    """Stream waves of requests until `stop`; returns the tokens received."""
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "min_tokens": max_tokens}
    tokens = 0

    async def one(messages) -> int:
        chat = StreamedChat(n, lambda: 0, "benchmark")
        async for chunk in client.stream_chat(messages, sampling, n, "salt"):
            chat.add(chunk)
        return chat.num_tokens

    while not stop.is_set():
        tokens += sum(await asyncio.gather(*(one(m) for m in prompts)))
    return tokens


async def pause_once(admin: InferenceClient) -> dict:
    start = time.perf_counter()
    await admin.post("/pause", params=PAUSE)
    waited = time.perf_counter() - start
    await admin.post("/resume")
    timing = admin.server_timing.get("/pause")
    return {
        "client_ms": waited * 1e3,
        "server_ms": (timing.handled_s if timing and timing.handled_s is not None else float("nan")) * 1e3,
        "server_loop_lag_ms": (timing.loop_lag_s if timing and timing.loop_lag_s is not None else float("nan")) * 1e3,
    }


async def run_mode(url: str, model: str, prompts: list, args, own_thread: bool) -> dict:
    client = InferenceClient(url, model, 600)
    lag = LoopLag()
    sampler = asyncio.ensure_future(lag.run())
    stop = asyncio.Event()
    pauses: list[dict] = []
    async with client:
        load = asyncio.ensure_future(stream_load(client, prompts, args.n, args.max_tokens, stop))
        await asyncio.sleep(3)  # the load reaches its steady state
        lag.take()
        admin_loop: asyncio.AbstractEventLoop | None = None
        admin_client: InferenceClient | None = None
        if own_thread:
            admin_loop = asyncio.new_event_loop()
            threading.Thread(target=admin_loop.run_forever, daemon=True).start()
            admin_client = InferenceClient(url, model, 600)
        start = time.monotonic()
        started = time.perf_counter()
        while time.monotonic() - start < args.seconds:
            await asyncio.sleep(1.0)
            if own_thread:
                assert admin_loop is not None and admin_client is not None
                record = await asyncio.wrap_future(
                    asyncio.run_coroutine_threadsafe(pause_once(admin_client), admin_loop)
                )
            else:
                record = await pause_once(client)
            record["client_loop_lag_ms"] = (lag.take() or (0.0, 0.0))[0] * 1e3
            pauses.append(record)
        stop.set()
        tokens = await load
        seconds = time.perf_counter() - started
        if admin_loop is not None:
            admin_loop.call_soon_threadsafe(admin_loop.stop)
    sampler.cancel()

    def med(key: str) -> float:
        return round(statistics.median(p[key] for p in pauses), 1)

    return {
        "pauses": len(pauses),
        **{f"{k}_median": med(k) for k in pauses[0]},
        "client_ms_worst": round(max(p["client_ms"] for p in pauses), 1),
        "tokens_per_s": round(tokens / seconds),
    }


def serve(argv: list[str], env: dict, url: str, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - the server's life
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900
    while True:
        if server.poll() is not None:
            raise SystemExit(f"vLLM exited: see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("vLLM never became healthy")
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--modes", nargs="+", default=["same-loop", "own-thread", "stream-interval-8"])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run on vLLM's CPU build")
    p.add_argument("--out", type=Path, default=Path("outputs/pause_latency"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from slipstream.config.inference import InferenceConfig
    from slipstream.config.shared import ModelConfig
    from slipstream.envs.reverse_text import ReverseTextEnv
    from slipstream.inference.admin_token import ensure_admin_token
    from slipstream.inference.server import build_vllm_argv, build_vllm_env
    from slipstream.utils.net import free_port

    ensure_admin_token()
    prompts = [t.prompt for t in ReverseTextEnv(num_tasks=args.requests, min_words=2, max_words=20).tasks("train")]
    results = {}
    servers: dict[int, list[str]] = {}
    for mode in args.modes:
        interval = int(mode.rsplit("-", 1)[1]) if mode.startswith("stream-interval-") else 1
        servers.setdefault(interval, []).append(mode)
    for interval, modes in servers.items():
        port = free_port()
        config = InferenceConfig(
            model=ModelConfig(name=args.model, dtype="bfloat16"), port=port, max_model_len=1024, max_num_seqs=256,
            enforce_eager=args.device == "cpu", device=args.device,
            extra_args=[] if interval == 1 else ["--stream-interval", str(interval)],
        )  # fmt: skip
        env = build_vllm_env(config) | {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
        url = f"http://127.0.0.1:{port}"
        server = serve(build_vllm_argv(config, Path(args.model)), env, url, args.out / f"server_{interval}.log")
        try:
            for mode in modes:
                own = mode == "own-thread"
                results[mode] = asyncio.run(run_mode(url, args.model, prompts, args, own))
                print(f"{mode}: {json.dumps(results[mode])}", flush=True)
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)
    (args.out / "pause_latency.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
