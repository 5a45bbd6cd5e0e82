"""Per-step orchestrator metrics (rewards, lengths, policy lag), shipped to the trainer inside TrainingBatch.metrics."""

from collections.abc import Sequence

import numpy as np

from slipstream.orchestrator.rollouts import Rollout


def rollout_metrics(step: int, rollouts: Sequence[Rollout], num_zero_adv_groups: int) -> dict[str, float]:
    """Reward, length and policy-version statistics of the rollouts of `step`."""
    rewards = np.asarray([r.reward for r in rollouts], dtype=np.float64)
    completion_lens = np.asarray([len(r.completion_token_ids) for r in rollouts], dtype=np.float64)
    seq_lens = completion_lens + np.asarray([len(r.prompt_token_ids) for r in rollouts], dtype=np.float64)
    versions = [r.policy_version for r in rollouts]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()),
        "reward/min": float(rewards.min()),
        "reward/max": float(rewards.max()),
        "seq_len/mean": float(seq_lens.mean()),
        "completion_len/mean": float(completion_lens.mean()),
        "policy/version": float(max(versions)),
        # The trainer has finished step - 1 steps when it trains on this batch.
        "policy/lag_max": float(step - 1 - min(versions)),
        "batch/zero_adv_groups": float(num_zero_adv_groups),
        "batch/num_rollouts": float(len(rollouts)),
    }


def progress_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """One human-readable line per step."""
    line = (
        f"[orchestrator] step {step}/{max_steps} | reward {metrics['reward/mean']:.3f} "
        f"| seq_len {metrics['seq_len/mean']:.0f} | policy v{metrics['policy/version']:.0f} "
        f"(lag {metrics['policy/lag_max']:.0f}) | zero-adv groups {metrics['batch/zero_adv_groups']:.0f} "
        f"| generate {metrics['timing/generate_s']:.2f}s | weights {metrics['timing/weight_update_s']:.2f}s"
    )
    if "weight_sync/max_abs_diff" in metrics:
        line += f" | sync diff {metrics['weight_sync/max_abs_diff']:.2e}"
    return line
