"""`slipstream tenant-server`: start and supervise the shared half of multi-tenant LoRA on this machine, the vLLM
server (one adapter slot per tenant) and the multi-tenant trainer, until stopped or one of them dies. Tenants attach
with `slipstream tenant-run` (docs/multi_tenant_lora.md); they read the admin token from `<tenants_dir>/admin_token`."""

import sys
import time

from slipstream.config.tenants import TenantServerConfig
from slipstream.launch.local import run_locked, wait_healthy, write_admin_token
from slipstream.launch.plan import ProcessSpec
from slipstream.launch.supervisor import ChildFailed, StopRequested, Supervisor, supervising
from slipstream.rundir import RunDir, launcher_env

TRAINER = "tenant-trainer"


def run_tenant_server(config: TenantServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (exit 0) or until a process dies (exit 1); 2 if the folder is in use."""
    return run_locked(RunDir(config.tenants_dir), lambda run: _serve(config, run), _say)


def build_specs(config: TenantServerConfig, run: RunDir) -> list[ProcessSpec]:
    """Write both processes' configs into `<tenants_dir>/config/` and return how to start them."""
    cli, env = [sys.executable, "-m", "slipstream"], {"PYTHONUNBUFFERED": "1"}
    specs = []
    for name, command, section in (("inference", "inference", config.inference), (TRAINER, TRAINER, config.trainer)):
        path = run.config_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        section.write_toml(path)
        specs.append(ProcessSpec(name, [*cli, command, "-c", str(path)], run.log_path(name), env))
    return specs


def _serve(config: TenantServerConfig, run: RunDir) -> int:
    write_admin_token(run.root)
    with supervising(Supervisor(grace_s=config.shutdown_grace_s, env=launcher_env(run))) as sup:
        try:
            for spec in build_specs(config, run):
                sup.start(spec)
            wait_healthy(sup, config.inference.url, config.health_timeout_s)
            _say(f"serving tenants of {run.root} at {config.inference.url} (logs in {run.logs_dir}); Ctrl-C stops")
            while True:
                sup.check()
                time.sleep(0.5)
        except ChildFailed as e:
            for line in e.report():
                _say(line, err=True)
            return 1
        except TimeoutError as e:
            _say(f"error: {e}", err=True)
            return 1
        except StopRequested as e:
            _say(f"received {e}; stopping inference and the trainer")
            return 0


def _say(message: str, err: bool = False) -> None:
    print(f"[tenant-server] {message}", file=sys.stderr if err else sys.stdout, flush=True)
