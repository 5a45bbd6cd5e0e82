"""Step metrics: one JSON line per step in `output_dir/metrics.jsonl`, and a one-line console summary."""

import json
import math
import time
from pathlib import Path
from typing import Any

from slipstream.rundir import RunDir
from slipstream.utils.fs import append_line

REWARD_MEAN_KEY = "reward/mean"
"""Orchestrator metric shown as the reward in the progress line (with REWARD_STD_KEY)."""
REWARD_STD_KEY = "reward/std"


class MetricsWriter:
    """Appends `{"step", "time", **metrics}` as one JSON line per step (a single atomic append)."""

    def __init__(self, output_dir: Path) -> None:
        self.path = RunDir(output_dir).metrics_path

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Append the record and return it. Keys `step` and `time` are reserved."""
        reserved = {"step", "time"} & metrics.keys()
        if reserved:
            raise ValueError(f"metric names {sorted(reserved)} are reserved by MetricsWriter; rename them")
        record = {"step": step, "time": time.time(), **metrics}
        append_line(self.path, json.dumps(record))
        return record


def merge_metrics(orchestrator: dict[str, Any], trainer: dict[str, Any]) -> dict[str, Any]:
    """One step's record: the orchestrator's metrics (from the batch) and the trainer's; names must not clash."""
    clash = orchestrator.keys() & trainer.keys()
    if clash:
        raise ValueError(
            f"orchestrator metrics {sorted(clash)} clash with trainer metrics of the same name; rename them"
        )
    return {**orchestrator, **trainer}


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    """All records written so far (empty if none)."""
    path = RunDir(output_dir).metrics_path
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_progress(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    """E.g. `step 3/10 | reward 0.412 ± 0.11 | loss -0.0123 | kl 1.2e-04 | grad 0.53 | 812 tok/s | 4.1s`.
    Parts whose metrics are missing or None are left out."""
    parts = [f"step {step}/{max_steps}"]
    reward, reward_std = metrics.get(REWARD_MEAN_KEY), metrics.get(REWARD_STD_KEY)
    if reward is not None:
        parts.append(f"reward {reward:.3f}" + (f" ± {reward_std:.2f}" if reward_std is not None else ""))
    for key, label, fmt in (
        ("loss", "loss", "{:.4g}"),
        ("mismatch_kl", "kl", "{:.1e}"),
        ("grad_norm", "grad", "{:.2f}"),
        ("tokens_per_s", "", "{:.0f} tok/s"),
        ("timing/step_s", "", "{:.1f}s"),
    ):
        value = metrics.get(key)
        if value is not None:
            text = fmt.format(value) if math.isfinite(value) else str(value)
            parts.append(f"{label} {text}" if label else text)
    return " | ".join(parts)
