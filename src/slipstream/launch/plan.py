"""Pure planning: an RLConfig becomes the resolved per-process configs and the commands that run them."""

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.config.rl import RLConfig
from slipstream.utils.fs import commit_dir


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
    """Write the resolved config of the run and of each process into `output_dir/config/`, all or nothing: they
    are written into a temporary folder renamed into place, so a failed write leaves the previous ones (or none)."""
    paths = config_paths(config)
    folder = paths["rl"].parent
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".config."))
    try:
        tmp.chmod(0o755)
        for name, section in (
            ("rl", config),
            *((n, getattr(config, n)) for n in ("inference", "orchestrator", "trainer")),
        ):
            section.write_toml(tmp / paths[name].name)
        commit_dir(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
