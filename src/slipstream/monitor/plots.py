"""PNG plots of a run (`slipstream plot RUN_DIR`): reward, held-out reward, mismatch KL, step time, loss, grad norm
and weight-sync error, from metrics.jsonl, weight_checks.jsonl, online evaluations (`eval/online.jsonl`) and
`slipstream eval` results in `eval/step_N.json`.
"""

import argparse
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import METRICS_FILE, RunDir
from slipstream.utils.fs import atomic_write_bytes


@dataclass
class Series:
    """One line (or set of markers) of a panel."""

    label: str
    steps: list[float]
    values: list[float]
    spread: list[float] | None = None
    """Half-width of a shaded band around the line (e.g. the reward std), or of error bars for markers."""
    markers: bool = False
    """Draw markers with error bars instead of a line (sparse points such as evaluations)."""
    color: str | None = None
    """Fixed matplotlib color, so a series looks the same in every panel (None: the axes' next color)."""


@dataclass
class Panel:
    """One plot: written as `plots/<name>.png` and as one cell of `plots/overview.png`."""

    name: str
    title: str
    ylabel: str
    series: list[Series]
    log_y: bool = False


def metric_series(records: list[dict[str, Any]], key: str, label: str, spread_key: str | None = None) -> Series:
    """The finite values of `key` by step (records without it, or with None/NaN, are skipped)."""
    steps, values, spread = [], [], []
    for record in records:
        value = record.get(key)
        if not _finite(value):
            continue
        steps.append(record["step"])
        values.append(float(value))
        extra = record.get(spread_key) if spread_key else None
        spread.append(float(extra) if _finite(extra) else 0.0)
    return Series(label, steps, values, spread if spread_key else None)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_eval_results(output_dir: Path) -> list[dict[str, Any]]:
    """`slipstream eval` results of the run's steps (`eval/step_N.json`), by step."""
    results = []
    for path in sorted(RunDir(output_dir).eval_dir.glob("step_*.json")):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(result.get("step"), int) or not _finite(result.get("reward_mean")):
            raise ValueError(f"{path} has no integer `step` and numeric `reward_mean`; is it a slipstream eval result?")
        results.append(result)
    return sorted(results, key=lambda r: r["step"])


def build_panels(
    metrics: list[dict[str, Any]],
    weight_checks: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    online: list[dict[str, Any]] | None = None,
) -> list[Panel]:
    """The panels that have data, in display order. `online`: the run's online evaluations (eval/online.jsonl),
    each at the policy version it evaluated (version N = after N trainer steps)."""
    online_eval = metric_series(online or [], "reward_mean", "held-out (online)", "reward_stderr")
    online_eval.markers, online_eval.color = True, "C1"
    offline_eval = Series(
        "held-out (slipstream eval)",
        [r["step"] for r in evals],
        [float(r["reward_mean"]) for r in evals],
        [float(r.get("reward_stderr") or 0.0) for r in evals],
        markers=True,
        color="C2",
    )
    eval_series = [s for s in (online_eval, offline_eval) if s.steps]
    kl = metric_series(metrics, "mismatch_kl", "mismatch_kl")
    validation = metric_series(metrics, "val/loss", "validation (SFT)")
    validation.markers, validation.color = True, "C1"
    loads = [c for c in weight_checks if c.get("kind", "update") == "update"]  # not the calibration (noise floor)
    sync = metric_series(loads, "max_abs_diff", "max |trainer - inference| log-prob")
    allowed = metric_series(loads, "allowed", "allowed (calibrated)")
    candidates = [
        Panel("reward", "Reward (train ± std, held-out ± stderr)", "reward",
              [metric_series(metrics, "reward/mean", "train", "reward/std"), *eval_series]),
        Panel("eval_reward", "Held-out reward (± stderr)", "reward", eval_series),
        Panel("mismatch_kl", "Trainer-inference mismatch KL", "KL", [kl], log_y=_all_positive(kl)),
        Panel("step_time", "Step time", "seconds", [
            metric_series(metrics, "timing/step_s", "trainer step"),
            metric_series(metrics, "timing/generate_s", "rollout generation"),
        ]),
        Panel("loss", "Loss", "loss", [metric_series(metrics, "loss", "loss"), validation]),
        Panel("grad_norm", "Gradient norm (before clipping)", "norm", [metric_series(metrics, "grad_norm", "grad_norm")]),
        Panel("weight_sync", "Weight-sync check", "max abs diff", [sync, allowed], log_y=_all_positive(sync)),
    ]  # fmt: skip
    panels = []
    for panel in candidates:
        panel.series = [s for s in panel.series if s.steps]
        if panel.series:
            panels.append(panel)
    return panels


def _all_positive(series: Series) -> bool:
    return bool(series.values) and min(series.values) > 0


def draw_panel(ax: Any, panel: Panel) -> None:
    """Draw `panel` on a matplotlib Axes."""
    from matplotlib.ticker import MaxNLocator

    for series in panel.series:
        if series.markers:
            ax.errorbar(
                series.steps, series.values, yerr=series.spread, fmt="o", capsize=3, label=series.label,
                color=series.color,
            )  # fmt: skip
            continue
        (line,) = ax.plot(series.steps, series.values, label=series.label, color=series.color)
        if series.spread is not None:
            low = [v - s for v, s in zip(series.values, series.spread, strict=True)]
            high = [v + s for v, s in zip(series.values, series.spread, strict=True)]
            ax.fill_between(series.steps, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
    if panel.log_y:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if len(panel.series) > 1:
        ax.legend(fontsize=8)


def write_plots(output_dir: Path) -> list[Path]:
    """Write `output_dir/plots/<panel>.png` for every panel with data, plus `overview.png`; return the paths."""
    output_dir, run = Path(output_dir), RunDir(output_dir)
    metrics = read_metrics(output_dir)
    evals = read_eval_results(output_dir)
    if not metrics and not evals:
        raise FileNotFoundError(
            f"{output_dir} has no {METRICS_FILE} records and no {run.eval_dir.name}/step_N.json results"
        )
    online = read_jsonl(run.online_eval_path)
    panels = build_panels(metrics, read_jsonl(run.weight_checks_path), evals, online)
    plots_dir = run.plots_dir
    paths = []
    for panel in panels:
        fig, axes = _figure(1, 1, (6.4, 4.0))
        draw_panel(axes[0], panel)
        paths.append(_save(fig, plots_dir / f"{panel.name}.png"))
    if panels:
        num_cols = min(3, len(panels))
        num_rows = math.ceil(len(panels) / num_cols)
        fig, axes = _figure(num_rows, num_cols, (5.0 * num_cols, 3.4 * num_rows))
        for ax, panel in zip(axes, panels, strict=False):
            draw_panel(ax, panel)
        for ax in axes[len(panels) :]:
            ax.set_visible(False)
        fig.suptitle(output_dir.name)
        paths.append(_save(fig, plots_dir / "overview.png"))
    return paths


def _figure(num_rows: int, num_cols: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(num_rows, num_cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Any, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def main(argv: list[str] | None = None) -> int:
    """`slipstream plot RUN_DIR`: write the run's plots into RUN_DIR/plots/."""
    parser = argparse.ArgumentParser(prog="slipstream plot", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="run directory (holds metrics.jsonl)")
    args = parser.parse_args(argv)
    try:
        paths = write_plots(args.run_dir)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
