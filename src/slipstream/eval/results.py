"""Result types of an evaluation: per-task samples and the summary (mean reward, spread, pass@k, env metrics)."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from slipstream.envs.base import Message
from slipstream.eval.metrics import mean_pass_at_k, reward_summary

EVAL_METRIC_PREFIX = "eval/"
"""Prefix of evaluation metrics in metrics.jsonl (e.g. `eval/reward_mean`, read by monitor/plots.py)."""


@dataclass
class TaskResult:
    """The samples of one task."""

    task_id: str
    request_seed: int | None
    """Base seed of the task's requests (None: unseeded). Single-turn: sample i is drawn with `request_seed + i`
    (vLLM's rule for n > 1); multi-turn: see `eval/tasks.py`."""
    rewards: list[float]
    """Reward of each sample; 0.0 for a sample whose rollout failed (see `errors`)."""
    completions: list[str | list[Message]]
    """Single-turn: the reply text. Multi-turn: the conversation after the prompt (model and environment turns)."""
    num_completion_tokens: list[int]
    """Tokens the model generated per sample (all turns)."""
    finish_reasons: list[str | None]
    """Single-turn: vLLM's finish reason. Multi-turn: the rollout's stop reason, or `error:<stage>`."""
    errors: list[str | None]
    """Why a sample's rollout failed inside the environment (None: it did not)."""
    reward_metrics: list[dict[str, float]]
    """Named metrics the environment logged with each reward (multi-turn environments; {} otherwise)."""


@dataclass
class EvalResult:
    """Summary and per-task results of one evaluation."""

    env: str
    split: str
    num_tasks: int
    num_samples: int
    seed: int | None
    pass_threshold: float
    reward_mean: float
    reward_std: float
    """Population std over all samples."""
    reward_stderr: float
    """Standard error of reward_mean over tasks (std of per-task means / sqrt(num_tasks))."""
    reward_min: float
    reward_max: float
    pass_at_k: dict[int, float]
    """k -> mean over tasks of the unbiased pass@k, a sample passing when its reward >= pass_threshold."""
    num_errors: int
    """Samples whose rollout failed inside the environment; they count as reward 0.0."""
    env_metrics: dict[str, float]
    """Mean over samples without errors of each metric the environment logged with its rewards."""
    completion_tokens_mean: float
    seconds: float
    tasks: list[TaskResult] = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (pass@k keys as strings)."""
        out = asdict(self)
        out["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return out

    def metrics(self, prefix: str = EVAL_METRIC_PREFIX) -> dict[str, float]:
        """Flat scalar metrics for metrics.jsonl, e.g. `eval/reward_mean`, `eval/pass@1`, `eval/env/<name>`."""
        scalars = {
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "reward_stderr": self.reward_stderr,
            "num_errors": self.num_errors,
            "completion_tokens_mean": self.completion_tokens_mean,
            "seconds": self.seconds,
        }
        scalars.update({f"pass@{k}": v for k, v in self.pass_at_k.items()})
        scalars.update({f"env/{name}": v for name, v in self.env_metrics.items()})
        return {f"{prefix}{name}": float(value) for name, value in scalars.items()}


def summarize(
    env: str,
    split: str,
    seed: int | None,
    tasks: Sequence[TaskResult],
    pass_threshold: float,
    pass_ks: Sequence[int],
    seconds: float,
) -> EvalResult:
    """The EvalResult of finished tasks (all with the same number of samples)."""
    rewards = [t.rewards for t in tasks]
    tokens = [n for t in tasks for n in t.num_completion_tokens]
    return EvalResult(
        env=env,
        split=split,
        num_tasks=len(tasks),
        num_samples=len(rewards[0]),
        seed=seed,
        pass_threshold=pass_threshold,
        **reward_summary(rewards),
        pass_at_k={k: mean_pass_at_k(rewards, k, pass_threshold) for k in pass_ks},
        num_errors=sum(e is not None for t in tasks for e in t.errors),
        env_metrics=_mean_env_metrics(tasks),
        completion_tokens_mean=float(np.mean(tokens)),
        seconds=seconds,
        tasks=list(tasks),
    )


def _mean_env_metrics(tasks: Sequence[TaskResult]) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for task in tasks:
        for metrics, error in zip(task.reward_metrics, task.errors, strict=True):
            if error is None:
                for name, value in metrics.items():
                    values.setdefault(name, []).append(float(value))
    return {name: float(np.mean(v)) for name, v in sorted(values.items())}
