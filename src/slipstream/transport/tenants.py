"""The filesystem protocol between a multi-tenant LoRA trainer and its tenants (torch-free).

A tenant's run directory is `<tenants_dir>/<name>/`. It joins by writing `config/tenant.toml` (its TenantConfig);
it leaves by deleting it. The trainer reports each tenant's state in `tenant_status.json` (`waiting`, `training`,
`done`, `failed` with the error, `left`). Rewriting tenant.toml (a newer file) is a rejoin: the trainer drops what it
holds of that tenant and starts it again from its config (from scratch, or from `resume_step`'s checkpoint).
"""

import json
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from slipstream.config.tenants import TenantConfig
from slipstream.rundir import RunDir
from slipstream.transport.checkpoints import prepare_resume, resolve_run_step
from slipstream.utils.fs import atomic_write_text

TENANT_CONFIG = "tenant"
"""`config/tenant.toml` (RunDir.config_path name)."""
STATUS_FILE = "tenant_status.json"
STATES = ("waiting", "training", "done", "failed", "left")
RESERVED_NAMES = ("config", "logs")
"""Folders of `slipstream tenant-server` in tenants_dir: no tenant may be called so."""


def tenant_config_path(run_dir: Path) -> Path:
    return RunDir(run_dir).config_path(TENANT_CONFIG)


def status_path(run_dir: Path) -> Path:
    return Path(run_dir) / STATUS_FILE


@dataclass(frozen=True)
class Registration:
    """A tenant.toml found in tenants_dir."""

    run_dir: Path
    stamp: int
    """The file's mtime_ns: a newer one is a rejoin."""


def scan_registrations(tenants_dir: Path) -> dict[str, Registration]:
    """Tenant name -> its registration, for every run directory under `tenants_dir` holding a tenant.toml."""
    found = {}
    root = Path(tenants_dir)
    if not root.is_dir():
        return found
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            found[run_dir.name] = Registration(run_dir, tenant_config_path(run_dir).stat().st_mtime_ns)
        except FileNotFoundError:
            continue
    return found


def read_tenant_config(run_dir: Path) -> TenantConfig:
    """The registered TenantConfig (its name must be the run directory's)."""
    path = tenant_config_path(run_dir)
    config = TenantConfig.model_validate(tomllib.loads(path.read_text()))
    if config.name != Path(run_dir).name:
        raise ValueError(f"{path} names tenant {config.name!r} but lies in {run_dir}; name and folder must agree")
    return config


def write_status(run_dir: Path, state: str, step: int, error: str | None = None) -> None:
    assert state in STATES, state
    record = {"state": state, "step": step, "time": time.time(), "error": error}
    atomic_write_text(status_path(run_dir), json.dumps(record) + "\n")


def read_status(run_dir: Path) -> dict | None:
    try:
        return json.loads(status_path(run_dir).read_text())
    except FileNotFoundError:
        return None


def leave_tenant(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Withdraw the tenant and wait until the trainer no longer trains it (it may be mid-step)."""
    tenant_config_path(run_dir).unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    while (status := read_status(run_dir)) is not None and status["state"] in ("training", "waiting"):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{status_path(run_dir)} still says {status['state']!r} {timeout_s:.0f}s after the tenant left: is the "
                "multi-tenant trainer running (slipstream tenant-trainer)?"
            )
        time.sleep(0.05)


def join_tenant(tenants_dir: Path, tenant: TenantConfig, resume: bool = False) -> int | None:
    """Register `tenant` with the trainer watching `tenants_dir`; returns the step it resumes from (None: from
    scratch). With `resume`, a previous registration is withdrawn first, the run directory is set back to its newest
    committed checkpoint (later rollouts, weights and checkpoints deleted, as `slipstream rl --resume`) and the tenant
    rejoins from there; its orchestrator must then resume from the same step."""
    if tenant.name in RESERVED_NAMES:
        raise ValueError(f"tenant name {tenant.name!r} is the name of a folder of the server; pick another name")
    run_dir = Path(tenants_dir) / tenant.name
    step = None
    if resume:
        leave_tenant(run_dir)
        step = resolve_run_step(run_dir, "latest", "resume")
        prepare_resume(run_dir, step or 0)
    elif tenant_config_path(run_dir).exists():
        raise FileExistsError(f"tenant {tenant.name!r} is already registered ({tenant_config_path(run_dir)})")
    run_dir.mkdir(parents=True, exist_ok=True)
    tenant.model_copy(update={"resume_step": step}).write_toml(tenant_config_path(run_dir))
    return step
