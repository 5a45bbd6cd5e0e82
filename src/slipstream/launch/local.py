"""`slipstream rl` on one machine: write configs, start inference/trainer/orchestrator, supervise, stop cleanly."""

import functools
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from slipstream.config.base import ConfigError
from slipstream.config.rl import RLConfig
from slipstream.inference.admin_token import ensure_admin_token
from slipstream.inference.vllm_support import check_vllm
from slipstream.launch.colocate_memory import ColocatePlan, oom_hint
from slipstream.launch.models import resolve_run_model
from slipstream.launch.placement import detect_visible_gpus
from slipstream.launch.plan import ProcessSpec, build_plan, resolve_with_memory, write_configs
from slipstream.launch.restarts import InferenceRestarts
from slipstream.launch.supervisor import ChildFailed, StopRequested, Supervisor, supervising
from slipstream.launch.trainer_nodes import launch_id, publish_launch, run_secondary_trainer
from slipstream.rundir import RunDir, RunLock, RunLockedError, launcher_env, wait_no_run_processes
from slipstream.transport.checkpoints import committed_run_steps, prepare_resume, prune_checkpoints, resolve_run_step
from slipstream.utils.net import free_port
from slipstream.weights.wire.published import is_ready

EARLIER_RUN_EXIT_S = 3.0
"""How long a new launcher waits for the processes of a just-killed run of its directory to end themselves (their
watchdogs poll every 0.5 s) before it refuses to start."""


def run_rl(config: RLConfig) -> int:
    """Run the whole RL job holding the run directory's lock; return the exit code (0 = all steps done, 2 = the
    directory is in use or the config cannot run)."""
    if config.launch.trainer_node_rank > 0:
        return run_secondary_trainer(config)  # trainer node 0 holds the run directory's lock
    return run_locked(RunDir(config.output_dir), lambda run: _run_locked(config, run), _say)


def run_locked(run: RunDir, body: Callable[[RunDir], int], say: Callable[..., None]) -> int:
    """`body(run)` holding `run`'s lock (created if missing); 2, said on stderr, if another run holds it."""
    run.root.mkdir(parents=True, exist_ok=True)
    try:
        lock = claim_run_dir(run)
    except RunLockedError as e:
        say(f"error: {e}", err=True)
        return 2
    try:
        return body(run)
    finally:
        lock.release()


def claim_run_dir(run: RunDir) -> RunLock:
    """Take the run lock, then make sure no process of an earlier run of this directory is alive (a launcher
    killed by SIGKILL leaves none for long: see launch/watchdog.py). Raises RunLockedError naming the processes."""
    lock = RunLock(run).acquire()
    try:
        wait_no_run_processes(run, EARLIER_RUN_EXIT_S)
    except BaseException:
        lock.release()
        raise
    return lock


def _run_locked(config: RLConfig, run: RunDir) -> int:
    try:
        config, gpus, memory = resolve_node_config(config)
        if config.launch.trainer_nodes > 1:
            launch_id(config)  # checked before anything starts
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        for line in str(e).splitlines():
            _say(f"error: {line}", err=True)
        return 2
    write_configs(config)
    write_admin_token(config.output_dir)
    publish_launch(config)  # a trainer spanning nodes: the others start on these configs
    specs = {spec.name: spec for spec in build_plan(config, gpus=gpus)}
    start = time.monotonic()
    with supervising(Supervisor(grace_s=config.launch.shutdown_grace_s, env=launcher_env(run))) as sup:
        try:
            _say(f"run directory {run.root} (logs in {run.logs_dir}); starting {', '.join(specs)} on this node")
            if pinned := [f"{name} {','.join(map(str, spec.cpus))}" for name, spec in specs.items() if spec.cpus]:
                _say(f"CPU cores (deployment.split_cpu_cores): {'; '.join(pinned)}")
            if config.trainer.colocated:
                _say(_colocated_line(config))
                if memory is not None:
                    _say(memory.summary())
            start_processes(sup, specs, config, start)
            watch_until_done(sup, config, set(specs))
            _say(f"done: {config.max_steps} steps in {time.monotonic() - start:.0f}s; metrics in {config.output_dir}")
            if "orchestrator" in specs:
                _write_plots(config.output_dir)
                _print_heldout(config.output_dir)
            return 0
        except ChildFailed as e:
            for line in e.report():
                _say(line, err=True)
            if e.name in ("trainer", "inference") and _out_of_memory(e):
                _say(f"hint: {oom_hint(config, e.name)}", err=True)
            return 1
        except TimeoutError as e:
            _say(f"error: {e}", err=True)
            return 1
        except StopRequested as e:
            _say(f"received {e}; stopping all processes", err=True)
            return 130


def resolve_node_config(config: RLConfig) -> tuple[RLConfig, list[int], ColocatePlan | None]:
    """What this node runs: resume prepared (where the trainer runs), the model resolved once for every process
    (a Hub id is downloaded here, before any child starts), and the deployment placed on the visible GPUs (with the
    memory plan of a run colocated on a GPU). Where this node starts vLLM, its release is checked first
    (inference/vllm_support.py)."""
    if "inference" in config.deployment.run:
        check_vllm()
    if "trainer" in config.deployment.run:
        config = prepare_resume_run(config)
    config = resolve_run_model(config)
    gpus = detect_visible_gpus()
    config, memory = resolve_with_memory(config, gpus)
    return choose_store_port(config), gpus, memory


def choose_store_port(config: RLConfig) -> RLConfig:
    """weights.master_port 0 (auto) made concrete: a port free right now on the trainer's node, written into every
    process's config. Only where this launch starts both the trainer (which opens the store) and the orchestrator
    (which tells inference where it is); a collective transport split across launches needs a fixed port."""
    w = config.weights
    if w.master_port != 0 or w.transport not in ("nccl", "gloo"):
        return config
    here = {"trainer", "orchestrator"} & set(config.deployment.run)
    if not here:  # inference alone: it learns the port from the orchestrator's init_info
        return config
    if len(here) == 1:
        raise ConfigError(
            f"weights.master_port = 0 (auto) needs the trainer and the orchestrator in one launch, but this node runs "
            f"{', '.join(config.deployment.run)}: set weights.master_port to a free TCP port on the trainer's node"
        )
    return config.rebuilt({"weights": {"master_port": free_port(w.master_addr)}})


def start_processes(sup: Supervisor, specs: dict[str, ProcessSpec], config: RLConfig, start: float) -> None:
    """Start this node's processes: inference and the trainer at once (the trainer loads its model while vLLM
    starts), the orchestrator once inference (here or on another node) answers /health. Colocated on a GPU, the
    trainer starts only then too: vLLM sizes its share from the memory free when it starts."""
    after_vllm = config.trainer.colocated and _on_gpu(config)
    for name in ("inference", "trainer"):
        if name in specs and not (name == "trainer" and after_vllm):
            sup.start(specs[name])
    if "orchestrator" not in specs and not after_vllm:
        return
    url = config.orchestrator.inference_url
    wait_healthy(sup, url, config.launch.health_timeout_s)
    _say(f"inference healthy after {time.monotonic() - start:.0f}s at {url}")
    if after_vllm and "trainer" in specs:
        sup.start(specs["trainer"])
    if "orchestrator" in specs:
        sup.start(specs["orchestrator"])


OOM_MARKERS = (
    "OutOfMemoryError",
    "CUDA out of memory",
    "less than desired GPU memory utilization",
    "No available memory",
)
"""Lines of a child's log that say it ran out of GPU memory (torch, vLLM at start-up, vLLM's KV-cache sizing)."""


def _out_of_memory(failure: ChildFailed) -> bool:
    try:
        with open(failure.log_path, "rb") as f:
            f.seek(failure.log_offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(marker in text for marker in OOM_MARKERS)


def _colocated_line(config: RLConfig) -> str:
    where = "on the GPU" if _on_gpu(config) else "on CPU"
    level = config.deployment.sleep_level
    share = config.inference.gpu_memory_utilization
    memory = f", vLLM's share of GPU memory {share}" if share is not None and _on_gpu(config) else ""
    return f"colocated {where}: vLLM and the trainer take turns (vLLM sleeps at level {level} during each step){memory}"


def _on_gpu(config: RLConfig) -> bool:
    return config.trainer.device == "cuda" and config.inference.device == "cuda"


def prepare_resume_run(config: RLConfig) -> RLConfig:
    """For --resume / --resume-step: pick the committed step, delete what the run wrote after it, and return the
    config with that step (or none: start over) given to trainer and orchestrator. A run started without them is
    checked and cleaned by prepare_fresh_run and returned as is."""
    if config.trainer.resume_step is None:
        prepare_fresh_run(config)
        return config
    field = "resume_step" if config.resume_step is not None else "resume"
    run = RunDir(config.output_dir)
    step = resolve_run_step(config.output_dir, config.trainer.resume_step, field)
    if step is not None and not is_ready(config.output_dir, step):
        raise FileNotFoundError(
            f"{run.weights_dir(step)} is missing or incomplete, so inference cannot be given the policy of step "
            f"{step}; resume from another committed step (--resume-step)"
        )
    removed = prepare_resume(config.output_dir, step or 0)
    # a run killed between a commit and the pruning after it would keep the extra checkpoint forever if no later
    # one is committed (a run resumed at its last step): apply the retention policy here too
    ckpt = config.checkpoint
    pruned = prune_checkpoints(
        config.output_dir, committed_run_steps(config.output_dir), ckpt.keep_last, ckpt.keep_every
    )
    removed += [f"checkpoints/step_{s} (beyond checkpoint.keep_last / keep_every)" for s in pruned]
    dropped = f"; removed {', '.join(removed)}" if removed else ""
    if step is None:
        _say(f"--resume: no committed checkpoint in {run.checkpoints_root}; starting at step 0{dropped}")
    else:
        _say(f"resuming {config.output_dir} after step {step}{dropped}")
    update = {"resume": step is not None, "resume_step": step}
    return config.model_copy(
        update={
            **update,
            "trainer": config.trainer.model_copy(update={"resume_step": step}),
            "orchestrator": config.orchestrator.model_copy(update={"resume_step": step}),
        }
    )


def prepare_fresh_run(config: RLConfig) -> None:
    """A run started without --resume: refuse a run directory holding committed checkpoints (a later --resume would
    mix the two runs), and delete the step data (rollouts, weights, metrics records) an earlier run left, which the
    trainer would otherwise take for this run's; only where this launch starts the orchestrator too, so that nothing
    of this run has been written yet."""
    committed = committed_run_steps(config.output_dir)
    if committed:
        raise ConfigError(
            f"{config.output_dir} holds committed checkpoints of an earlier run (steps {committed}): continue it with "
            f"--resume (or --resume-step N), or start afresh in another output_dir (or delete "
            f"{RunDir(config.output_dir).checkpoints_root})"
        )
    if "orchestrator" not in config.deployment.run:
        return
    removed = prepare_resume(config.output_dir, 0)
    if removed:
        shown = ", ".join(removed[:4]) + (f" and {len(removed) - 4} more" if len(removed) > 4 else "")
        _say(f"starting afresh in {config.output_dir}: removed what an earlier run left ({shown})")


def write_admin_token(output_dir: Path) -> None:
    """Create the run's admin token (children inherit it) and leave a copy, readable by this user only, for
    people who need to call the admin endpoints by hand."""
    token = ensure_admin_token()
    path = RunDir(output_dir).admin_token_path
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def wait_healthy(sup: Supervisor, url: str, timeout_s: float) -> None:
    """Poll GET {url}/health while watching the children; raise TimeoutError naming what was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sup.check()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    raise TimeoutError(
        f"inference server did not answer {url}/health within {timeout_s:.0f}s; "
        "see logs/inference.log, or raise launch.health_timeout_s"
    )


def watch_until_done(sup: Supervisor, config: RLConfig, names: set[str] | None = None) -> None:
    """Supervise until this node's trainer and orchestrator (of `names`, default both) have finished, restarting
    inference if it dies (up to launch.inference_restarts); print one progress line per step. A node that runs
    inference only serves until it is stopped."""
    finishers = {"trainer", "orchestrator"} & (names if names is not None else {"trainer", "orchestrator"})
    from slipstream.monitor.metrics import format_progress

    restarts = InferenceRestarts(config.launch, f"{config.inference.url}/health", _say)
    metrics_path = RunDir(config.output_dir).metrics_path
    offset = metrics_path.stat().st_size if metrics_path.exists() else 0  # a resumed run's earlier steps are not news

    def step(ignore: tuple[str, ...] = ()) -> list[str]:
        nonlocal offset
        finished = sup.check(ignore)
        offset = _print_new_metrics(metrics_path, offset, config.max_steps, format_progress)
        return finished

    while True:
        try:
            finished = step()
        except ChildFailed as e:
            if not restarts.handles(e):
                raise
            restarts.restart(sup, e, keep_watching=functools.partial(step, ignore=(e.name,)))
            continue
        restarts.poll_health()
        if finishers and finishers <= set(finished):
            return
        time.sleep(0.5)


def _print_new_metrics(path: Path, offset: int, max_steps: int, fmt) -> int:
    if not path.exists():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        for line in iter(f.readline, b""):
            if not line.endswith(b"\n"):
                break  # partial line: read it next time
            offset += len(line)
            record = json.loads(line)
            _say(fmt(record["step"], max_steps, record))
    return offset


def _write_plots(output_dir: Path) -> None:
    from slipstream.monitor.plots import write_plots

    paths = write_plots(output_dir)
    _say(f"plots: {', '.join(p.name for p in paths)} in {RunDir(output_dir).plots_dir}")


def _print_heldout(output_dir: Path) -> None:
    from slipstream.monitor.heldout import heldout_lines

    for line in heldout_lines(output_dir):
        print(line if line.startswith("heldout_reward:") else f"[slipstream] {line}", flush=True)


def _say(message: str, err: bool = False) -> None:
    print(f"[slipstream] {message}", file=sys.stderr if err else sys.stdout, flush=True)
