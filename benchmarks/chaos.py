"""Chaos: SIGKILL random processes of a tiny-model `slipstream rl` run at random moments, resume, and check it ends
exactly like an uninterrupted run.

    python benchmarks/chaos.py --kills 20 --steps 40 --seed 0

CPU only. Inference is the simulated vLLM server (`python -m slipstream_sim`, no model: seeded tokens,
version-dependent log-probs), started by this driver next to a `slipstream rl` that runs the trainer and the
orchestrator (deployment.run). The run is exact (max_async_level = 0, seeded requests) and checkpoints every step, so
a resumed run must end with the weights of an uninterrupted one, bit for bit.

A seeded schedule picks, per kill, the victim (launcher, trainer agent (torchrun), trainer rank, orchestrator,
inference server; each kind once before kinds repeat) and the moment: a random part of the startup after a launch,
or a random delay (<= 0.5 s) after a file of a random step appears: its batch, its published weights, its committed
checkpoint. After each kill the driver waits for the run to stop (inference: the driver restarts the server, as the
launcher's inference restarts would, and the run goes on), checks that no process of the run is left and none holds
a file of it, then runs `slipstream rl --resume`. Environment servers and routers: this codebase has none to kill.

Checks (any failure: exit 1): final weights bit-equal to the uninterrupted run's; metrics.jsonl holds steps
1..max_steps once each, and every step record any launch wrote has the reference's loss, grad norm, reward and token
count; each launch trained consecutive steps from its resume step; no process of the run left after each kill and at
the end; retention: the checkpoints left are the uninterrupted run's, the weights those of the checkpoints and at most
one more than it kept, no temporary folder, and the data planes never above the uninterrupted run's size (+10%) plus
one checkpoint and one weights folder being written. Prints one row per kill, the time lost per kill by victim kind
(restart plus redone work, see `time_lost`), and last `kills_survived: N/N`.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import tomli_w

from slipstream.utils.net import free_port

RUN_DIR_ENV = "SLIPSTREAM_RUN_DIR"  # the launcher's marker in every child's environment (rundir.RUN_DIR_ENV)
CHAOS_ENV = "SLIPSTREAM_CHAOS_ID"  # this driver's marker: every process it started, and their descendants
VICTIMS = ("launcher", "torchrun", "trainer_rank", "orchestrator", "inference")
MOMENTS = ("after_launch", "batch", "weights", "checkpoint")
STOP_TIMEOUT_S = 90.0  # a run whose trainer or orchestrator died stops within this
LEFTOVER_DEADLINE_S = 15.0  # every process of a killed run is gone within this (watchdogs poll every 0.5 s)
SIZE_SLACK = 1.10


@dataclass
class Kill:
    index: int
    victim: str
    moment: str
    spacing: float  # in [0, 1): where in its share of the remaining steps the kill's step falls
    delay_s: float
    step_target: int = 0  # the step its moment refers to, decided when the kill's wait starts
    pid: int = 0
    at_s: float = 0.0  # seconds since the chaos run started
    trained: int = 0  # steps in metrics.jsonl when the kill landed
    committed: int = 0  # newest committed checkpoint when the kill landed
    resumed_from: int | None = None
    time_lost_s: float = 0.0
    cleanup_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _say(message: str) -> None:
    print(f"[chaos] {message}", flush=True)


# --- the run ------------------------------------------------------------------------------------------------------


def run_config(model_dir: Path, out: Path, port: int, args: argparse.Namespace) -> dict:
    """The exact-mode tiny run: synchronous, seeded requests, a checkpoint every step."""
    return {
        "max_steps": args.steps,
        "output_dir": str(out),
        "seed": 7,
        "model": {"name": str(model_dir)},
        "deployment": {"run": ["trainer", "orchestrator"]},
        "weights": {"transport": "filesystem"},
        "orchestrator": {
            "inference_url": f"http://127.0.0.1:{port}",
            "max_async_level": 0,
            "seed_requests": True,
            "batch_size": 8,
            "group_size": 4,
            "micro_batch_tokens": 512,
            "sampling": {"temperature": 1.0, "max_tokens": 12},
            "env": {"name": "reverse_text", "args": {"num_tasks": 64}},
            "weight_check": {"enabled": False},  # the simulator's log-probs are not the model's
        },
        "trainer": {"optim": {"lr": 3e-3, "max_grad_norm": 10.0}, "num_threads": 1},
        "launch": {"num_trainer_procs": args.trainer_procs, "health_timeout_s": 120, "shutdown_grace_s": 5},
        "checkpoint": {"interval": 1, "keep_last": 1, "keep_every": args.keep_every},
    }


class Inference:
    """The simulated inference server of a run, restartable on the same port."""

    def __init__(self, port: int, model_dir: Path, log_path: Path, env: dict) -> None:
        self.port, self.model_dir, self.log_path, self.env = port, model_dir, log_path, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "slipstream_sim", "--port", str(self.port), "--seed", "3"]
        argv += ["--vocab-size", "256", "--model-name", str(self.model_dir), "--default-max-tokens", "12"]
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the simulated server exited: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("the simulated server never answered /health")
            time.sleep(0.2)

    def healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch(config_path: Path, env: dict, log_base: Path, resume: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(config_path), *(["--resume"] if resume else [])]
    with open(f"{log_base}.out", "w") as out, open(f"{log_base}.err", "w") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)


def metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def committed_steps(out: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step_")) for p in (out / "checkpoints").glob("step_*/COMMITTED"))


def run_processes(out: Path) -> dict[int, str]:
    """pid -> command line of live processes carrying this run directory's marker (set by the launcher)."""
    target, found = str(out.resolve()), {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE or proc.environ().get(RUN_DIR_ENV) != target:
                continue
            found[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:
            continue
    return found


def chaos_processes(chaos_id: str, exclude: set[int]) -> dict[int, str]:
    """Live processes this driver started (or their descendants), but those in `exclude`."""
    found = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid in exclude or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get(CHAOS_ENV) == chaos_id:
                found[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:
            continue
    return found


def file_holders(out: Path, exclude: set[int]) -> dict[int, str]:
    """pid -> an open file under the run directory, of this user's processes (but `exclude`)."""
    root, uid, holders = str(out.resolve()) + os.sep, os.getuid(), {}
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid in exclude or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            paths = [f.path for f in proc.open_files() if f.path.startswith(root)]
        except psutil.Error:
            continue
        if paths:
            holders[proc.pid] = paths[0]
    return holders


def victim_pids(kind: str, out: Path, launcher: subprocess.Popen, inference: Inference) -> list[int]:
    """Live pids of the process kind `kind` of this run."""
    if kind == "launcher":
        return [launcher.pid] if launcher.poll() is None else []
    if kind == "inference":
        return [inference.proc.pid] if inference.proc is not None and inference.proc.poll() is None else []

    def is_kind(cmdline: str) -> bool:
        if kind == "orchestrator":
            return "config/orchestrator.toml" in cmdline
        is_agent = "torch.distributed.run" in cmdline
        return "config/trainer.toml" in cmdline and is_agent == (kind == "torchrun")

    return sorted(pid for pid, cmdline in run_processes(out).items() if is_kind(cmdline))


# --- the schedule -------------------------------------------------------------------------------------------------


def build_schedule(num_kills: int, rng: random.Random, victims: tuple[str, ...]) -> list[Kill]:
    """Kills in run order: each a victim, a moment kind, a spacing and a delay. Every kind is hit once (in random
    order) before kinds repeat at random. The step a file moment refers to is chosen when the kill's wait starts,
    from the progress then (see Chaos.moment_step), so that the kills spread over the run and all land in it."""
    kinds = list(victims)
    rng.shuffle(kinds)
    kills = []
    for i in range(num_kills):
        victim = kinds[i] if i < len(kinds) else rng.choice(victims)
        moment = rng.choice(MOMENTS)
        # after the launch: a fraction of the uninterrupted run's startup (so it lands before the next step)
        delay = rng.uniform(0.0, 0.9) if moment == "after_launch" else rng.uniform(0.0, 0.5)
        kills.append(Kill(i + 1, victim, moment, rng.random(), round(delay, 3)))
    return kills


def moment_path(out: Path, moment: str, step: int) -> Path:
    """The file whose appearance starts a kill's delay: step `step`'s batch, published weights or committed
    checkpoint."""
    return {
        "batch": out / "rollouts" / f"step_{step}" / "rank_0.msgpack",
        "weights": out / "weights" / f"step_{step}" / "READY",
        "checkpoint": out / "checkpoints" / f"step_{step}" / "COMMITTED",
    }[moment]


# --- watching a launch --------------------------------------------------------------------------------------------


class StepWatch:
    """Polls metrics.jsonl: when each step's record appeared, and which steps each launch trained. A launch's records
    are those appended after its launcher printed `starting` (by then a resume has truncated the step logs)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.jsonl"
        self.stdout_path: Path | None = None
        self.offset: int | None = None  # None: the current launch has not started its processes yet
        self.segments: list[list[dict]] = []
        self.reached: dict[int, float] = {}  # step -> when its record was last seen appearing
        self.sightings: list[tuple[int, float]] = []  # (step, when its record appeared), every launch

    def new_segment(self, stdout_path: Path) -> None:
        self.segments.append([])
        self.stdout_path, self.offset = stdout_path, None

    def poll(self) -> None:
        if self.offset is None:
            if self.stdout_path is None or "starting " not in self.stdout_path.read_text():
                return
            self.offset = self.path.stat().st_size if self.path.exists() else 0
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            for line in iter(f.readline, b""):
                if not line.endswith(b"\n"):
                    break
                self.offset += len(line)
                record = json.loads(line)
                self.segments[-1].append(record)
                self.reached[record["step"]] = time.monotonic()
                self.sightings.append((record["step"], self.reached[record["step"]]))


def wait_for(predicate, launcher: subprocess.Popen, watch: StepWatch, timeout_s: float) -> bool:
    """Poll until `predicate()`; False if the launcher ended first (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        watch.poll()
        if launcher.poll() is not None or time.monotonic() > deadline:
            return predicate()
        time.sleep(0.02)
    return True


def wait_leftovers(
    out: Path, chaos_id: str, keep: set[int], watch: StepWatch
) -> tuple[float, dict[int, str], dict[int, str]]:
    """Wait until no process of the run is alive and none holds a file of it (recording the steps they still
    finish: a launcher's children live up to their watchdog's poll after it); return (seconds, left, holders)."""
    start = time.monotonic()
    while True:
        watch.poll()
        left = {**run_processes(out), **chaos_processes(chaos_id, keep)}
        holders = file_holders(out, keep) if not left else {}
        if (not left and not holders) or time.monotonic() - start > LEFTOVER_DEADLINE_S:
            return time.monotonic() - start, left, holders
        time.sleep(0.1)


@dataclass
class Segment:
    """One launch of `slipstream rl` (the first, or a --resume)."""

    resume_step: int | None
    exit_code: int | None = None
    started_s: float = 0.0


class Chaos:
    """The interrupted run: its launches, its simulated server, the kills delivered and the checks failed."""

    def __init__(self, args: argparse.Namespace, workdir: Path, model_dir: Path) -> None:
        self.args, self.workdir, self.model_dir = args, workdir, model_dir
        self.out = workdir / "chaos" / "run"
        self.chaos_id = f"chaos-{os.getpid()}-{time.time_ns()}"
        self.env = {**os.environ, CHAOS_ENV: self.chaos_id, "PYTHONUNBUFFERED": "1"}
        port = free_port()
        (workdir / "chaos").mkdir(parents=True)
        self.config_path = workdir / "chaos" / "rl.toml"
        self.config_path.write_text(tomli_w.dumps(run_config(model_dir, self.out, port, args)))
        self.inference = Inference(port, model_dir, workdir / "chaos" / "sim.log", self.env)
        self.watch = StepWatch(self.out)
        self.segments: list[Segment] = []
        self.failures: list[str] = []
        self.kills_this_launch = 0  # kills delivered since the last launch (inference kills do not relaunch)
        self.start = 0.0
        self.total_s = 0.0
        self.startup_s = 5.0  # launch -> first step of the uninterrupted run (set from the reference)
        self.size_bound = 0  # bytes the run directory may hold (set from the reference)
        self.peak_bytes = 0

    def check_size(self, when: str) -> None:
        size = data_bytes(self.out)
        self.peak_bytes = max(self.peak_bytes, size)
        if self.size_bound and size > self.size_bound:
            self.fail(f"run directory holds {size} bytes {when}, above the bound {self.size_bound}")

    def fail(self, message: str) -> None:
        _say(f"CHECK FAILED: {message}")
        self.failures.append(message)

    def keep_pids(self) -> set[int]:
        keep = {os.getpid()}
        if self.inference.proc is not None:
            keep.add(self.inference.proc.pid)
        return keep

    def launch(self) -> subprocess.Popen:
        resume = bool(self.segments)
        base = self.workdir / "chaos" / f"launch_{len(self.segments)}"
        launcher = launch(self.config_path, self.env, base, resume)
        self.kills_this_launch = 0
        self.segments.append(Segment(None, started_s=time.monotonic() - self.start))
        self.watch.new_segment(Path(f"{base}.out"))
        return launcher

    def run(self, kills: list[Kill]) -> None:
        self.start = time.monotonic()
        self.inference.start()
        launcher = self.launch()
        for kill in kills:
            launcher = self.one_kill(kill, launcher)
        code = self.finish_segment(launcher, timeout_s=60 + 20 * self.args.steps)
        if code != 0:
            self.fail(f"the last launch exited {code}: {self.tail_err(len(self.segments) - 1)}")
        self.inference.stop()
        seconds, left, holders = wait_leftovers(self.out, self.chaos_id, {os.getpid()}, self.watch)
        if left or holders:
            self.fail(f"processes left at the end: {left or holders}")
            self.kill_leftovers(left)
        self.total_s = time.monotonic() - self.start

    def tail_err(self, index: int, num_chars: int = 1500) -> str:
        path = self.workdir / "chaos" / f"launch_{index}.err"
        return path.read_text()[-num_chars:] if path.exists() else ""

    def finish_segment(self, launcher: subprocess.Popen, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while launcher.poll() is None and time.monotonic() < deadline:
            self.watch.poll()
            time.sleep(0.05)
        self.watch.poll()
        if launcher.poll() is None:
            self.fail(f"launch {len(self.segments) - 1} did not stop within {timeout_s:.0f}s")
            launcher.kill()
            launcher.wait()
        segment = self.segments[-1]
        segment.exit_code = launcher.returncode
        stdout = (self.workdir / "chaos" / f"launch_{len(self.segments) - 1}.out").read_text()
        if m := re.search(r"resuming \S+ after step (\d+)", stdout):
            segment.resume_step = int(m.group(1))
        elif "no committed checkpoint" in stdout or len(self.segments) == 1:
            segment.resume_step = 0
        return launcher.returncode

    def kill_leftovers(self, pids) -> None:
        for pid in pids:
            if pid in chaos_processes(self.chaos_id, set()):  # only what this driver started
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def one_kill(self, kill: Kill, launcher: subprocess.Popen) -> subprocess.Popen:
        """Wait for the kill's moment, SIGKILL its victim, wait for the run to stop and leave nothing, resume."""
        pid = None
        for _ in range(2):
            if launcher.poll() is not None:
                self.finish_segment(launcher, 0)
                if launcher.returncode != 0:  # the run died on its own after the last kill
                    self.fail(f"launch {len(self.segments) - 1} exited {launcher.returncode} before kill {kill.index}")
                else:  # orphans of a kill (alive up to their watchdog's poll) or the run itself finished the steps
                    kill.notes.append("the run had finished: hit a --resume of it")
                launcher = self.launch()
            if (pid := self.wait_moment_and_victim(kill, launcher)) is not None:
                break
        if pid is None:
            kill.notes.append("missed")
            self.fail(f"kill {kill.index} ({kill.victim}) not delivered: no {kill.victim} while the run was up")
            return launcher
        kill.trained, committed = len(metrics(self.out)), committed_steps(self.out)
        kill.committed = committed[-1] if committed else 0
        kill.pid, kill.at_s = pid, time.monotonic() - self.start
        self.kills_this_launch += 1
        os.kill(pid, signal.SIGKILL)
        self.check_size(f"at kill {kill.index}")
        if kill.victim == "inference":
            self.inference.proc.wait()
            self.inference.start()  # what the launcher's inference restarts do for a server it runs
            kill.notes.append("server restarted; the run went on")
            return launcher
        code = self.finish_segment(launcher, STOP_TIMEOUT_S)
        if code == 0:
            kill.notes.append("the run had already finished")
        kill.cleanup_s, left, holders = wait_leftovers(self.out, self.chaos_id, self.keep_pids(), self.watch)
        if left or holders:
            self.fail(f"kill {kill.index} ({kill.victim}): left after {LEFTOVER_DEADLINE_S:.0f}s: {left or holders}")
            self.kill_leftovers(left)
        role = {"torchrun": "trainer", "trainer_rank": "trainer"}.get(kill.victim, kill.victim)
        if (
            kill.victim != "launcher"
            and code != 0
            and f"error: {role} " not in self.tail_err(len(self.segments) - 1, 10**6)
        ):
            self.fail(f"kill {kill.index}: the launcher did not name the {role} as what failed")
        return self.launch() if code != 0 else launcher

    def moment_step(self, kill: Kill) -> int:
        """The step a file moment refers to: past the steps done now (P), within this kill's equal share of the steps
        left before the last one (by its spacing), at most the next-to-last step (a file of a step <= P exists: the
        kill comes right after its delay)."""
        done, remaining = len(metrics(self.out)), self.args.kills - kill.index + 1
        share = max(0, self.args.steps - 1 - done) // remaining
        return min(done + 1 + int(kill.spacing * (share + 1)) - (1 if share == 0 else 0), self.args.steps - 1)

    def wait_moment_and_victim(self, kill: Kill, launcher: subprocess.Popen) -> int | None:
        """Pid of the victim (a random one of its kind) once the kill's moment and delay have come (and the victim
        exists); None if the run ended first. A second kill in one launch (after an inference kill) cannot come
        after the launch: it comes after a batch."""
        if kill.moment == "after_launch" and self.kills_this_launch:  # the launch is long past: its next batch
            kill.moment, kill.delay_s = "batch", min(kill.delay_s, 0.5)
        if kill.moment != "after_launch":
            if not wait_for(lambda: self.watch.offset is not None, launcher, self.watch, 600):
                return None
            step = kill.step_target = self.moment_step(kill)
            passed = step <= len(metrics(self.out))  # its file may be pruned (weights, checkpoints): go now
            if not passed and not wait_for(moment_path(self.out, kill.moment, step).exists, launcher, self.watch, 600):
                return None
        delay = kill.delay_s * self.startup_s if kill.moment == "after_launch" else kill.delay_s
        wait_for(lambda: False, launcher, self.watch, delay)
        rng = random.Random(f"{self.args.seed}:{kill.index}")
        found = wait_for(
            lambda: bool(victim_pids(kill.victim, self.out, launcher, self.inference)), launcher, self.watch, 120
        )
        pids = victim_pids(kill.victim, self.out, launcher, self.inference)
        return rng.choice(pids) if found and pids else None


# --- reference, checks, report ------------------------------------------------------------------------------------

DATA_PLANES = ("rollouts", "weights", "checkpoints")


def data_bytes(out: Path) -> int:
    """Bytes under the run's data planes (rollouts, weights, checkpoints) and metrics: what retention bounds (logs
    grow with every launch by design)."""
    total = 0
    for plane in DATA_PLANES:
        for folder, _, files in os.walk(out / plane):  # folders pruned meanwhile are skipped
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except FileNotFoundError:
                    continue
    return total


def plane_listing(out: Path) -> dict[str, list[str]]:
    return {plane: sorted(p.name for p in (out / plane).iterdir()) if (out / plane).is_dir() else [] for plane in
            DATA_PLANES}  # fmt: skip


@dataclass
class Reference:
    out: Path
    wall_s: float
    step_times: dict[int, float]  # step -> seconds after the launch its record appeared (0: the launch)
    data_bytes: int
    checkpoint_bytes: int
    weights_bytes: int


def run_reference(args: argparse.Namespace, workdir: Path, model_dir: Path) -> Reference:
    """An uninterrupted run of the same config (its own simulated server of the same seed)."""
    root = workdir / "reference"
    root.mkdir(parents=True)
    port = free_port()
    out = root / "run"
    config_path = root / "rl.toml"
    config_path.write_text(tomli_w.dumps(run_config(model_dir, out, port, args)))
    inference = Inference(port, model_dir, root / "sim.log", dict(os.environ))
    inference.start()
    try:
        start = time.monotonic()
        launcher = launch(config_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, root / "launch", resume=False)
        watch = StepWatch(out)
        watch.new_segment(root / "launch.out")
        while launcher.poll() is None:
            watch.poll()
            time.sleep(0.02)
        watch.poll()
        wall = time.monotonic() - start
    finally:
        inference.stop()
    if launcher.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{(root / 'launch.err').read_text()[-3000:]}")
    times = {0: 0.0, **{step: t - start for step, t in watch.reached.items()}}
    ckpt = max(committed_steps(out))
    return Reference(
        out, wall, times, data_bytes(out), tree_bytes(out / "checkpoints" / f"step_{ckpt}"),
        tree_bytes(out / "weights" / f"step_{args.steps}"),
    )  # fmt: skip


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_final(chaos: Chaos, ref: Reference, steps: int) -> None:
    import torch
    from safetensors.torch import load_file

    name = f"weights/step_{steps}/model.safetensors"
    if not (chaos.out / name).exists():
        chaos.fail(f"no {name}")
    else:
        got, want = load_file(chaos.out / name), load_file(ref.out / name)
        if got.keys() != want.keys():
            chaos.fail(f"{name}: tensor names differ")
        differ = [k for k in want if k in got and not torch.equal(got[k], want[k])]
        if differ:
            chaos.fail(f"{name}: {len(differ)} tensor(s) differ from the uninterrupted run's, e.g. {differ[0]}")
    history, want_history = metrics(chaos.out), {m["step"]: m for m in metrics(ref.out)}
    if [m["step"] for m in history] != list(range(1, steps + 1)):
        chaos.fail(f"metrics.jsonl steps are {[m['step'] for m in history]}, not 1..{steps} once each")
    keys = ("loss", "grad_norm", "reward/mean", "num_tokens")
    seen = [m for segment in chaos.watch.segments for m in segment]
    for m in history + seen:
        ref_m = want_history.get(m["step"], {})
        if any(m.get(k) != ref_m.get(k) for k in keys):
            chaos.fail(f"step {m['step']}: {[(k, m.get(k), ref_m.get(k)) for k in keys]} (chaos, reference)")
            break
    trained_max = 0  # the most steps any launch so far had trained
    for i, (segment, records) in enumerate(zip(chaos.segments, chaos.watch.segments, strict=True)):
        got_steps = [m["step"] for m in records]
        if segment.resume_step is not None and segment.resume_step > trained_max:
            chaos.fail(f"launch {i} resumed after step {segment.resume_step}, which no launch had trained")
        start = (segment.resume_step or 0) + 1
        if got_steps and got_steps != list(range(start, start + len(got_steps))):
            chaos.fail(f"launch {i} (resumed after step {segment.resume_step}) trained steps {got_steps}")
        trained_max = max([trained_max, *got_steps])
    # retention: checkpoints follow keep_last / keep_every alone, so the same as the uninterrupted run's; which
    # weights are pruned depends on timing (served versions), so those of the committed checkpoints and at most one
    # more than the uninterrupted run kept; rollouts of steps 1..max_steps; no temporary folder of a killed writer
    listing, want = plane_listing(chaos.out), plane_listing(ref.out)
    if listing["checkpoints"] != want["checkpoints"]:
        chaos.fail(f"checkpoints left {listing['checkpoints']}, the uninterrupted run {want['checkpoints']}")
    if not set(want["checkpoints"]) <= set(listing["weights"]) or len(listing["weights"]) > len(want["weights"]) + 1:
        chaos.fail(f"weights left {listing['weights']}, the uninterrupted run {want['weights']}")
    if listing["rollouts"] != want["rollouts"]:
        chaos.fail(f"rollouts left {listing['rollouts']}, the uninterrupted run {want['rollouts']}")
    if hidden := [f"{plane}/{name}" for plane, names in listing.items() for name in names if name.startswith(".")]:
        chaos.fail(f"temporary folders left: {hidden}")
    chaos.check_size("at the end")


def time_lost(chaos: Chaos, kills: list[Kill], ref: Reference) -> None:
    """Per kill: from when the run had last completed the step it went on from (R: the resume step, or for an
    inference kill the steps done at the kill) to when it next completed step R+1, less what the uninterrupted run took
    for that step (from its launch for R = 0). That is the restart plus the work redone. Cut at the next kill, which
    then counts from there (nothing subtracted)."""
    landed = [k for k in kills if k.pid]
    sightings = chaos.watch.sightings
    for i, kill in enumerate(landed):
        at = chaos.start + kill.at_s
        cut = chaos.start + landed[i + 1].at_s if i + 1 < len(landed) else chaos.start + chaos.total_s
        if kill.victim == "inference" or kill.resumed_from is None:
            step, back_from = kill.trained, at
        else:
            step = kill.resumed_from
            back_from = min([chaos.start + s.started_s for s in chaos.segments if s.started_s > kill.at_s] or [cut])
        done = [t for s, t in sightings if s == step and t <= back_from]
        since = done[-1] if done and step > 0 else chaos.start + chaos.segments[0].started_s
        since = max(since, chaos.start + landed[i - 1].at_s) if i > 0 else since
        nxt = [t for s, t in sightings if s == step + 1 and t > back_from]
        if nxt and nxt[0] <= cut:
            normal = ref.step_times.get(step + 1, 0.0) - ref.step_times.get(step, 0.0)
            kill.time_lost_s = nxt[0] - since - (normal if since in done[-1:] or step == 0 else 0.0)
        else:
            kill.time_lost_s = cut - since


def report(chaos: Chaos, kills: list[Kill], ref: Reference) -> None:
    print(f"{'#':>3} {'victim':<13} {'moment':<20} {'pid':>7} {'at_s':>7} {'trained':>7} {'committed':>9} "
          f"{'resumed':>7} {'cleanup_s':>9} {'lost_s':>7}  notes")  # fmt: skip
    for kill in kills:
        where = "" if kill.moment == "after_launch" else f"@{kill.step_target}"
        moment = f"{kill.moment}{where}+{kill.delay_s:.2f}"
        resumed = "-" if kill.resumed_from is None else str(kill.resumed_from)
        print(
            f"{kill.index:>3} {kill.victim:<13} {moment:<20} {kill.pid:>7} {kill.at_s:>7.1f} {kill.trained:>7} "
            f"{kill.committed:>9} {resumed:>7} {kill.cleanup_s:>9.2f} {kill.time_lost_s:>7.1f}  {'; '.join(kill.notes)}"
        )
    by_kind: dict[str, list[float]] = {}
    for kill in kills:
        if kill.pid:
            by_kind.setdefault(kill.victim, []).append(kill.time_lost_s)
    for kind in VICTIMS:
        if kind in by_kind:
            lost = sorted(by_kind[kind])
            print(f"time_lost_s[{kind}]: n={len(lost)} mean={sum(lost) / len(lost):.1f} max={lost[-1]:.1f}")
    print(f"uninterrupted_run_s: {ref.wall_s:.1f}")
    print(f"chaos_run_s: {chaos.total_s:.1f} ({len(chaos.segments)} launches)")
    print(f"run_dir_data_bytes: peak {chaos.peak_bytes} bound {chaos.size_bound} uninterrupted {ref.data_bytes}")
    retrained = sum(len(r) for r in chaos.watch.segments) - len(metrics(chaos.out))
    print(f"steps_retrained_after_kills: {retrained}")
    for failure in chaos.failures:
        print(f"FAILED: {failure}")
    survived = sum(1 for k in kills if k.pid) if not chaos.failures else 0
    print(f"kills_survived: {survived}/{len(kills)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs to deliver (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="training steps of the run (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill schedule (default: %(default)s)")
    p.add_argument("--victims", default=",".join(VICTIMS), help="process kinds to kill (default: %(default)s)")
    p.add_argument("--trainer-procs", type=int, default=1, help="trainer ranks (gloo) (default: %(default)s)")
    p.add_argument("--keep-every", type=int, default=2, help="checkpoint.keep_every (default: %(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="where runs go (default: a temporary folder)")
    p.add_argument("--model", type=Path, default=None, help="tiny model folder (default: build qwen3 tiny)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2")
    args.victims = tuple(v for v in args.victims.split(",") if v)
    if unknown := set(args.victims) - set(VICTIMS):
        p.error(f"unknown victims {sorted(unknown)}; pick from {', '.join(VICTIMS)}")
    return args


def workdir_and_model(args: argparse.Namespace, prefix: str) -> tuple[Path, Path]:
    """(`--workdir` or a fresh temporary folder, `--model` or a tiny qwen3 built in it)."""
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        return workdir, args.model
    from slipstream.models.tiny import build_tiny_model

    return workdir, build_tiny_model("qwen3", workdir / "model")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir, model_dir = workdir_and_model(args, "slipstream-chaos-")
    kills = build_schedule(args.kills, random.Random(args.seed), args.victims)
    _say(f"workdir {workdir}; {args.kills} kills over {args.steps} steps (seed {args.seed})")
    ref = run_reference(args, workdir, model_dir)
    _say(f"uninterrupted run: {ref.wall_s:.1f}s, first step after {ref.step_times.get(1, 0):.1f}s")
    chaos = Chaos(args, workdir, model_dir)
    chaos.startup_s = ref.step_times.get(1, 5.0)
    # retention holds the uninterrupted run's final layout, plus one checkpoint and one weights folder being written
    chaos.size_bound = int(ref.data_bytes * SIZE_SLACK) + ref.checkpoint_bytes + ref.weights_bytes
    try:
        chaos.run(kills)
    finally:
        chaos.inference.stop()
        chaos.kill_leftovers(chaos_processes(chaos.chaos_id, {os.getpid()}))  # after an error of this driver
    for kill in (k for k in kills if k.pid):
        later = [s for s in chaos.segments if s.started_s > kill.at_s]
        kill.resumed_from = later[0].resume_step if later and kill.victim != "inference" else None
    check_final(chaos, ref, args.steps)
    time_lost(chaos, kills, ref)
    report(chaos, kills, ref)
    if args.workdir is None and not chaos.failures:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if chaos.failures else 0


if __name__ == "__main__":
    sys.exit(main())
