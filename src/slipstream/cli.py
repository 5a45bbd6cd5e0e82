"""`slipstream <command>`: parse the config, import the process lazily, run it. `slipstream --help` is instant."""

import errno
import os
import sys
import textwrap

# out of space / quota, read-only, forbidden, or a path through a file: the user must fix the output directory
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST}

OVERRIDES_HELP = """Configs: -c/--config FILE.toml (repeatable, later files win), then dotted overrides such as
--trainer.optim.lr 1e-5. A value is read as TOML (3, 1e-5, true, "text", [1, 2], {a = 1}; JSON objects and
arrays too); a text field takes it as typed (--slurm.time_limit 12:00:00, --model.revision 1234567).
Tables merge key by key, but a table given whole replaces the one from the files:
--orchestrator.env.args '{}' clears it, --orchestrator.env.args.num_tasks 8 sets one key."""
"""How config files and overrides combine: in `slipstream --help` and every config command's `--help`."""

USAGE = f"""usage: slipstream <command> [-c FILE.toml]... [--section.key VALUE]...
       slipstream --version | doctor [--slurm]

Asynchronous reinforcement learning for LLMs.

commands:
  rl            run inference + orchestrator + trainer together (the usual entry point; with [slurm]:
                submit them as a Slurm job, --dry-run to only write its script)
  inference     run the vLLM inference server with Slipstream's weight-loading extension
  orchestrator  run the orchestrator (rollouts, rewards, batches)
  trainer       run the trainer (launch it under torchrun for several ranks)
  tenant-server multi-tenant LoRA: start vLLM + one trainer serving many LoRA runs (docs/multi_tenant_lora.md)
  tenant-run    join a tenant-server as one LoRA run (tenant) and run its orchestrator
  tenant-trainer the tenant-server's trainer alone
  sft           supervised fine-tuning on chat data (JSONL/Parquet); writes a model folder for `model.name`;
                on several GPUs it starts itself under torchrun, one rank per GPU
  eval          score a model folder or a run's step on an environment split (mean reward, pass@k)
  plot RUN_DIR  write PNG plots of a run into RUN_DIR/plots/
  model         model utilities: `model import NAME|FILE.gguf`, `model tiny --family F --out DIR`
  env           `env init NAME`: write an installable environment package (docs/environments.md)
  k8s           `k8s render -c rl.toml --out DIR`: write Kubernetes manifests of the run (docs/kubernetes.md)
  plan          `plan -c rl.toml --nodes N --gpu h200 --workload FILE`: split GPUs between inference and trainer
                (simulated); `plan --colocate -c rl.toml --gpu h200`: does the model fit on one shared GPU
  doctor        check this machine for a run, one line per check with the fix: Python, torch + GPUs, NCCL,
                vLLM against the supported range, the sandbox (bubblewrap), free disk, default ports;
                --slurm: sbatch too; --output-dir DIR: the disk to check. Exits 1 if a check FAILs

{OVERRIDES_HELP}
`slipstream <command> --help` lists every option with its default.
"""

CONFIG_COMMANDS = {
    "rl": ("slipstream.config.rl", "RLConfig", "slipstream.launch.local", "run_rl"),
    "inference": ("slipstream.config.inference", "InferenceConfig", "slipstream.inference.server", "run_inference"),
    "orchestrator": (
        "slipstream.config.orchestrator",
        "OrchestratorConfig",
        "slipstream.orchestrator.loop",
        "run_orchestrator",
    ),
    "trainer": ("slipstream.config.trainer", "TrainerConfig", "slipstream.trainer.rl", "run_trainer"),
    "sft": ("slipstream.config.sft", "SFTConfig", "slipstream.launch.sft", "run_sft_command"),
    "tenant-trainer": (
        "slipstream.config.tenants",
        "TenantTrainerConfig",
        "slipstream.trainer.tenant_loop",
        "run_tenant_trainer",
    ),
    "tenant-server": (
        "slipstream.config.tenants",
        "TenantServerConfig",
        "slipstream.launch.tenant_server",
        "run_tenant_server",
    ),
    "tenant-run": ("slipstream.config.tenants", "TenantRunConfig", "slipstream.launch.tenant_run", "run_tenant"),
    "eval": ("slipstream.config.eval", "EvalConfig", "slipstream.eval.run", "eval_command"),
}


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:
        # the reader of our output went away (`slipstream rl --help | head`): stop quietly, as other CLIs do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from slipstream.version import package_version

        print(f"slipstream {package_version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from slipstream.doctor import main as doctor_main

        return doctor_main(rest)
    if command == "model":
        from slipstream.models.cli import main as model_main

        return model_main(rest)
    if command == "plot":
        from slipstream.monitor.plots import main as plot_main

        return plot_main(rest)
    if command == "env":
        from slipstream.envs.scaffold import main as env_main

        return env_main(rest)
    if command == "k8s":
        from slipstream.deploy.cli import main as k8s_main

        return k8s_main(rest)
    if command == "plan":
        from slipstream.planner.cli import main as plan_main

        return plan_main(rest)
    if command not in CONFIG_COMMANDS:
        print(f"error: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return _run_config_command(command, rest)


SLURM_SUBMITTERS = {
    "rl": ("slipstream.launch.slurm", "submit_rl"),
    "sft": ("slipstream.launch.slurm_sft", "submit_sft"),
}
"""Commands whose config takes [slurm]: the function that submits it."""


def _run_config_command(command: str, rest: list[str]) -> int:
    import importlib

    from slipstream.config.base import ConfigError
    from slipstream.config.loader import help_rows, load_config
    from slipstream.launch.watchdog import start_from_env

    start_from_env()  # a child of `slipstream rl` ends itself when its launcher is gone
    config_module, config_name, run_module, run_name = CONFIG_COMMANDS[command]
    config_cls = getattr(importlib.import_module(config_module), config_name)
    if "-h" in rest or "--help" in rest:
        skip = getattr(importlib.import_module(config_module), "HELP_SKIP", ())
        _print_help(command, config_cls, help_rows(config_cls, skip))
        return 0
    try:
        config = load_config(config_cls, rest)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    if getattr(config, "slurm", None) is not None:  # [slurm]: submit the run instead
        run_module, run_name = SLURM_SUBMITTERS[command]
    run = getattr(importlib.import_module(run_module), run_name)
    try:
        result = run(config)
    except OSError as e:
        if e.errno not in _STORAGE_ERRNOS:
            raise
        where = f" {e.filename}" if e.filename else ""
        print(
            f"error: cannot write{where}: {e.strerror}; free space, or fix the output directory's path or permissions "
            "(completed steps and committed checkpoints are intact: writes are atomic)",
            file=sys.stderr,
        )
        return 1
    rc = int(result or 0)
    if command in _RANK_COMMANDS and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _leave_rank(rc)
    return rc


_RANK_COMMANDS = {"trainer", "sft", "tenant-trainer"}
"""Commands torchrun starts once per rank (WORLD_SIZE > 1): they end through `_leave_rank`."""


def _leave_rank(rc: int) -> None:
    """End a torchrun rank whose work is done (every rank met in teardown_trainer's barrier and the process group is
    destroyed) without the interpreter's shutdown. FSDP keeps the gloo group alive past destroy_process_group, and its
    worker thread letting go of the last collective's tensors takes the GIL; if the interpreter is shutting down by
    then, the rank aborts ("terminate called without an active exception", SIGABRT) and torchrun reports a failed run
    whose work had succeeded (tests/distributed/gloo_exit_race.py forces the ordering). Logs and output are flushed
    first; errors never come here (they propagate, and the process fails as usual)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _print_help(command: str, config_cls: type, rows: list[tuple[str, str, str]]) -> None:
    print(f"usage: slipstream {command} [-c FILE.toml]... [--key VALUE]...\n")
    print(textwrap.fill(" ".join((config_cls.__doc__ or "").split()), 100), "\n")
    print(OVERRIDES_HELP, "\n\noptions:")
    for option, type_default, doc in rows:
        print(f"  {option}  ({type_default})")
        if doc:
            print(textwrap.indent(textwrap.fill(doc, 96), "      "))


if __name__ == "__main__":
    sys.exit(main())
