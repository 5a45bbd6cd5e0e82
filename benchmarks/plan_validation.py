"""The planner's pipeline simulation against measured runs: predicted vs measured steps/hour and mean token lag.

    python benchmarks/plan_validation.py [--settings NAME,...] [--steps N]

Each setting runs the real orchestrator against the simulated inference server (its own process) with the fake
trainer of async_vs_sync.py, then simulates the same setting with `slipstream.planner.pipeline_sim`: paired (the
simulator's seed, so the same latency draws in the same order as the measured run, which fixes one sample path of a
heavy tail) and the expectation over 5 other seeds. The simulation's fixed costs of this machine (HTTP round trip
of a request, weight load, batch write) are CALIBRATION below: fitted once on two extra runs
(`--settings calibration_sync,calibration_async`, near-zero latency, so only the fixed costs show), never on the
validation settings. Fitted on whole replies; requests are now streamed (see RESULTS.md). Run it on a quiet machine:
the real runs are CPU-bound on 2 cores. Prints one line per setting and last `within_15pct: <k>/<n>`.
"""

import argparse
import asyncio
import contextlib
import io
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parent))

import async_vs_sync as avs  # noqa: E402  # the simulator launch and fake trainer of that benchmark

from slipstream.config.orchestrator import OrchestratorConfig  # noqa: E402
from slipstream.orchestrator.loop import orchestrate  # noqa: E402
from slipstream.planner.distributions import TailDist, constant  # noqa: E402
from slipstream.planner.pipeline_sim import simulate  # noqa: E402
from slipstream.planner.sim_config import PipelineSimConfig  # noqa: E402
from slipstream.transport.rollouts import batch_path, read_batch  # noqa: E402
from slipstream_sim import SimConfig  # noqa: E402

CALIBRATION = {
    "request_cost_s": 0.0035,
    "request_overhead_s": 0.002,
    "weights_poll_jitter_s": 0.005,
    "weight_update_s": 0.008,
    "weight_check_s": 0.005,
    "batch_write_s": 0.015,
    "trainer_poll_s": 0.002,
    "startup_s": 0.3,
}
"""Fixed costs of the 2-core CPU machine, from the calibration settings (see RESULTS.md)."""


@dataclass(frozen=True)
class Setting:
    name: str
    max_async_level: int
    capacity: int = 64
    p50_s: float = 0.05
    tail_ratio: float = 20.0
    dist: Literal["lognormal", "pareto"] = "lognormal"
    train_time_s: float = 0.5
    spare_batches: int = 1
    max_off_policy_steps: int = 8
    batch_size: int = 64
    group_size: int = 8
    max_tokens: int = 16


SETTINGS = {
    s.name: s
    for s in (
        Setting("calibration_sync", 0, p50_s=0.001, tail_ratio=1.0, train_time_s=0.3),
        Setting("calibration_async", 1, p50_s=0.001, tail_ratio=1.0, train_time_s=0.3),
        Setting("sync_tail20", 0),
        Setting("async1_tail20", 1),
        Setting("async1_train1.2", 1, train_time_s=1.2),
        Setting("async1_cap16_tail5", 1, capacity=16, p50_s=0.03, tail_ratio=5.0, train_time_s=0.3),
        Setting("async2_pareto_tail10", 2, p50_s=0.02, tail_ratio=10.0, dist="pareto", train_time_s=0.3),
        Setting("async1_offpolicy1_cap32", 1, capacity=32, train_time_s=0.2, spare_batches=2, max_off_policy_steps=1),
    )
}
VALIDATION = [name for name in SETTINGS if not name.startswith("calibration")]


def measure(s: Setting, steps: int, seed: int = 0) -> dict[str, float]:
    """One real run: the orchestrator against the simulated server, the fake trainer in a thread."""
    sim = SimConfig(
        model_name=avs.MODEL,
        capacity=s.capacity,
        request_latency_p50_s=s.p50_s,
        request_latency_tail_ratio=s.tail_ratio,
        request_latency_dist=s.dist,
        seed=seed,
    )
    with tempfile.TemporaryDirectory() as tmp, avs.sim_server(sim) as url:
        output_dir = Path(tmp)
        config = OrchestratorConfig(
            model={"name": avs.MODEL},
            output_dir=output_dir,
            max_steps=steps,
            inference_url=url,
            batch_size=s.batch_size,
            group_size=s.group_size,
            max_async_level=s.max_async_level,
            max_off_policy_steps=s.max_off_policy_steps,
            spare_batches=s.spare_batches,
            concurrency={"mode": "fixed", "max": s.capacity},
            sampling={"max_tokens": s.max_tokens},
            env={"name": "reverse_text", "args": {"num_tasks": 500}},
            health_timeout_s=60,
        )
        asyncio.run(avs.wait_healthy(url))
        trainer, stop = avs.FakeTrainer(output_dir, steps, s.train_time_s), threading.Event()
        thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
        start = time.perf_counter()
        thread.start()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                summary = asyncio.run(orchestrate(config))
        finally:
            stop.set()
            thread.join(timeout=60)
        if trainer.finished_at is None:
            raise RuntimeError("the fake trainer did not finish its steps")
        seconds = trainer.finished_at - start
        metrics = [read_batch(batch_path(output_dir, n, 0)).metrics for n in range(1, steps + 1)]
    return {
        "steps_per_hour": steps / seconds * 3600,
        "lag_mean": statistics.fmean(m["policy/lag_mean"] for m in metrics),
        "lag_max": max(m["policy/lag_max"] for m in metrics),
        "cancelled": summary["pipeline/cancelled_groups"],
        "dropped": summary["pipeline/dropped_groups"],
    }


def sim_config(s: Setting, steps: int, seed: int) -> PipelineSimConfig:
    """The setting as the planner sees it: the simulator's latency law, capacity, the fake trainer's step time."""
    return PipelineSimConfig(
        num_steps=steps,
        batch_size=s.batch_size,
        group_size=s.group_size,
        max_async_level=s.max_async_level,
        max_off_policy_steps=s.max_off_policy_steps,
        spare_batches=s.spare_batches,
        in_flight_limit=s.capacity,
        version_tracking="stream",
        capacity=s.capacity,
        sequence_latency=TailDist(p50=s.p50_s, tail_ratio=s.tail_ratio, kind=s.dist),
        completion_tokens=constant(s.max_tokens),
        train_step_s=s.train_time_s,
        seed=seed,
        **CALIBRATION,
    )


def predict(s: Setting, steps: int, seeds: list[int]) -> dict[str, float]:
    """Means over simulated runs, one per seed."""
    runs = [simulate(sim_config(s, steps, seed)) for seed in seeds]
    return {
        "steps_per_hour": statistics.fmean(r.steps_per_hour for r in runs),
        "lag_mean": statistics.fmean(r.lag_mean for r in runs),
        "lag_max": statistics.fmean(r.lag_max for r in runs),
        "cancelled": statistics.fmean(r.num_cancelled for r in runs),
        "dropped": statistics.fmean(r.num_dropped for r in runs),
        "bottleneck": max((r.bottleneck for r in runs), key=[r.bottleneck for r in runs].count),
    }


def within(predicted: float, measured: float, rel: float = 0.15, floor: float = 0.05) -> bool:
    """Relative error at most `rel`, or an absolute one at most `floor` (lags of 0 in synchronous runs)."""
    return abs(predicted - measured) <= max(rel * abs(measured), floor)


def compare(name: str, steps: int, seed: int = 0) -> tuple[dict, dict, dict, bool]:
    """Measured run, paired prediction (the simulator's seed: the same latency draws in the same order) and the
    expectation over 5 other seeds; ok when the paired one is within 15% on steps/hour and mean lag."""
    s = SETTINGS[name]
    measured, paired = measure(s, steps, seed), predict(s, steps, [seed])
    expected = predict(s, steps, list(range(seed + 1, seed + 6)))
    ok = within(paired["steps_per_hour"], measured["steps_per_hour"], floor=0) and within(
        paired["lag_mean"], measured["lag_mean"]
    )
    return measured, paired, expected, ok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--settings", default=",".join(VALIDATION), help="comma-separated (default: the validation six)")
    p.add_argument("--steps", type=int, default=30, help="training steps per run (default: %(default)s)")
    args = p.parse_args(argv)
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; choose from {sorted(SETTINGS)}")
    print(f"fixed costs of this machine (calibration): {CALIBRATION}")
    num_ok = 0
    for name in names:
        m, pr, ex, ok = compare(name, args.steps)
        num_ok += ok
        err = pr["steps_per_hour"] / m["steps_per_hour"] - 1
        print(
            f"{name}: steps/hour measured {m['steps_per_hour']:.0f} predicted {pr['steps_per_hour']:.0f} "
            f"({err:+.1%}; expected over 5 other seeds {ex['steps_per_hour']:.0f}) | lag mean measured {m['lag_mean']:.2f} predicted {pr['lag_mean']:.2f} | lag max "
            f"{m['lag_max']:.0f} / {pr['lag_max']:.1f} | cancelled {m['cancelled']:.0f} / {pr['cancelled']:.1f} "
            f"dropped {m['dropped']:.0f} / {pr['dropped']:.1f} | bottleneck {pr['bottleneck']} | "
            f"{'ok' if ok else 'OFF'}",
            flush=True,
        )
    print(f"within_15pct: {num_ok}/{len(names)}")


if __name__ == "__main__":
    main()
