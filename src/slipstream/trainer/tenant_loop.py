"""`slipstream tenant-trainer`: one process trains the LoRA adapters of K runs (tenants) on one frozen base model.

Each pass scans the tenants' registrations (joins, rejoins, leaves: transport/tenants.py), then trains every active
tenant whose next batch is there, one step each, in name order (round robin: a busy tenant cannot starve another).
Anything a tenant's step raises (a malformed batch, NaN steps in a row, a failed write) fails that tenant alone: it is
marked `failed` with the error and dropped; the others go on. A tenant whose batch does not come within its
`batch_timeout_s` (its orchestrator was killed) is failed the same way; it can rejoin and resume.
"""

import logging
import time
from pathlib import Path

from slipstream.config.tenants import TenantTrainerConfig
from slipstream.config.trainer import TrainerConfig
from slipstream.monitor.logs import setup_logging
from slipstream.trainer.data import validate_batch
from slipstream.trainer.setup import Trainer, setup_trainer, teardown_trainer
from slipstream.trainer.tenants import TenantRun, build_tenant, train_tenant_step
from slipstream.transport.rollouts import TrainingBatch, batch_path, read_batch
from slipstream.transport.tenants import read_tenant_config, scan_registrations, write_status

log = logging.getLogger(__name__)


def run_tenant_trainer(config: TenantTrainerConfig) -> None:
    """Serve tenants until killed (or idle for `exit_when_idle_s`)."""
    setup_logging("tenant-trainer")
    trainer = setup_trainer(shared_trainer_config(config))
    tenants = Tenants(trainer, config)
    try:
        idle_since = time.monotonic()
        while True:
            tenants.scan()
            trained = tenants.train_ready()
            if tenants.active or tenants.waiting:
                idle_since = time.monotonic()
            elif config.exit_when_idle_s is not None and time.monotonic() - idle_since > config.exit_when_idle_s:
                log.info(f"no tenant for {config.exit_when_idle_s:.0f}s; exiting")
                return
            if not trained:
                time.sleep(config.poll_s)
    finally:
        for run in tenants.active.values():
            run.publisher.close()
        teardown_trainer(trainer)


def shared_trainer_config(config: TenantTrainerConfig) -> TrainerConfig:
    """What setup_trainer builds the shared base model (with adapter slots) from; tenants bring the rest."""
    return TrainerConfig(
        model=config.model,
        model_impl=config.model_impl,
        output_dir=config.tenants_dir,
        max_steps=1,
        seed=config.seed,
        probe=config.probe,
        device=config.device,
        num_threads=config.num_threads,
    )


class Tenants:
    """The tenants of one trainer: active (training), waiting for a slot, and the registrations already handled
    (so a finished or failed tenant is not started again until it rejoins with a newer tenant.toml)."""

    def __init__(self, trainer: Trainer, config: TenantTrainerConfig) -> None:
        self.trainer, self.config = trainer, config
        self.active: dict[str, TenantRun] = {}
        self.waiting: list[str] = []
        self.handled: dict[str, int] = {}
        """Name -> stamp of the registration last started, finished or failed."""

    def scan(self) -> None:
        """Drop tenants that left or rejoined; start new registrations while slots are free."""
        found = scan_registrations(self.config.tenants_dir)
        for name, run in list(self.active.items()):
            reg = found.get(name)
            if reg is None or reg.stamp != run.joined_stamp:
                self._drop(run, "left", None)
        waiting, self.waiting = self.waiting, []
        for name, reg in found.items():
            if name in self.active or self.handled.get(name) == reg.stamp:
                continue
            if len(self.active) >= self.config.max_tenants:
                self.waiting.append(name)
                if name not in waiting:
                    write_status(reg.run_dir, "waiting", 0)
                continue
            self.handled[name] = reg.stamp
            try:
                tenant = read_tenant_config(reg.run_dir)
                run = build_tenant(self.trainer, self.config, tenant, reg.stamp)
            except Exception as e:  # a bad registration fails that tenant, not the trainer
                write_status(reg.run_dir, "failed", 0, _describe(e))
                log.error(f"tenant {name} could not join: {_describe(e)}")
                continue
            self.active[name] = run
            write_status(reg.run_dir, "training", run.step)
            log.info(f"tenant {name} joined at step {run.step} of {tenant.max_steps}")
            if run.done:  # resumed from its last step's checkpoint: nothing left to train
                self._drop(run, "done", None)

    def train_ready(self) -> int:
        """One step of every active tenant whose batch is there (name order); returns how many ran or failed."""
        return sum(self.maybe_train(run) for run in list(self.active.values()))

    def maybe_train(self, run: TenantRun) -> bool:
        """Train `run`'s next step if its batch is there; returns whether a step ran (or failed)."""
        step = run.step + 1
        try:
            batch = poll_batch(run.config.output_dir, step)
            if batch is None:
                waited = time.monotonic() - run.last_progress
                if waited > run.tenant.batch_timeout_s:
                    raise TimeoutError(
                        f"no batch of step {step} for {waited:.0f}s (tenant batch_timeout_s); is its orchestrator "
                        "running?"
                    )
                return False
            record = train_tenant_step(run, batch)
        except Exception as e:
            self._drop(run, "failed", _describe(e))
            log.exception(f"tenant {run.name} step {step} raised")
            return True
        log.info(f"{run.name} step {step}/{run.tenant.max_steps} loss {record['loss']:.4g}")
        if run.done:
            self._drop(run, "done", None)
        else:
            write_status(run.config.output_dir, "training", run.step)
        return True

    def _drop(self, run: TenantRun, state: str, error: str | None) -> None:
        del self.active[run.name]
        self.handled[run.name] = run.joined_stamp
        run.publisher.close()
        write_status(run.config.output_dir, state, run.step, error)
        note = f": {error}" if error else ""
        (log.info if state == "done" else log.warning)(f"tenant {run.name} {state} at step {run.step}{note}")


def poll_batch(run_dir: Path, step: int) -> TrainingBatch | None:
    """The tenant's batch of `step` if it has been written (one data rank), checked; None if not yet."""
    path = batch_path(run_dir, step, 0)
    if not path.exists():
        return None
    batch = read_batch(path)
    validate_batch(batch, step, 0, 1)
    return batch


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
