"""A trainer spanning several nodes (launch.trainer_nodes > 1): torchrun on every trainer node with a static
rendezvous at trainer node 0. Node 0's `slipstream rl` owns the run (its lock, resume, the per-process configs, the
orchestrator); after writing the configs it publishes this launch's id (SLIPSTREAM_LAUNCH_ID, the same on every
node: a Slurm job passes its job id). Every other trainer node waits for that id, then starts its ranks on node 0's
trainer config (so every rank trains with the same settings, resume step included), with its own model folder and
GPUs, and supervises them until they end."""

import logging
import os
import sys
import time

from slipstream.config.base import ConfigError
from slipstream.config.rl import RLConfig
from slipstream.launch.models import resolve_run_model
from slipstream.launch.placement import detect_visible_gpus
from slipstream.launch.plan import build_plan, resolve_config
from slipstream.launch.supervisor import ChildFailed, StopRequested, Supervisor, supervising
from slipstream.rundir import RunDir, launcher_env
from slipstream.utils.fs import atomic_write_text

log = logging.getLogger(__name__)

LAUNCH_ID_ENV = "SLIPSTREAM_LAUNCH_ID"
LAUNCH_ID_FILE = "launch_id"
"""In the run directory: the id of the launch whose configs config/ holds (written by trainer node 0)."""


def launch_id(config: RLConfig) -> str:
    """This launch's id from the environment; a ConfigError saying how to set it when the trainer spans nodes."""
    value = os.environ.get(LAUNCH_ID_ENV, "").strip()
    if not value:
        raise ConfigError(
            f"launch.trainer_nodes = {config.launch.trainer_nodes}: set {LAUNCH_ID_ENV} to one value per launch, the "
            "same on every trainer node (a Slurm job's node script sets it to the job id), so that the other trainer "
            "nodes start on the configs node 0 writes for this launch"
        )
    return value


def publish_launch(config: RLConfig) -> None:
    """On trainer node 0 of a multi-node trainer, once the configs are written: tell the other nodes."""
    if config.launch.trainer_nodes > 1 and "trainer" in config.deployment.run:
        atomic_write_text(RunDir(config.output_dir).root / LAUNCH_ID_FILE, launch_id(config) + "\n")


def wait_for_launch(run: RunDir, ident: str, timeout_s: float) -> None:
    """Wait until trainer node 0 has written the configs of launch `ident`; TimeoutError naming what is missing."""
    path = run.root / LAUNCH_ID_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip() == ident:
            return
        time.sleep(0.5)
    raise TimeoutError(
        f"trainer node 0 did not write the configs of launch {ident} ({path}) within {timeout_s:.0f}s "
        "(launch.health_timeout_s): see its log; every trainer node needs the same run directory and "
        f"{LAUNCH_ID_ENV}"
    )


def run_secondary_trainer(config: RLConfig) -> int:
    """`slipstream rl` on trainer node r > 0: start this node's trainer ranks once node 0 has written this launch's
    configs, supervise them; the exit code is theirs (0: all steps done), 2 for a config that cannot run."""
    run, rank = RunDir(config.output_dir), config.launch.trainer_node_rank
    try:
        ident = launch_id(config)
        config = resolve_run_model(config)
        gpus = detect_visible_gpus()
        config = resolve_config(config, gpus)
        _say(f"trainer node {rank}: waiting for trainer node 0 to write the configs of launch {ident}")
        wait_for_launch(run, ident, config.launch.health_timeout_s)
    except (FileNotFoundError, ValueError, TimeoutError) as e:  # ConfigError is a ValueError
        for line in str(e).splitlines():
            _say(f"error: {line}", err=True)
        return 2
    (spec,) = build_plan(config, gpus=gpus)
    own_model = str(config.model.path or config.model.name)
    spec.argv.extend(["--model.path", own_model])  # node 0's trainer config, this node's copy of the model
    with supervising(Supervisor(grace_s=config.launch.shutdown_grace_s, env=launcher_env(run))) as sup:
        try:
            _say(f"trainer node {rank} of {config.launch.trainer_nodes}: starting its ranks (log {spec.log_path})")
            sup.start(spec)
            while "trainer" not in sup.check():
                time.sleep(0.5)
            _say(f"trainer node {rank}: done")
            return 0
        except ChildFailed as e:
            for line in e.report():
                _say(line, err=True)
            return 1
        except StopRequested as e:
            _say(f"received {e}; stopping the trainer's ranks", err=True)
            return 130


def _say(message: str, err: bool = False) -> None:
    print(f"[slipstream] {message}", file=sys.stderr if err else sys.stdout, flush=True)
