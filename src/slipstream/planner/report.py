"""Outputs of a plan: the ranked table, the chosen shape as a config fragment, and a plot of steps/hour by split."""

from pathlib import Path

import tomli_w

from slipstream.planner.candidates import Candidate, PlanSettings


def table(cands: list[Candidate], target_step_s: float | None, top: int) -> list[str]:
    """One line per candidate, best first; infeasible ones last with the reason."""
    head = (
        f"{'rank':>4}  {'inf/train nodes':>15}  {'inference shape':<34} {'conc':>6} {'tok/s':>9} {'train':<10} "
        f"{'train s':>8} {'mem inf/tr GiB':>14} {'steps/h':>8} {'s/step':>7} {'lag mean/max':>12} "
        f"{'cancel':>6} {'rollout p50/p99 s':>17}  bottleneck"
    )
    lines = [head]
    for rank, c in enumerate(cands[:top], 1):
        if not c.feasible:
            lines.append(f"{rank:>4}  {c.inference_nodes:>7}/{c.trainer_nodes:<7}  infeasible: {c.why_infeasible}")
            continue
        assert c.inference and c.point and c.trainer and c.step and c.sim
        s_step = 3600 / c.steps_per_hour
        meets = "" if target_step_s is None else ("  meets target" if s_step <= target_step_s else "  over target")
        lines.append(
            f"{rank:>4}  {c.inference_nodes:>7}/{c.trainer_nodes:<7}  {c.inference.label():<34} "
            f"{c.point.concurrency:>6} {c.point.tokens_per_s:>9.0f} {f'ep{c.trainer.ep} cp{c.trainer.cp}':<10} "
            f"{c.step.step_s:>8.1f} {f'{c.point.weights_gib_per_gpu:.0f}+kv/{c.step.memory_gib:.0f}':>14} "
            f"{c.steps_per_hour:>8.1f} {s_step:>7.0f} {f'{c.sim.lag_mean:.2f}/{c.sim.lag_max}':>12} "
            f"{c.sim.num_cancelled + c.sim.num_dropped:>6} "
            f"{f'{c.sim.rollout_latency_p50_s:.0f}/{c.sim.rollout_latency_p99_s:.0f}':>17}  {c.sim.bottleneck}{meets}"
        )
    return lines


def lag_distribution(c: Candidate) -> str:
    """Share of trained tokens per lag (steps) of one candidate."""
    assert c.sim is not None
    total = sum(c.sim.lag_hist.values())
    return ", ".join(f"{lag}: {n / total:.1%}" for lag, n in c.sim.lag_hist.items() if n / total >= 0.001)


def fragment(c: Candidate, ps: PlanSettings) -> str:
    """The chosen shape as a TOML fragment to merge into rl.toml (`-c rl.toml -c plan.toml`)."""
    assert c.inference and c.point and c.trainer
    s = c.inference
    per_rank = max(1, c.point.concurrency // (s.dp * s.num_replicas))
    data: dict = {
        "deployment": {
            "inference_gpus": c.inference_nodes * ps.gpus_per_node,
            "trainer_gpus": c.trainer_nodes * ps.gpus_per_node,
        },
        "inference": {
            "tensor_parallel_size": s.tp,
            "data_parallel_size": s.dp,
            "enable_expert_parallel": s.ep,
            "max_num_seqs": per_rank,
            "deployment": {"kind": "multi_node" if c.inference_nodes > 1 else "single_node"},
        },
        "orchestrator": {"concurrency": {"max": max(ps.group_size, c.point.concurrency)}},
        "trainer": {"parallel": {"ep": c.trainer.ep, "cp": c.trainer.cp}},
    }
    header = (
        f"# slipstream plan: {c.inference_nodes} node(s) of inference ({s.label()}), {c.trainer_nodes} of trainer\n"
        f"# predicted {c.steps_per_hour:.1f} steps/hour, mean token lag {c.sim.lag_mean:.2f} steps "
        f"(max {c.sim.lag_max}), bottleneck: {c.sim.bottleneck}\n"
    )
    return header + tomli_w.dumps(data)


def plot(cands: list[Candidate], path: Path, title: str) -> Path:
    """Steps/hour against the number of inference nodes (infeasible splits at 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_split = sorted(cands, key=lambda c: c.inference_nodes)
    xs = [c.inference_nodes for c in by_split]
    ys = [c.steps_per_hour if c.feasible else 0.0 for c in by_split]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o", label="feasible")
    bad = [c.inference_nodes for c in by_split if not c.feasible]
    if bad:
        ax.plot(bad, [0.0] * len(bad), "x", color="red", label="does not fit in memory")
    ax.legend(loc="best")
    best = max(by_split, key=lambda c: c.steps_per_hour)
    ax.axvline(best.inference_nodes, linestyle="--", color="grey")
    ax.set_xlabel("inference nodes (the rest train)")
    ax.set_ylabel("steps / hour (simulated, steady state)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
