"""Where a run's metrics go besides metrics.jsonl: Weights & Biases and Prometheus (set once at the top level under
`slipstream rl`: `[monitor]`)."""

from pathlib import Path
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig


class WandbConfig(BaseConfig):
    """A Weights & Biases run of the trainer's step records (they hold the orchestrator's metrics of the step too,
    so one run shows both). Needs the `wandb` package (`pip install 'slipstream[wandb]'`)."""

    project: str = "slipstream"
    entity: str | None = None
    """Team or user; None: wandb's default for the logged-in user."""
    name: str | None = None
    """Run name; None: the run directory's name."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """offline: written under `dir` only (no network; `wandb sync` uploads it later)."""
    dir: Path | None = None
    """Where wandb writes its files; None: `<output_dir>/wandb`."""
    tags: list[str] = []


class MonitorConfig(BaseConfig):
    """Monitoring outside the run directory."""

    wandb: WandbConfig | None = None
    """Log every step to Weights & Biases (None: off). A resumed run continues the same wandb run (its id is kept
    in `<output_dir>/wandb/run_id`)."""

    prometheus_port: int | None = Field(None, ge=1, le=65534)
    """Serve Prometheus metrics over HTTP (`/metrics`, None: off): the trainer (rank 0) on this port, the
    orchestrator on the next one. Each step's numeric metrics become gauges named `slipstream_<name>` ("/" and other
    characters become "_"), plus `slipstream_step`."""

    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoints bind to (loopback unless a scraper on another host needs them)."""
