"""`slipstream tenant-run`: join a multi-tenant LoRA trainer as one tenant and run that tenant's orchestrator
against the shared inference server (docs/multi_tenant_lora.md). The admin token of the inference server comes from
SLIPSTREAM_ADMIN_TOKEN, else from `<tenants_dir>/admin_token` (written by `slipstream tenant-server`)."""

import os
from pathlib import Path

from slipstream.config.tenants import TenantRunConfig
from slipstream.inference.admin_token import TOKEN_ENV
from slipstream.rundir import RunDir
from slipstream.transport.tenants import join_tenant


def run_tenant(config: TenantRunConfig) -> None:
    """Register the tenant (with `resume`: from its newest committed checkpoint), then orchestrate its steps."""
    from slipstream.orchestrator.loop import run_orchestrator

    use_server_token(config.tenants_dir)
    step = join_tenant(config.tenants_dir, config.tenant, resume=config.resume)
    name = config.tenant.name
    where = f"resuming after step {step}" if step else "from step 0"
    print(f"[tenant-run] tenant {name} joined {config.tenants_dir} ({where})", flush=True)
    run_orchestrator(config.orchestrator.model_copy(update={"resume_step": step}))


def use_server_token(tenants_dir: Path) -> None:
    """Take the tenant-server's admin token unless one is set in the environment."""
    path = RunDir(tenants_dir).admin_token_path
    if not os.environ.get(TOKEN_ENV) and path.is_file():
        os.environ[TOKEN_ENV] = path.read_text().strip()
