"""The workload a plan is made for: prompt and completion lengths, turns per rollout, environment latency; read
from a TOML file or measured from an earlier run's training batches."""

import json
import math
from pathlib import Path

from pydantic import Field

from slipstream.config.base import BaseConfig, ConfigError
from slipstream.config.loader import read_toml, validate_config
from slipstream.planner.distributions import TailDist, constant


class Workload(BaseConfig):
    """Lengths in tokens, latencies in seconds. Example (TOML):

    prompt_tokens = { p50 = 2000, tail_ratio = 4 }
    completion_tokens = { p50 = 8000, tail_ratio = 8, max = 131072 }
    num_turns = 1
    """

    prompt_tokens: TailDist
    """Tokens of a rollout's first prompt."""

    completion_tokens: TailDist
    """Tokens the model generates per turn (clip with `max` at the sampling budget)."""

    num_turns: int = Field(1, ge=1)
    """Model turns per rollout."""

    env_latency_s: TailDist = constant(0.0)
    """Environment (tool) time between two turns."""

    env_tokens_per_turn: float = Field(0.0, ge=0.0)
    """Tokens the environment adds to the context after each turn (tool output)."""

    def mean_sample_tokens(self) -> float:
        """Mean tokens of one trained sample (prompt, every turn and tool output)."""
        turns = self.num_turns
        return (
            self.prompt_tokens.mean() + turns * self.completion_tokens.mean() + (turns - 1) * self.env_tokens_per_turn
        )

    def mean_completion_tokens(self) -> float:
        return self.num_turns * self.completion_tokens.mean()


def load_workload(path: Path) -> Workload:
    """A workload TOML file; errors name the file and the field."""
    try:
        return validate_config(Workload, read_toml(Path(path)))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def _tail(values: list[float], cap: float | None = None) -> TailDist:
    values = sorted(values)
    p50 = values[(len(values) - 1) // 2]
    p99 = values[min(len(values) - 1, math.ceil(0.99 * (len(values) - 1)))]
    ratio = max(1.0, p99 / p50) if p50 > 0 else 1.0
    return TailDist(p50=p50, tail_ratio=ratio, max=cap)


def workload_from_run(run_dir: Path) -> Workload:
    """Sample lengths from the run's training batches (rollouts/step_N/rank_R.msgpack) and turns per rollout from
    its metrics.jsonl (1 if absent). A sample is a run of consecutive positions; its prompt is what carries no loss."""
    from slipstream.rundir import RunDir, step_dirs
    from slipstream.transport.rollouts import read_batch

    run = RunDir(Path(run_dir))
    steps = sorted(step_dirs(run.rollouts_root)) if run.rollouts_root.is_dir() else []
    if not steps:
        raise ConfigError(
            f"--from-run {run_dir}: no training batches under {run.rollouts_root}; is it a run directory?"
        )
    prompts, completions = [], []
    for step in steps:
        for path in sorted(run.rollouts_root.joinpath(f"step_{step}").glob("rank_*.msgpack")):
            for mb in read_batch(path).micro_batches:
                start = 0
                for t in range(1, len(mb.position_ids) + 1):
                    if t == len(mb.position_ids) or mb.position_ids[t] != mb.position_ids[t - 1] + 1:
                        length = mb.position_ids[t - 1] + 1
                        loss = sum(mb.loss_mask[start:t])
                        if loss:
                            prompts.append(float(length - loss))
                            completions.append(float(loss))
                        start = t
    if not completions:
        raise ConfigError(f"--from-run {run_dir}: its batches hold no sample with loss tokens")
    turns = _mean_turns(run.metrics_path)
    return Workload(
        prompt_tokens=_tail([max(p, 1.0) for p in prompts]),
        completion_tokens=_tail([c / turns for c in completions]),
        num_turns=max(1, round(turns)),
    )


def _mean_turns(metrics_path: Path) -> float:
    if not metrics_path.exists():
        return 1.0
    values = []
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "rollout/num_turns_mean" in row:
            values.append(float(row["rollout/num_turns_mean"]))
    return sum(values) / len(values) if values else 1.0
