"""Candidate deployments of a cluster: every split of whole nodes between inference and trainer, the best
inference shape and trainer layout for each, and the pipeline simulation that turns them into steps/hour and lag."""

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig
from slipstream.planner.distributions import TailDist
from slipstream.planner.hardware import GpuSpec, ModelShape
from slipstream.planner.inference_model import (
    InferenceAssumptions,
    InferencePoint,
    InferenceShape,
    candidate_shapes,
    decode_step_s,
    operating_point,
)
from slipstream.planner.pipeline_sim import simulate
from slipstream.planner.sim_config import PipelineSimConfig, PipelineSimResult
from slipstream.planner.trainer_model import Checkpointing, TrainerShape, TrainerStep, predict_step
from slipstream.planner.workload import Workload


class PlanSettings(BaseConfig):
    """What is being planned: the cluster, the run's settings (from rl.toml) and the fixed costs."""

    num_nodes: int = Field(ge=2)
    """Nodes in all (at least one for inference and one for the trainer)."""
    gpus_per_node: int = Field(ge=1)
    """GPUs of each node."""
    batch_size: int = Field(ge=1)
    """orchestrator.batch_size (rollouts per step)."""
    group_size: int = Field(ge=1)
    """orchestrator.group_size."""
    max_async_level: int = Field(ge=0)
    """orchestrator.max_async_level."""
    max_off_policy_steps: int = Field(ge=0)
    """orchestrator.max_off_policy_steps."""
    spare_batches: int = Field(ge=0)
    """orchestrator.spare_batches."""
    in_flight_max: int = Field(ge=1)
    """orchestrator.concurrency.max (completions)."""
    version_tracking: Literal["stream", "reply"]
    """stream, or reply with orchestrator.router_replay (whole replies; see PipelineSimConfig)."""
    micro_batch_tokens: int = Field(8192, ge=1)
    """orchestrator.micro_batch_tokens (a longer sample is a micro-batch of its own)."""
    max_num_seqs: int = Field(ge=1)
    """inference.max_num_seqs per engine."""
    weight_bytes: Literal[1, 2] = 2
    """Inference weight bytes per parameter: 1 with FP8 (inference.quantization), else 2."""
    checkpointing: Checkpointing = "keep_attention"
    """The trainer's activation checkpointing (trainer.parallel)."""
    optimizer_state_bytes: int = Field(8, ge=0)
    """AdamW moment bytes per parameter (trainer.optim.state_dtype: float32 8, bfloat16 4)."""
    weights_poll_s: float = Field(0.1, gt=0)
    """orchestrator.weights_poll_s."""
    weight_stream_bytes_per_s: float = Field(710e9 / 48, gt=0)
    """Trainer -> inference weight update across nodes: slime's published rate (355B bf16 parameters in 48 s)."""
    weight_check_s: float = Field(1.0, ge=0)
    """The probe check after each load (assumed)."""
    batch_write_s: float = Field(1.0, ge=0)
    """Orchestrator time to score, pack and write one batch (assumed)."""
    num_steps: int = Field(24, ge=4)
    """Steps of steady state per candidate (max_async_level + 2 more are simulated: the run's end holds groups back);
    steps/hour is taken over their last two thirds."""
    seed: int = 0
    """Seed of the simulation's draws."""


@dataclass
class Candidate:
    """One split of the nodes with its chosen inference shape and trainer layout, and what they predict."""

    inference_nodes: int
    trainer_nodes: int
    inference: InferenceShape | None
    point: InferencePoint | None
    trainer: TrainerShape | None
    step: TrainerStep | None
    sim: PipelineSimResult | None
    why_infeasible: str = ""
    num_steady: int = 0
    """Steps steady-state figures are taken over: those after the first third, before the last steps (whose
    groups the run's end holds back)."""

    @property
    def feasible(self) -> bool:
        return not self.why_infeasible

    @property
    def steps_per_hour(self) -> float:
        return self.steady_steps_per_hour() if self.sim is not None else 0.0

    def steady_steps_per_hour(self) -> float:
        assert self.sim is not None
        steps = self.sim.step_s[self.num_steady // 3 : self.num_steady]
        return 3600 * len(steps) / sum(steps) if sum(steps) > 0 else math.inf


def inference_options(
    shape: ModelShape, gpu: GpuSpec, nodes: int, ps: PlanSettings, workload: Workload, a: InferenceAssumptions
) -> tuple[list[tuple[InferenceShape, InferencePoint]], str]:
    """The feasible shapes over `nodes` nodes worth simulating: the one with the most decode throughput at its
    KV-limited concurrency, and the one with the shortest time per token at a light load (8 sequences per rank),
    which wins when the rollouts' latency, not throughput, bounds the pipeline."""
    feasible, why = [], "no shape fits"
    seq = workload.mean_sample_tokens()
    for s in candidate_shapes(shape, nodes, ps.gpus_per_node, ps.weight_bytes):
        point = operating_point(shape, gpu, s, seq, ps.max_num_seqs, a)
        if point.feasible:
            feasible.append((s, point))
        else:
            why = point.why
    if not feasible:
        return [], why
    fastest = max(feasible, key=lambda sp: sp[1].tokens_per_s)
    light = min(feasible, key=lambda sp: decode_step_s(shape, gpu, sp[0], 8, seq / 2, a))
    return [fastest] if light is fastest else [fastest, light], ""


def best_trainer(
    shape: ModelShape, gpu: GpuSpec, nodes: int, ps: PlanSettings, workload: Workload
) -> tuple[TrainerShape | None, TrainerStep | None, str]:
    """The fastest layout (ep, cp) over `nodes` nodes whose memory fits."""
    num_gpus = nodes * ps.gpus_per_node
    batch_tokens = ps.batch_size * workload.mean_sample_tokens()
    context = workload.mean_sample_tokens()
    longest = workload.prompt_tokens.quantile(0.99) + workload.num_turns * workload.completion_tokens.quantile(0.99)
    micro = int(max(ps.micro_batch_tokens, longest))
    best, why = None, ""
    eps = [e for e in (1, 2, 4, 8, 16, 32, 64) if num_gpus % e == 0] if shape.num_experts else [1]
    for ep in eps:
        for cp in (1, 2, 4, 8):
            if num_gpus % cp or (shape.num_experts and shape.num_experts % ep):
                continue
            t = TrainerShape(
                num_gpus=num_gpus,
                gpus_per_node=ps.gpus_per_node,
                ep=ep,
                cp=cp,
                micro_batch_tokens=micro,
                checkpointing=ps.checkpointing,
                optimizer_state_bytes=ps.optimizer_state_bytes,
            )
            step = predict_step(shape, gpu, t, batch_tokens, context)
            if step.memory_gib > gpu.memory_gib * 0.95:
                why = f"trainer needs {step.memory_gib:.0f} GiB per GPU (best layout tried: ep {ep}, cp {cp})"
                continue
            if best is None or step.step_s < best[1].step_s:
                best = (t, step)
    return (best[0], best[1], "") if best else (None, None, why or "no layout")


def sim_config(
    ps: PlanSettings, workload: Workload, point: InferencePoint, s: InferenceShape, shape: ModelShape, train_s: float
) -> PipelineSimConfig:
    prefill_per_token = s.num_gpus / point.prefill_tokens_per_s  # one rank prefills one sequence at a time
    p = workload.prompt_tokens
    prefill = TailDist(p50=p.p50 * prefill_per_token, tail_ratio=p.tail_ratio, kind=p.kind)
    weight_update = shape.total_params * 2 / ps.weight_stream_bytes_per_s
    return PipelineSimConfig(
        num_steps=ps.num_steps + ps.max_async_level + 2,  # margin: the last steps are not steady
        batch_size=ps.batch_size,
        group_size=ps.group_size,
        max_async_level=ps.max_async_level,
        max_off_policy_steps=ps.max_off_policy_steps,
        spare_batches=ps.spare_batches,
        in_flight_limit=max(ps.group_size, min(ps.in_flight_max, point.concurrency)),
        version_tracking=ps.version_tracking,
        capacity=point.concurrency,
        sequence_latency=prefill,
        completion_tokens=workload.completion_tokens,
        token_latency_s=point.tpot_s,
        num_turns=workload.num_turns,
        env_latency=workload.env_latency_s,
        train_step_s=train_s,
        weight_update_s=weight_update,
        weight_check_s=ps.weight_check_s,
        weights_poll_s=ps.weights_poll_s,
        batch_write_s=ps.batch_write_s,
        seed=ps.seed,
    )


def evaluate_split(
    shape: ModelShape,
    gpu: GpuSpec,
    inference_nodes: int,
    ps: PlanSettings,
    workload: Workload,
    a: InferenceAssumptions,
) -> Candidate:
    """The split's best candidate: its trainer layout with each inference option, simulated."""
    trainer_nodes = ps.num_nodes - inference_nodes
    options, why_i = inference_options(shape, gpu, inference_nodes, ps, workload, a)
    t, step, why_t = best_trainer(shape, gpu, trainer_nodes, ps, workload)
    if not options:
        return Candidate(inference_nodes, trainer_nodes, None, None, t, step, None, f"inference: {why_i}")
    if t is None or step is None:
        s, point = options[0]
        return Candidate(inference_nodes, trainer_nodes, s, point, None, None, None, f"trainer: {why_t}")
    cands = []
    for s, point in options:
        cand = Candidate(inference_nodes, trainer_nodes, s, point, t, step, None, num_steady=ps.num_steps)
        # decode speed at the batch the pipeline actually keeps running, not at the KV-limited maximum
        first = simulate(sim_config(ps, workload, point, s, shape, step.step_s))
        per_rank = max(1.0, first.mean_decoding / (s.dp * s.num_replicas))
        point.tpot_s = decode_step_s(shape, gpu, s, per_rank, workload.mean_sample_tokens() / 2, a)
        cand.sim = simulate(sim_config(ps, workload, point, s, shape, step.step_s))
        cands.append(cand)
    return max(cands, key=lambda c: c.steps_per_hour)


def plan(shape: ModelShape, gpu: GpuSpec, ps: PlanSettings, workload: Workload) -> list[Candidate]:
    """Every split, best first: feasible ones by steady-state steps/hour; within 1% of each other, lower mean token
    lag first, then fewer inference nodes."""
    a = InferenceAssumptions()
    cands = [evaluate_split(shape, gpu, k, ps, workload, a) for k in range(1, ps.num_nodes)]
    top = max((c.steps_per_hour for c in cands), default=0.0) or 1.0

    def key(c: Candidate) -> tuple:
        if not c.feasible or c.sim is None:
            return (1, 0, 0.0, c.inference_nodes)
        return (0, -round(math.log(c.steps_per_hour / top) / math.log(1.01)), c.sim.lag_mean, c.inference_nodes)

    return sorted(cands, key=key)
