"""`slipstream plan -c rl.toml --nodes N --gpus-per-node 8 --gpu h200 [--workload FILE | --from-run DIR]`: rank
the splits of a cluster between inference and trainer, print them, write the best as a config fragment and a plot
of steps/hour against the split. `slipstream plan --colocate -c rl.toml --gpu h200`: whether the model fits on GPUs
shared by vLLM and the trainer (planner/colocate.py)."""

import argparse
import sys
from pathlib import Path

from slipstream.config.base import ConfigError
from slipstream.planner.hardware import GPUS, SHAPES, ModelShape

EPILOG = """The rl.toml gives the model and the run's settings (orchestrator.batch_size, group_size, max_async_level,
max_off_policy_steps, spare_batches, concurrency.max, router_replay; inference.max_num_seqs, quantization;
trainer checkpointing and optimizer state). The workload (TOML, see slipstream.planner.workload.Workload):
prompt_tokens, completion_tokens (per turn), num_turns, env_latency_s, each length a {p50, tail_ratio, max}
table. Dotted overrides of the config (--orchestrator.max_async_level 4) are accepted. Outputs in --out: plan.toml (merge with `-c rl.toml -c plan.toml`) and steps_per_hour.png."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="slipstream plan",
        description="Rank splits of a cluster between inference and trainer for an RL run (simulated).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-c", "--config", action="append", required=True, type=Path, help="rl.toml (repeatable)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in all (inference + trainer)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="default: %(default)s")
    p.add_argument("--gpu", choices=sorted(GPUS), required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--workload", type=Path, help="workload TOML file")
    src.add_argument("--from-run", type=Path, help="take the workload from a run directory's batches")
    p.add_argument("--model-shape", choices=sorted(SHAPES), help="model shape (default: guessed from model.name)")
    p.add_argument(
        "--weight-update-gbps",
        type=float,
        default=710 / 48,
        help="trainer -> inference weight update rate in GB/s; inference is paused meanwhile (default: %(default).1f, "
        "slime's published rate: 355B bf16 parameters in 48 s)",
    )
    p.add_argument("--target-step-s", type=float, help="mark candidates whose step takes at most this long")
    p.add_argument("--steps", type=int, default=24, help="steps simulated per candidate (default: %(default)s)")
    p.add_argument("--top", type=int, default=10, help="candidates printed (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("outputs/plan"), help="output folder (default: %(default)s)")
    args, overrides = p.parse_known_args(argv)
    if any(not o.startswith("--") or o.count(".") == 0 for o in overrides[::2]):
        p.error(
            f"unrecognized arguments: {' '.join(overrides)} (config overrides look like --orchestrator.batch_size 64)"
        )
    args.overrides = overrides
    return args


def guess_shape(model_name: str) -> ModelShape:
    name = model_name.lower().replace("_", "-")
    for key, needle in (("glm-5", "glm-5"), ("qwen3-30b-a3b", "30b-a3b"), ("qwen3-0.6b", "0.6b")):
        if needle in name:
            return SHAPES[key]
    raise ConfigError(
        f"model.name {model_name!r} is not a shape the planner knows; pass --model-shape ({', '.join(sorted(SHAPES))})"
    )


def settings_from_config(argv: list[str], args: argparse.Namespace):
    """PlanSettings and the model shape from rl.toml."""
    from slipstream.config.loader import load_config
    from slipstream.config.rl import RLConfig
    from slipstream.planner.candidates import PlanSettings

    config = load_config(RLConfig, argv)
    o, inf, tr = config.orchestrator, config.inference, config.trainer
    checkpointing = (
        ("keep_attention" if tr.parallel.activation_checkpointing_keep_attention else "full")
        if tr.parallel.activation_checkpointing
        else "none"
    )
    if args.nodes < 2:
        raise ConfigError(f"--nodes must be at least 2 (one for inference, one for the trainer), got {args.nodes}")
    for flag, value, low in (
        ("--gpus-per-node", args.gpus_per_node, 1),
        ("--steps", args.steps, 4),
        ("--top", args.top, 1),
    ):
        if value < low:
            raise ConfigError(f"{flag} must be at least {low}, got {value}")
    for flag, value in (("--weight-update-gbps", args.weight_update_gbps), ("--target-step-s", args.target_step_s)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be positive, got {value}")
    ps = PlanSettings(
        num_nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        batch_size=o.batch_size,
        group_size=o.group_size,
        max_async_level=o.max_async_level,
        max_off_policy_steps=o.max_off_policy_steps,
        spare_batches=o.spare_batches,
        in_flight_max=o.concurrency.max,
        version_tracking="reply" if o.router_replay else "stream",  # router replay sends whole requests
        micro_batch_tokens=o.micro_batch_tokens,
        max_num_seqs=inf.max_num_seqs,
        weight_bytes=1 if inf.quantization else 2,
        checkpointing=checkpointing,
        optimizer_state_bytes=8 if tr.optim.state_dtype == "float32" else 4,
        weights_poll_s=o.weights_poll_s,
        weight_stream_bytes_per_s=args.weight_update_gbps * 1e9,
        num_steps=args.steps,
        seed=config.seed,
    )
    shape = SHAPES[args.model_shape] if args.model_shape else guess_shape(config.model.name)
    return ps, shape


def main(argv: list[str]) -> int:
    if "--colocate" in argv:  # one machine's GPUs shared by vLLM and the trainer: a memory plan, no simulation
        from slipstream.planner.colocate import main as colocate_main

        return colocate_main(argv)
    args = parse_args(argv)
    from slipstream.planner.candidates import plan
    from slipstream.planner.report import fragment, lag_distribution, plot, table
    from slipstream.planner.workload import load_workload, workload_from_run

    try:
        config_argv = [x for path in args.config for x in ("-c", str(path))] + args.overrides
        ps, shape = settings_from_config(config_argv, args)
        workload = load_workload(args.workload) if args.workload else workload_from_run(args.from_run)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    gpu = GPUS[args.gpu]
    print(
        f"plan: {shape.name} ({shape.total_params / 1e9:.3g}B total, {shape.active_params / 1e9:.3g}B active) on "
        f"{args.nodes} x {args.gpus_per_node} {gpu.name.upper()}; {ps.batch_size} rollouts per step in groups of "
        f"{ps.group_size}, max_async_level {ps.max_async_level}, max_off_policy_steps {ps.max_off_policy_steps}; "
        f"workload: prompt p50 {workload.prompt_tokens.p50:.0f} tokens, completion p50 "
        f"{workload.completion_tokens.p50:.0f} (p99 {workload.completion_tokens.quantile(0.99):.0f}) x "
        f"{workload.num_turns} turn(s), mean sample {workload.mean_sample_tokens():.0f} tokens; weight update "
        f"{shape.total_params * 2 / ps.weight_stream_bytes_per_s:.1f}s per step (inference paused)"
    )
    cands = plan(shape, gpu, ps, workload)
    for line in table(cands, args.target_step_s, args.top):
        print(line)
    best = cands[0]
    if not best.feasible:
        print(f"error: no split is feasible; the best one: {best.why_infeasible}", file=sys.stderr)
        return 1
    print(f"token lag of the best (steps: share of trained tokens): {lag_distribution(best)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.toml").write_text(fragment(best, ps))
    png = plot(
        cands, args.out / "steps_per_hour.png", f"{shape.name} on {args.nodes} x {args.gpus_per_node} {gpu.name}"
    )
    print(
        f"best: {best.inference_nodes} inference node(s), {best.trainer_nodes} trainer node(s); wrote "
        f"{args.out / 'plan.toml'} and {png}"
    )
    return 0
