"""Per-step orchestrator metrics (rewards, lengths, policy versions and lag), shipped to the trainer inside
TrainingBatch.metrics, and the console progress line."""

from collections.abc import Sequence

import numpy as np

from slipstream.rollout.record import Rollout


def rollout_metrics(step: int, rollouts: Sequence[Rollout], num_zero_adv_groups: int) -> dict[str, float]:
    """Reward, length and policy-version statistics of the rollouts of `step`.

    Lag of a token = (step - 1) - its version: the trainer has finished step - 1 steps when it trains on the batch.
    """
    rewards = np.asarray([r.reward for r in rollouts], dtype=np.float64)
    completion_lens = np.asarray([len(r.completion_token_ids) for r in rollouts], dtype=np.float64)
    seq_lens = np.asarray([r.num_tokens for r in rollouts], dtype=np.float64)
    oldest = min(r.oldest_version for r in rollouts)
    newest = max(r.newest_version for r in rollouts)
    token_versions = np.asarray([v for r in rollouts for v in r.token_versions], dtype=np.float64)
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "seq_len/mean": float(seq_lens.mean()),
        "completion_len/mean": float(completion_lens.mean()),
        "batch/completion_tokens": float(completion_lens.sum()),
        "policy/version": float(newest),
        "policy/version_oldest": float(oldest),
        "policy/version_newest": float(newest),
        "policy/lag_max": float(step - 1 - oldest),
        "policy/lag_mean": float(step - 1 - token_versions.mean()) if token_versions.size else 0.0,
        "batch/multi_version_rollouts": float(sum(r.oldest_version != r.newest_version for r in rollouts)),
        "batch/zero_adv_groups": float(num_zero_adv_groups),
        "batch/num_rollouts": float(len(rollouts)),
        **multi_turn_metrics(rollouts),
    }


def multi_turn_metrics(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """Turns, prefix breaks, samples, stop reasons and the environment's named reward metrics (mean per name) of
    multi-turn rollouts; {} for single-turn ones."""
    multi = [r for r in rollouts if r.samples is not None]
    if not multi:
        return {}
    metrics = {
        "rollout/num_turns_mean": float(np.mean([r.num_turns for r in multi])),
        "rollout/num_turns_max": float(max(r.num_turns for r in multi)),
        "rollout/num_prefix_breaks": float(sum(r.num_prefix_breaks for r in multi)),
        "batch/num_samples": float(sum(len(r.samples or []) for r in multi)),
    }
    for reason in sorted({r.stop_reason for r in multi}):
        metrics[f"rollout/stop/{reason}"] = float(sum(r.stop_reason == reason for r in multi))
    values: dict[str, list[float]] = {}
    for r in multi:
        for name, value in r.reward_metrics.items():
            values.setdefault(name, []).append(float(value))
    metrics |= {f"env/{name}": float(np.mean(v)) for name, v in sorted(values.items())}
    return metrics


def progress_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """One human-readable line per step."""
    m = metrics
    line = (
        f"step {step}/{max_steps} | reward {m['reward/mean']:.3f} | seq_len {m['seq_len/mean']:.0f} "
        f"| policy v{m['policy/version_oldest']:.0f}-v{m['policy/version_newest']:.0f} "
        f"(lag {m['policy/lag_max']:.0f}) | zero-adv groups {m['batch/zero_adv_groups']:.0f} "
        f"| cancelled {m['pipeline/cancelled_groups']:.0f} dropped {m['pipeline/dropped_groups']:.0f} "
        f"| in flight {m['pipeline/in_flight_groups']:.0f} (limit {m['pipeline/concurrency_limit']:.0f}) "
        f"| wait {m['timing/wait_weights_s'] + m['timing/generate_s']:.2f}s | weights {m['timing/weight_update_s']:.2f}s"
    )
    if "weight_sync/max_abs_diff" in m:
        line += f" | sync diff {m['weight_sync/max_abs_diff']:.2e}"
    return line
