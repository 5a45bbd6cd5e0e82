"""Pure planning: an RLConfig becomes the resolved per-process configs and the commands that run them."""

import sys
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.config.rl import RLConfig


@dataclass(frozen=True)
class ProcessSpec:
    """One child process of a run."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    """Variables added to the launcher's environment."""
    must_run_to_end: bool = True
    """True if the run fails when this process exits (inference); False if exit 0 means it finished its work."""


def config_paths(config: RLConfig) -> dict[str, Path]:
    root = config.output_dir / "config"
    return {name: root / f"{name}.toml" for name in ("rl", "inference", "orchestrator", "trainer")}


def write_configs(config: RLConfig) -> dict[str, Path]:
    """Write the resolved config of the run and of each process into `output_dir/config/`."""
    paths = config_paths(config)
    config.write_toml(paths["rl"])
    config.inference.write_toml(paths["inference"])
    config.orchestrator.write_toml(paths["orchestrator"])
    config.trainer.write_toml(paths["trainer"])
    return paths


def build_plan(config: RLConfig, python: str = sys.executable) -> list[ProcessSpec]:
    """Processes in start order: inference, trainer (loads its model while vLLM starts), orchestrator."""
    paths, logs = config_paths(config), config.output_dir / "logs"
    cli = [python, "-m", "slipstream"]
    torchrun = [
        python, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(config.launch.num_trainer_procs),
        "-m", "slipstream",
    ]  # fmt: skip
    env = {"PYTHONUNBUFFERED": "1"}
    return [
        ProcessSpec("inference", [*cli, "inference", "-c", str(paths["inference"])], logs / "inference.log", env),
        ProcessSpec("trainer", [*torchrun, "trainer", "-c", str(paths["trainer"])], logs / "trainer.log", env, False),
        ProcessSpec(
            "orchestrator",
            [*cli, "orchestrator", "-c", str(paths["orchestrator"])],
            logs / "orchestrator.log",
            env,
            False,
        ),
    ]
