"""Training steps per hour of asynchronous (max_async_level = 1) vs synchronous (0) RL at equal inference capacity.

    python benchmarks/async_vs_sync.py

Inference is the simulated vLLM server (a separate process, no model): `--capacity` sequences decode at once, each
taking a heavy-tailed latency (lognormal, p99/p50 = `--tail-ratio`). The trainer is fake: per step it waits for
its batch, sleeps `--train-time-s`, and publishes weights with a probe the orchestrator verifies. Both modes run the
real orchestrator (continuous pipeline, in-flight weight updates, verification) with the same server settings and
the same in-flight cap (= capacity). Prints per mode the steps/hour and where the time went, and last
`speedup: <x>` (async steps/hour over sync steps/hour).
"""

import argparse
import asyncio
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.orchestrator.loop import orchestrate
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream.utils.fs import commit_dir
from slipstream.utils.net import free_port
from slipstream.weights.wire.published import PROBE, READY, weights_dir
from slipstream_sim import LatencyModel, SimConfig, sim_logprob

MODEL = "sim"
PROBE_TOKENS = [5, 17, 42, 99, 3, 250]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps per mode (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64, help="rollouts per step (default: %(default)s)")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per task (default: %(default)s)")
    p.add_argument("--capacity", type=int, default=64, help="sequences decoded at once (default: %(default)s)")
    p.add_argument("--p50-s", type=float, default=0.05, help="median sequence latency (default: %(default)s)")
    p.add_argument("--tail-ratio", type=float, default=20.0, help="p99/p50 of the latency (default: %(default)s)")
    p.add_argument("--train-time-s", type=float, default=0.5, help="fake trainer step time (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulator (default: %(default)s)")
    p.add_argument(
        "--spare-batches", type=int, default=1, help="orchestrator.spare_batches of async (default: %(default)s)"
    )
    return p.parse_args(argv)


def sim_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model_name=MODEL,
        capacity=args.capacity,
        request_latency_p50_s=args.p50_s,
        request_latency_tail_ratio=args.tail_ratio,
        seed=args.seed,
    )


@contextlib.contextmanager
def sim_server(config: SimConfig):
    """The simulator in its own process (its own interpreter lock), stopped on exit."""
    port = free_port()
    argv = [sys.executable, "-m", "slipstream_sim", "--port", str(port)]
    for name, value in config.model_dump().items():
        if isinstance(value, bool):
            argv.append(f"--{name.replace('_', '-')}" if value else f"--no-{name.replace('_', '-')}")
        elif value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class FakeTrainer:
    """Per step: wait for the batch, train for `train_time_s`, publish weights (+ probe of the simulated policy)."""

    output_dir: Path
    max_steps: int
    train_time_s: float
    finished_at: float | None = None

    def run(self, stop: threading.Event) -> None:
        for step in range(1, self.max_steps + 1):
            while not batch_path(self.output_dir, step, 0).exists():
                if stop.wait(0.002):
                    return
            time.sleep(self.train_time_s)
            self.publish(step)
        self.finished_at = time.perf_counter()

    def publish(self, step: int) -> None:
        tmp = self.output_dir / "weights" / f".tmp_step_{step}"
        tmp.mkdir(parents=True)
        probe = {"token_ids": PROBE_TOKENS, "logprobs": [sim_logprob(step, t) for t in PROBE_TOKENS[1:]]}
        (tmp / PROBE).write_text(json.dumps(probe))
        (tmp / READY).write_text("")
        commit_dir(tmp, weights_dir(self.output_dir, step))


def run_mode(args: argparse.Namespace, max_async_level: int) -> dict[str, float]:
    """One full run against a fresh simulator; steps/hour from the orchestrator's start to the last trained step."""
    with tempfile.TemporaryDirectory() as tmp, sim_server(sim_config(args)) as url:
        output_dir = Path(tmp)
        config = OrchestratorConfig(
            model={"name": MODEL},
            output_dir=output_dir,
            max_steps=args.steps,
            inference_url=url,
            batch_size=args.batch_size,
            group_size=args.group_size,
            max_async_level=max_async_level,
            spare_batches=args.spare_batches,
            concurrency={"mode": "fixed", "max": args.capacity},
            sampling={"max_tokens": args.max_tokens},
            env={"name": "reverse_text", "args": {"num_tasks": 500}},
            health_timeout_s=60,
        )
        asyncio.run(wait_healthy(url))
        trainer, stop = FakeTrainer(output_dir, args.steps, args.train_time_s), threading.Event()
        thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
        start = time.perf_counter()
        thread.start()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # the per-step progress lines
                summary = asyncio.run(orchestrate(config))
        finally:
            stop.set()
            thread.join(timeout=60)
        if trainer.finished_at is None:
            raise RuntimeError("the fake trainer did not finish its steps")
        seconds = trainer.finished_at - start
        metrics = [read_batch(batch_path(output_dir, n, 0)).metrics for n in range(1, args.steps + 1)]
    mean = lambda key: sum(m[key] for m in metrics) / len(metrics)  # noqa: E731
    return {
        "steps_per_hour": args.steps / seconds * 3600,
        "seconds": seconds,
        "wait_s": mean("timing/generate_s") + mean("timing/wait_weights_s"),
        "lag_mean": mean("policy/lag_mean"),
        "lag_max": max(m["policy/lag_max"] for m in metrics),
        "multi_version": sum(m["batch/multi_version_rollouts"] for m in metrics) / (len(metrics) * args.batch_size),
        "cancelled": summary["pipeline/cancelled_groups"],
        "dropped": summary["pipeline/dropped_groups"],
    }


async def wait_healthy(url: str) -> None:
    from slipstream.orchestrator.client import InferenceClient

    async with InferenceClient(url, MODEL, request_timeout_s=10) as client:
        await client.wait_healthy(timeout_s=60, poll_s=0.1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    latency = LatencyModel.from_config(sim_config(args))
    p50, p99 = latency.quantile(0.5), latency.quantile(0.99)
    print(
        f"simulated inference: capacity {args.capacity} sequences, sequence latency lognormal p50 {p50:.3f}s "
        f"p99 {p99:.3f}s (p99/p50 {p99 / p50:.1f}); batch {args.batch_size} rollouts in groups of "
        f"{args.group_size}; fake train step {args.train_time_s}s; {args.steps} steps per mode"
    )
    results = {}
    for name, level in (("sync (max_async_level=0)", 0), ("async (max_async_level=1)", 1)):
        r = results[level] = run_mode(args, level)
        print(
            f"{name}: {r['steps_per_hour']:.0f} steps/hour ({r['seconds']:.1f}s for {args.steps} steps; the "
            f"orchestrator waits {r['wait_s']:.2f}s per batch for rollouts or weights) | token lag mean "
            f"{r['lag_mean']:.2f} max {r['lag_max']:.0f} steps | rollouts spanning an update {r['multi_version']:.1%} "
            f"| cancelled {r['cancelled']:.0f} dropped {r['dropped']:.0f} groups",
            flush=True,
        )
    print(f"speedup: {results[1]['steps_per_hour'] / results[0]['steps_per_hour']:.2f}")


if __name__ == "__main__":
    main()
