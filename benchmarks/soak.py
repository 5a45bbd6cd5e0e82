"""Soak: a long tiny-model `slipstream rl` run on CPU, sampling RSS, open file descriptors and threads of every process
of the run at every step, to show that nothing grows without bound after warm-up.

    python benchmarks/soak.py --steps 200 --warmup 20 --samples soak.jsonl

The run is started as benchmarks/chaos.py starts one: the simulated vLLM server (`python -m slipstream_sim`,
no model) next to a `slipstream rl` that runs the trainer and the orchestrator (deployment.run), with the tiny random
qwen3, asynchronous (max_async_level = 1), filesystem weights and a checkpoint every 10 steps (keep_last = 2), so
each step exercises rollouts, batch files, weight publishing and loading, and checkpoints now and then.

Each time a step's record appears in metrics.jsonl, the driver samples every live process of the run: the launcher
and the simulated server (started here) and every process whose environment carries the launcher's marker
(SLIPSTREAM_RUN_DIR): the trainer agent (torchrun), the trainer ranks, the orchestrator. The run trains `--tail` steps
beyond `--steps` so that the last sample is not taken while the processes shut down.

Per process it reports the growth from the warm-up step to the last step: RSS (%), open file descriptors and threads
(deltas). RSS at step s is the median of the samples at steps s - window + 1 .. s (`--window`, default 5). Open fds
and threads are floors: the least of the samples of the first `--flat-window` steps from the warm-up step, and of
the last `--flat-window` steps up to the last one (default: a quarter of the steps between them). The orchestrator's
HTTP pool keeps 1-4 connections to the server open for tens of steps at a time (fds of both move by up to 3), so an
endpoint sample says little; a leak raises the floor, a connection open for a while does not. The table also gives
each process's RSS slope (KiB per step, least squares from the warm-up step to the last), and its peak RSS, fds and
threads over the run, for leaks too slow for the criteria.

Criteria (the issue's): RSS growth < `--max-rss-growth-pct` (10%) for every process; fds and threads flat (deltas <=
`--max-fd-delta` / `--max-thread-delta`, both 0); every process alive at the warm-up step alive at the last step, no
new process alive at the last one. Prints the table and `soak_ok: true|false` last; exits 1 when a criterion or the
run fails. `--samples PATH` writes every sample (.jsonl, or .csv).
"""

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos import Inference, launch, metrics, run_processes, workdir_and_model  # noqa: E402  (benchmarks/ is no package)

from slipstream.utils.net import free_port  # noqa: E402

KINDS = ("launcher", "inference", "torchrun", "trainer_rank", "orchestrator")


def _say(message: str) -> None:
    print(f"[soak] {message}", flush=True)


def run_config(model_dir: Path, out: Path, port: int, args: argparse.Namespace) -> dict:
    """The tiny asynchronous run: like chaos.py's, but async and checkpointing every 10 steps."""
    return {
        "max_steps": args.steps + args.tail,
        "output_dir": str(out),
        "seed": 7,
        "model": {"name": str(model_dir)},
        "deployment": {"run": ["trainer", "orchestrator"]},
        "weights": {"transport": "filesystem"},
        "orchestrator": {
            "inference_url": f"http://127.0.0.1:{port}",
            "max_async_level": 1,
            "batch_size": 8,
            "group_size": 4,
            "micro_batch_tokens": 512,
            "sampling": {"temperature": 1.0, "max_tokens": 12},
            "env": {"name": "reverse_text", "args": {"num_tasks": 64}},
            "weight_check": {"enabled": False},  # the simulator's log-probs are not the model's
        },
        "trainer": {"optim": {"lr": 3e-3, "max_grad_norm": 10.0}, "num_threads": 1},
        "launch": {"num_trainer_procs": args.trainer_procs, "health_timeout_s": 120, "shutdown_grace_s": 5},
        "checkpoint": {"interval": 10, "keep_last": 2},
    }


@dataclass
class Sample:
    step: int
    t_s: float  # seconds since the launch
    process: str  # kind, with #i when several processes of one kind are alive (trainer ranks)
    pid: int
    rss_bytes: int
    num_fds: int
    num_threads: int


def kind_of(pid: int, cmdline: str, launcher_pid: int, inference_pid: int) -> str:
    if pid == launcher_pid:
        return "launcher"
    if pid == inference_pid:
        return "inference"
    if "config/orchestrator.toml" in cmdline:
        return "orchestrator"
    if "config/trainer.toml" in cmdline:
        return "torchrun" if "torch.distributed.run" in cmdline else "trainer_rank"
    return "other:" + (cmdline.split()[0].rsplit("/", 1)[-1] if cmdline else "?")


class Sampler:
    """Finds the run's processes and samples them; names each process once (kind, #i in pid order of its kind)."""

    def __init__(self, out: Path, launcher_pid: int, inference_pid: int) -> None:
        self.out, self.launcher_pid, self.inference_pid = out, launcher_pid, inference_pid
        self.names: dict[int, str] = {}
        self.procs: dict[int, psutil.Process] = {}

    def discover(self) -> None:
        found = {self.launcher_pid: "", self.inference_pid: "", **run_processes(self.out)}
        for pid, cmdline in sorted(found.items()):
            if pid in self.names:
                continue
            try:
                self.procs[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
            kind = kind_of(pid, cmdline, self.launcher_pid, self.inference_pid)
            same = sum(1 for name in self.names.values() if name.split("#")[0] == kind)
            self.names[pid] = kind if same == 0 else f"{kind}#{same}"
            if same == 1:  # the first of a kind turned out not to be alone: it is #0
                first = next(p for p, n in self.names.items() if n == kind)
                self.names[first] = f"{kind}#0"

    def sample(self, step: int, t_s: float) -> list[Sample]:
        self.discover()
        samples = []
        for pid, proc in list(self.procs.items()):
            try:
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        raise psutil.NoSuchProcess(pid)
                    rss, fds, threads = proc.memory_info().rss, proc.num_fds(), proc.num_threads()
            except psutil.Error:
                del self.procs[pid]
                continue
            samples.append(Sample(step, round(t_s, 3), self.names[pid], pid, rss, fds, threads))
        return samples


def soak(args: argparse.Namespace, workdir: Path, model_dir: Path) -> tuple[list[Sample], int, float]:
    """Run the soak; return (samples, the launcher's exit code, wall seconds)."""
    out = workdir / "run"
    port = free_port()
    config_path = workdir / "rl.toml"
    config_path.write_text(tomli_w.dumps(run_config(model_dir, out, port, args)))
    inference = Inference(port, model_dir, workdir / "sim.log", dict(os.environ))
    inference.start()
    samples: list[Sample] = []
    launcher = None
    try:
        start = time.monotonic()
        launcher = launch(config_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, workdir / "launch", resume=False)
        sampler = Sampler(out, launcher.pid, inference.proc.pid)
        sampled = 0
        deadline = start + 120 + 10 * (args.steps + args.tail)
        while launcher.poll() is None and time.monotonic() < deadline:
            reached = max((m["step"] for m in metrics(out)), default=0)
            if reached > sampled and sampled < args.steps:  # sample once per new step record, up to --steps
                sampled = min(reached, args.steps)
                samples += sampler.sample(sampled, time.monotonic() - start)
                if sampled % 20 == 0 or sampled == args.steps:
                    _say(f"step {sampled}: {time.monotonic() - start:.1f}s")
            time.sleep(0.02)
        wall = time.monotonic() - start
    finally:
        if launcher is not None and launcher.poll() is None:  # timed out, or this driver failed: stop the run
            _say("stopping the run (it did not finish in time, or this driver failed)")
            launcher.terminate()  # the launcher stops its children; their watchdogs end them if it cannot
            launcher.wait(timeout=60)
        inference.stop()
    return samples, launcher.returncode, wall


# --- report -------------------------------------------------------------------------------------------------------


@dataclass
class Growth:
    process: str
    pid: int
    rss_warmup_mb: float
    rss_end_mb: float
    rss_growth_pct: float
    rss_max_mb: float
    rss_kib_per_step: float  # least-squares slope of RSS over the steps from warm-up to the end (informational)
    fds_warmup: float
    fds_end: float
    fds_max: int
    threads_warmup: float
    threads_end: float
    threads_max: int
    ok: bool = True

    @property
    def fds_delta(self) -> float:
        return self.fds_end - self.fds_warmup

    @property
    def threads_delta(self) -> float:
        return self.threads_end - self.threads_warmup


def windowed(rows: list[Sample], step: int, window: int, field: str) -> float | None:
    values = [getattr(s, field) for s in rows if step - window < s.step <= step]
    return statistics.median(values) if values else None


def slope(rows: list[Sample], first: int, last: int) -> float:
    """Least-squares slope of RSS (KiB per step) over the samples of steps first..last."""
    points = [(s.step, s.rss_bytes / 1024) for s in rows if first <= s.step <= last]
    if len(points) < 2:
        return 0.0
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var if var else 0.0


def floor(rows: list[Sample], first: int, last: int, field: str) -> int | None:
    values = [getattr(s, field) for s in rows if first <= s.step <= last]
    return min(values) if values else None


def growth(samples: list[Sample], args: argparse.Namespace) -> tuple[list[Growth], list[str]]:
    """Per process alive at both ends: figures at the warm-up step and the last step; plus the failures."""
    by_process: dict[str, list[Sample]] = {}
    for s in samples:
        by_process.setdefault(s.process, []).append(s)
    failures, table = [], []
    for name, rows in sorted(by_process.items(), key=lambda kv: (_kind_order(kv[0]), kv[0])):
        flat = args.flat_window
        w = {"rss_bytes": windowed(rows, args.warmup, args.window, "rss_bytes")}
        e = {"rss_bytes": windowed(rows, args.steps, args.window, "rss_bytes")}
        for f in ("num_fds", "num_threads"):  # floors: a leak raises them, a pooled connection open for a while not
            w[f] = floor(rows, args.warmup, args.warmup + flat - 1, f)
            e[f] = floor(rows, args.steps - flat + 1, args.steps, f)
        if None in w.values() or None in e.values():
            if w["rss_bytes"] is not None or e["rss_bytes"] is not None:  # died after warm-up, or new since
                failures.append(f"{name} (pid {rows[0].pid}) was not alive from step {args.warmup} to {args.steps}: "
                                f"sampled at steps {rows[0].step}..{rows[-1].step}")  # fmt: skip
            else:  # lived for a while between the two ends
                print(f"note: {name} (pid {rows[0].pid}) lived only from step {rows[0].step} to {rows[-1].step}")
            continue
        g = Growth(
            name, rows[-1].pid, w["rss_bytes"] / 2**20, e["rss_bytes"] / 2**20,
            100.0 * (e["rss_bytes"] - w["rss_bytes"]) / w["rss_bytes"], max(s.rss_bytes for s in rows) / 2**20,
            slope(rows, args.warmup, args.steps), w["num_fds"], e["num_fds"], max(s.num_fds for s in rows),
            w["num_threads"], e["num_threads"], max(s.num_threads for s in rows),
        )  # fmt: skip
        if g.rss_growth_pct >= args.max_rss_growth_pct:
            failures.append(f"{name}: RSS grew {g.rss_growth_pct:.1f}% (limit {args.max_rss_growth_pct}%)")
        if g.fds_delta > args.max_fd_delta:
            failures.append(f"{name}: open fds {g.fds_warmup:g} -> {g.fds_end:g} (limit +{args.max_fd_delta})")
        if g.threads_delta > args.max_thread_delta:
            failures.append(
                f"{name}: threads {g.threads_warmup:g} -> {g.threads_end:g} (limit +{args.max_thread_delta})"
            )
        g.ok = not any(f.startswith(f"{name}:") for f in failures)
        table.append(g)
    return table, failures


def _kind_order(name: str) -> int:
    kind = name.split("#")[0]
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


def print_table(table: list[Growth], args: argparse.Namespace) -> None:
    print(f"growth from step {args.warmup} to step {args.steps}: RSS the median of {args.window} samples at each end; "
          f"fds and threads the floor of steps {args.warmup}..{args.warmup + args.flat_window - 1} and "
          f"{args.steps - args.flat_window + 1}..{args.steps} (max: over the whole run)")  # fmt: skip
    print(f"{'process':<16} {'pid':>7} {'rss_mb@' + str(args.warmup):>11} {'rss_mb@' + str(args.steps):>11} "
          f"{'rss_growth':>10} {'rss_max_mb':>10} {'kib/step':>8} {'fds':>7} {'fds_d':>5} {'fds_max':>7} "
          f"{'threads':>7} {'thr_d':>5} {'thr_max':>7}  ok")  # fmt: skip
    for g in table:
        fds, threads = f"{g.fds_warmup:g}->{g.fds_end:g}", f"{g.threads_warmup:g}->{g.threads_end:g}"
        print(
            f"{g.process:<16} {g.pid:>7} {g.rss_warmup_mb:>11.1f} {g.rss_end_mb:>11.1f} {g.rss_growth_pct:>9.2f}% "
            f"{g.rss_max_mb:>10.1f} {g.rss_kib_per_step:>8.2f} {fds:>7} {g.fds_delta:>+5g} {g.fds_max:>7} "
            f"{threads:>7} {g.threads_delta:>+5g} {g.threads_max:>7}  {'yes' if g.ok else 'NO'}"
        )


def write_samples(path: Path, samples: list[Sample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [asdict(s) for s in samples]
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(Sample.__dataclass_fields__))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="last step sampled and compared (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="step growth is measured from (default: %(default)s)")
    p.add_argument("--window", type=int, default=5, help="samples per median at each end (default: %(default)s)")
    p.add_argument("--flat-window", type=int, default=0, help="steps of the fd/thread floors at each end "
                   "(default: a quarter of the steps from --warmup to --steps)")  # fmt: skip
    p.add_argument("--tail", type=int, default=3, help="steps trained after --steps (default: %(default)s)")
    p.add_argument("--max-rss-growth-pct", type=float, default=10.0, help="(default: %(default)s)")
    p.add_argument("--max-fd-delta", type=float, default=0, help="(default: %(default)s)")
    p.add_argument("--max-thread-delta", type=float, default=0, help="(default: %(default)s)")
    p.add_argument("--trainer-procs", type=int, default=1, help="trainer ranks (gloo) (default: %(default)s)")
    p.add_argument("--samples", type=Path, default=None, help="write every sample here (.jsonl or .csv)")
    p.add_argument("--workdir", type=Path, default=None, help="where the run goes (default: a temporary folder)")
    p.add_argument("--model", type=Path, default=None, help="tiny model folder (default: build qwen3 tiny)")
    args = p.parse_args(argv)
    if not 1 <= args.window <= args.warmup < args.steps:
        p.error("need 1 <= --window <= --warmup < --steps")
    args.flat_window = args.flat_window or max(1, (args.steps - args.warmup) // 4)
    if not 1 <= args.flat_window <= (args.steps - args.warmup) // 2 + 1:
        p.error("--flat-window must be between 1 and half the steps from --warmup to --steps")
    if args.tail < 1:
        p.error("--tail must be >= 1 (the last sample must not race the shutdown)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir, model_dir = workdir_and_model(args, "slipstream-soak-")
    _say(f"workdir {workdir}; {args.steps} steps (+{args.tail}), growth from step {args.warmup}")
    samples, code, wall = soak(args, workdir, model_dir)
    if args.samples is not None:
        write_samples(args.samples, samples)
    table, failures = growth(samples, args)
    if code != 0:
        err = (workdir / "launch.err").read_text()[-3000:]
        failures.insert(0, f"the run exited {code}:\n{err}")
    print_table(table, args)
    print(f"run_s: {wall:.1f} ({args.steps + args.tail} steps, {len(samples)} samples)")
    for failure in failures:
        print(f"FAILED: {failure}")
    print(f"soak_ok: {'false' if failures else 'true'}")
    if args.workdir is None and not failures:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
