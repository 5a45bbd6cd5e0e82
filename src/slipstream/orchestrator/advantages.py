"""GRPO advantages: each rollout's reward minus its group's mean (optionally divided by the group's std)."""

from collections.abc import Sequence

import numpy as np

STD_EPS = 1e-6


def group_advantages(rewards: Sequence[float], std_normalize: bool = False, eps: float = STD_EPS) -> list[float]:
    """Advantages of one group: r - mean(r), divided by (std(r) + eps) when `std_normalize` (population std)."""
    if not rewards:
        raise ValueError("a GRPO group needs at least one reward")
    r = np.asarray(rewards, dtype=np.float64)
    if np.all(r == r[0]):
        # Exact zeros: r - mean(r) can be off by an ulp (e.g. three rewards of 0.1).
        return [0.0] * len(r)
    adv = r - r.mean()
    if std_normalize:
        adv = adv / (r.std() + eps)
    return adv.tolist()


def compute_advantages(
    rewards: Sequence[float], group_size: int, std_normalize: bool = False, eps: float = STD_EPS
) -> list[float]:
    """Advantages of a batch laid out group by group (`group_size` consecutive rollouts per task)."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    advantages: list[float] = []
    for start in range(0, len(rewards), group_size):
        advantages += group_advantages(rewards[start : start + group_size], std_normalize, eps)
    return advantages


def count_zero_advantage_groups(advantages: Sequence[float], group_size: int) -> int:
    """Groups whose advantages are all zero (equal rewards): they carry no loss but still cost tokens."""
    return sum(
        all(a == 0.0 for a in advantages[start : start + group_size]) for start in range(0, len(advantages), group_size)
    )
