"""One Weights & Biases run per Slipstream run: the trainer logs each step's record (orchestrator metrics
included); a resumed run continues it (its id is kept in the run directory)."""

import secrets
from pathlib import Path
from typing import Any

from slipstream.config.monitor import WandbConfig
from slipstream.utils.fs import atomic_write_text


class WandbRun:
    def __init__(self, config: WandbConfig, output_dir: Path, run_config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "monitor.wandb is set but the wandb package is not installed: pip install 'slipstream[wandb]' "
                "(or remove [monitor.wandb])"
            ) from e
        folder = Path(config.dir) if config.dir is not None else Path(output_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        if id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)
            atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or Path(output_dir).resolve().name,
            mode=config.mode,
            dir=str(folder),
            id=run_id,
            resume="allow",
            tags=list(config.tags),
            config=run_config,
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=step)

    def finish(self) -> None:
        self.run.finish()
