"""Held-out scores across the phases of a warm-up-then-RL pipeline: the base model (a `slipstream eval` result), after
SFT (the RL run's online evaluation of policy 0) and after RL (its last one). Three summary lines and a plot of the
phases on one step axis (SFT steps, then RL steps)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.monitor.metrics import read_metrics
from slipstream.monitor.plots import Panel, Series, _figure, _save, draw_panel, metric_series, read_jsonl
from slipstream.rundir import RunDir

PHASES = ("base", "sft", "rl")


@dataclass(frozen=True)
class PhaseScore:
    """One evaluation's summary: mean reward, exact-answer rate and mean completion length."""

    reward: float
    reward_stderr: float
    exact: float
    """Fraction of samples whose reward is 1.0 (pass@1 at pass_threshold 1.0): exact answers."""
    completion_tokens: float


def phase_score(result: dict[str, Any]) -> PhaseScore:
    """The score of an evaluation summary (a `slipstream eval` result or a line of `eval/online.jsonl`)."""
    threshold = result.get("pass_threshold")
    if threshold != 1.0:
        raise ValueError(f"exact answers need an evaluation with pass_threshold = 1.0, got {threshold}")
    pass_at_k = result.get("pass_at_k") or {}
    if "1" not in pass_at_k:
        raise ValueError("the evaluation has no pass@1 (pass_at_k['1'])")
    return PhaseScore(
        reward=float(result["reward_mean"]),
        reward_stderr=float(result.get("reward_stderr") or 0.0),
        exact=float(pass_at_k["1"]),
        completion_tokens=float(result["completion_tokens_mean"]),
    )


def rl_scores(rl_dir: Path) -> tuple[PhaseScore, PhaseScore]:
    """(policy 0, last evaluated policy) of an RL run's online evaluations: the scores after SFT and after RL."""
    records = read_jsonl(RunDir(rl_dir).online_eval_path)
    first = next((r for r in records if r.get("step") == 0), None)
    last = max(records, key=lambda r: r.get("step", -1), default=None)
    if first is None or last is None or last["step"] == 0:
        raise ValueError(f"{rl_dir} has no online evaluation of policy 0 and of a later policy")
    return phase_score(first), phase_score(last)


def phase_lines(scores: dict[str, PhaseScore], reference_tokens: float) -> list[str]:
    """`heldout_reward: base <x> sft <y> rl <z>`, `heldout_exact: ...` and `heldout_length_ratio: <r>` (mean
    completion tokens after RL / mean tokens of the reference answers)."""
    if reference_tokens <= 0:
        raise ValueError(f"reference answers need a positive mean token count, got {reference_tokens}")
    rewards = " ".join(f"{p} {scores[p].reward:.3f}" for p in PHASES)
    exact = " ".join(f"{p} {scores[p].exact:.3f}" for p in PHASES)
    ratio = scores["rl"].completion_tokens / reference_tokens
    return [f"heldout_reward: {rewards}", f"heldout_exact: {exact}", f"heldout_length_ratio: {ratio:.3f}"]


def phase_panels(base: dict[str, Any], sft_dir: Path, rl_dir: Path) -> tuple[list[Panel], int, int]:
    """Panels of the three phases on one step axis (SFT step s at s, RL step s at sft_steps + s): SFT loss, held-out
    reward (with RL's training reward) and exact answers; and (sft_steps, rl_steps)."""
    sft_metrics, rl_metrics = read_metrics(sft_dir), read_metrics(rl_dir)
    online = read_jsonl(RunDir(rl_dir).online_eval_path)
    if not sft_metrics or not rl_metrics or not online:
        raise ValueError(f"phase plots need the metrics of {sft_dir} and {rl_dir} and the online evaluations of the RL")
    sft_steps, rl_steps = max(r["step"] for r in sft_metrics), max(r["step"] for r in rl_metrics)
    shifted = [r | {"step": sft_steps + r["step"]} for r in online]
    rl_shifted = [r | {"step": sft_steps + r["step"]} for r in rl_metrics]
    base_score, scores = phase_score(base), [phase_score(r) for r in shifted]
    steps = [0, *(r["step"] for r in shifted)]

    def points(label: str, values: list[float], spread: list[float] | None = None) -> Series:
        return Series(label, steps, values, spread, markers=True, color="C1")

    reward = points(
        "held-out (base, then online)",
        [base_score.reward, *(s.reward for s in scores)],
        [base_score.reward_stderr, *(s.reward_stderr for s in scores)],
    )
    panels = [
        Panel("sft_loss", "SFT loss", "loss", [
            metric_series(sft_metrics, "loss", "train"),
            Series("validation", *_xy(sft_metrics, "val/loss"), markers=True, color="C1"),
        ]),
        Panel("reward", "Held-out reward (± stderr)", "reward",
              [metric_series(rl_shifted, "reward/mean", "RL train"), reward]),
        Panel("exact", "Held-out exact answers", "fraction of samples",
              [points("held-out", [base_score.exact, *(s.exact for s in scores)])]),
    ]  # fmt: skip
    return panels, sft_steps, rl_steps


def _xy(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    series = metric_series(records, key, key)
    return series.steps, series.values


def write_phase_plot(path: Path, base: dict[str, Any], sft_dir: Path, rl_dir: Path) -> Path:
    """Write the phase panels side by side as one PNG, the SFT and RL phases shaded."""
    panels, sft_steps, rl_steps = phase_panels(base, sft_dir, rl_dir)
    fig, axes = _figure(1, len(panels), (5.0 * len(panels), 3.6))
    for ax, panel in zip(axes, panels, strict=True):
        draw_panel(ax, panel)
        ax.axvspan(0, sft_steps, color="C0", alpha=0.06, label=None)
        ax.axvspan(sft_steps, sft_steps + rl_steps, color="C2", alpha=0.08, label=None)
        ax.set_xlabel(f"step (SFT 0-{sft_steps}, then RL {rl_steps} steps)")
    fig.suptitle("base -> SFT -> RL")
    return _save(fig, path)
