"""`slipstream rl` on one machine: write configs, start inference/trainer/orchestrator, supervise, stop cleanly."""

import functools
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from slipstream.config.rl import RLConfig
from slipstream.inference.admin_token import ensure_admin_token
from slipstream.launch.plan import build_plan, write_configs
from slipstream.launch.restarts import InferenceRestarts
from slipstream.launch.supervisor import ChildFailed, Supervisor, first_error, tail
from slipstream.transport.checkpoints import prepare_resume, resolve_run_step
from slipstream.transport.weights import is_ready, weights_dir


class _Stop(Exception):
    """SIGINT/SIGTERM received."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def run_rl(config: RLConfig) -> int:
    """Run the whole RL job; return the exit code (0 = all steps done)."""
    config.output_dir.mkdir(parents=True, exist_ok=True)
    try:
        config = prepare_resume_run(config)
    except (FileNotFoundError, ValueError) as e:
        _say(f"error: {e}", err=True)
        return 2
    write_configs(config)
    write_admin_token(config.output_dir)
    specs = {spec.name: spec for spec in build_plan(config)}
    sup = Supervisor(grace_s=config.launch.shutdown_grace_s)
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    try:
        _say(f"run directory {config.output_dir} (logs in {config.output_dir / 'logs'})")
        sup.start(specs["inference"])
        sup.start(specs["trainer"])
        wait_healthy(sup, config.inference.url, config.launch.health_timeout_s)
        _say(f"inference healthy after {time.monotonic() - start:.0f}s at {config.inference.url}")
        sup.start(specs["orchestrator"])
        watch_until_done(sup, config)
        _say(f"done: {config.max_steps} steps in {time.monotonic() - start:.0f}s; metrics in {config.output_dir}")
        _write_plots(config.output_dir)
        _print_heldout(config.output_dir)
        return 0
    except ChildFailed as e:
        _say(f"error: {e}; last lines of its log:\n{tail(e.log_path)}", err=True)
        if (cause := first_error(e.log_path)) is not None:
            _say(f"first error in {e.log_path.name}: {cause}", err=True)
        return 1
    except TimeoutError as e:
        _say(f"error: {e}", err=True)
        return 1
    except _Stop as e:
        _say(f"received {e}; stopping all processes", err=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the clean stop
        sup.stop_all()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def prepare_resume_run(config: RLConfig) -> RLConfig:
    """For --resume / --resume-step: pick the committed step, delete what the run wrote after it, and return the
    config with that step (or none: start over) given to trainer and orchestrator. Other configs are returned as is."""
    if config.trainer.resume_step is None:
        return config
    field = "resume_step" if config.resume_step is not None else "resume"
    step = resolve_run_step(config.output_dir, config.trainer.resume_step, field)
    if step is not None and not is_ready(config.output_dir, step):
        raise FileNotFoundError(
            f"{weights_dir(config.output_dir, step)} is missing or incomplete, so inference cannot be given the policy "
            f"of step {step}; resume from another committed step (--resume-step)"
        )
    removed = prepare_resume(config.output_dir, step or 0)
    dropped = f"; removed {', '.join(removed)}" if removed else ""
    if step is None:
        _say(f"--resume: no committed checkpoint in {config.output_dir / 'checkpoints'}; starting at step 0{dropped}")
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


def write_admin_token(output_dir: Path) -> None:
    """Create the run's admin token (children inherit it) and leave a copy, readable by this user only, for
    people who need to call the admin endpoints by hand."""
    token = ensure_admin_token()
    path = output_dir / "admin_token"
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


def watch_until_done(sup: Supervisor, config: RLConfig) -> None:
    """Supervise until trainer and orchestrator have both finished, restarting inference if it dies (up to
    launch.inference_restarts); print one progress line per step."""
    from slipstream.monitor.metrics import format_progress

    restarts = InferenceRestarts(config.launch, f"{config.inference.url}/health", _say)
    metrics_path = config.output_dir / "metrics.jsonl"
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
        if {"trainer", "orchestrator"} <= set(finished):
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
    _say(f"plots: {', '.join(p.name for p in paths)} in {output_dir / 'plots'}")


def _print_heldout(output_dir: Path) -> None:
    from slipstream.monitor.heldout import heldout_lines

    for line in heldout_lines(output_dir):
        print(line if line.startswith("heldout_reward:") else f"[slipstream] {line}", flush=True)


def _say(message: str, err: bool = False) -> None:
    print(f"[slipstream] {message}", file=sys.stderr if err else sys.stdout, flush=True)
