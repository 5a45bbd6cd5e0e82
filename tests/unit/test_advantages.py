"""GRPO advantages against hand-computed values."""

import math

import pytest

from slipstream.orchestrator.advantages import compute_advantages, count_zero_advantage_groups, group_advantages


def test_group_mean_baseline():
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalize():
    # mean 0.5, population std 0.5 -> (r - 0.5) / (0.5 + eps)
    adv = group_advantages([1.0, 0.0, 1.0, 0.0], std_normalize=True, eps=0.0)
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0])
    adv = group_advantages([2.0, 0.0], std_normalize=True)
    assert adv[0] == pytest.approx(1.0 / (1.0 + 1e-6))


def test_equal_rewards_give_exact_zeros():
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([0.1, 0.1, 0.1], std_normalize=True) == [0.0, 0.0, 0.0]


def test_batch_is_split_into_groups():
    rewards = [1.0, 0.0, 3.0, 3.0, 0.2, 0.4]
    adv = compute_advantages(rewards, group_size=2)
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0, -0.1, 0.1])
    assert count_zero_advantage_groups(adv, 2) == 1
    assert all(math.isfinite(a) for a in adv)


def test_bad_group_size():
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages([1.0, 2.0, 3.0], group_size=4)
