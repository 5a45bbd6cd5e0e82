"""Held-out reward before and after training, from the run's online evaluations (`eval/online.jsonl`): what
`slipstream rl` prints last."""

from pathlib import Path

from slipstream.monitor.plots import read_jsonl
from slipstream.rundir import RunDir


def heldout_lines(output_dir: Path) -> list[str]:
    """A detail line (rewards and mean completion lengths) and `heldout_reward: before <x> after <y>` (policy 0 vs the
    last evaluated policy); none when the run has no online evaluation of policy 0 and of a later one."""
    records = read_jsonl(RunDir(output_dir).online_eval_path)
    before = next((r for r in records if r.get("step") == 0), None)
    after = max(records, key=lambda r: r.get("step", -1), default=None)
    if before is None or after is None or after["step"] == 0:
        return []
    detail = (
        f"held-out reward ({after.get('env')}/{after.get('split')}, {after.get('num_tasks')} tasks x "
        f"{after.get('num_samples')} samples): policy v0 {before['reward_mean']:.3f} "
        f"± {before.get('reward_stderr', 0.0):.3f} -> v{after['step']} {after['reward_mean']:.3f} "
        f"± {after.get('reward_stderr', 0.0):.3f}"
    )
    if "completion_tokens_mean" in before and "completion_tokens_mean" in after:
        detail += (
            f"; mean completion tokens {before['completion_tokens_mean']:.1f} -> {after['completion_tokens_mean']:.1f}"
        )
    return [detail, f"heldout_reward: before {before['reward_mean']:.3f} after {after['reward_mean']:.3f}"]
