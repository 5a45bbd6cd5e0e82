"""Evaluation statistics: the unbiased pass@k estimator and reward summaries over tasks and samples."""

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased estimate of P(at least one of k samples is correct) from `num_correct` of `num_samples`
    (Chen et al. 2021): 1 - C(n - c, k) / C(n, k), computed as a stable product."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k needs 1 <= k <= num_samples, got k={k}, num_samples={num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct must be in [0, {num_samples}], got {num_correct}")
    if num_samples - num_correct < k:
        return 1.0
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def mean_pass_at_k(rewards_per_task: Sequence[Sequence[float]], k: int, threshold: float) -> float:
    """pass@k averaged over tasks, a sample being correct when its reward is >= `threshold`."""
    if not rewards_per_task:
        raise ValueError("pass@k of no tasks is undefined")
    values = [pass_at_k(len(rewards), sum(r >= threshold for r in rewards), k) for rewards in rewards_per_task]
    return float(np.mean(values))


def reward_summary(rewards_per_task: Sequence[Sequence[float]]) -> dict[str, float]:
    """Mean and population std over all samples; stderr of the mean over tasks (std of task means / sqrt(tasks))."""
    if not rewards_per_task or not all(rewards_per_task):
        raise ValueError("reward summary needs at least one task and one sample per task")
    flat = np.asarray([r for rewards in rewards_per_task for r in rewards], dtype=np.float64)
    task_means = np.asarray([np.mean(rewards) for rewards in rewards_per_task], dtype=np.float64)
    stderr = float(task_means.std(ddof=1) / math.sqrt(len(task_means))) if len(task_means) > 1 else 0.0
    return {
        "reward_mean": float(flat.mean()),
        "reward_std": float(flat.std()),
        "reward_stderr": stderr,
        "reward_min": float(flat.min()),
        "reward_max": float(flat.max()),
    }
