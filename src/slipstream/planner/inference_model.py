"""Inference throughput, KV-cache capacity and memory per deployment shape (a roofline of vLLM decode).

A replica spans `nodes_per_replica` nodes: tp-way tensor parallel groups, dp of them (dp x tp GPUs); with expert
parallel the routed experts are split over all of the replica's GPUs, otherwise every tp group holds them all.
Decode step of a dp rank holding B sequences: weights read once (experts: those B x top_k tokens touch), K/V of
every sequence read, each at `hbm_efficiency` of HBM bandwidth, or the matmul FLOPs at `decode_mfu`, whichever is
slower, plus a per-layer latency of the tp all-reduces and the EP dispatch/combine. The per-layer latencies and
the efficiencies are assumptions (no GPU decode figure is recorded in benchmarks/RESULTS.md yet); every result
carries them in `assumptions`.
"""

import math
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig
from slipstream.planner.hardware import GpuSpec, ModelShape


class InferenceAssumptions(BaseConfig):
    """Efficiency figures of the inference roofline (stated in every plan)."""

    hbm_efficiency: float = Field(0.7, gt=0, le=1)
    """Share of HBM bandwidth decode reaches."""
    decode_mfu: float = Field(0.4, gt=0, le=1)
    """Share of the bf16 peak decode matmuls reach at large batch."""
    prefill_mfu: float = Field(0.5, gt=0, le=1)
    """Share of the bf16 peak prefill reaches."""
    tp_allreduce_s: float = Field(20e-6, ge=0)
    """Per layer and tp all-reduce (two per layer) in decode."""
    ep_dispatch_s: float = Field(60e-6, ge=0)
    """Per MoE layer: dispatch + combine of one decode step across the replica (intra-node)."""
    ep_inter_node_factor: float = Field(2.5, ge=1)
    """How much slower that is when the replica spans nodes (low-latency all-to-all over the NICs)."""
    step_overhead_s: float = Field(3e-3, ge=0)
    """Scheduler and launch overhead per decode step."""
    reserve_gib: float = Field(4.0, ge=0)
    """Per GPU memory for activations, CUDA graphs and the NCCL buffers."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """vLLM's gpu_memory_utilization."""


class InferenceShape(BaseConfig):
    """One inference deployment shape."""

    tp: int = Field(ge=1)
    """Tensor-parallel size of each engine."""
    dp: int = Field(ge=1)
    """Data-parallel ranks per replica."""
    ep: bool
    """Experts split over the replica's tp x dp GPUs."""
    nodes_per_replica: int = Field(ge=1)
    """Nodes one replica spans."""
    num_replicas: int = Field(ge=1)
    """Independent replicas (behind the router)."""
    weight_bytes: Literal[1, 2] = 2
    """1: FP8 weights, 2: bf16."""

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.dp

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_replica * self.num_replicas

    def label(self) -> str:
        ep = " ep" if self.ep else ""
        return f"{self.num_replicas} x (tp{self.tp} dp{self.dp}{ep}, {self.nodes_per_replica} node(s))"


@dataclass
class InferencePoint:
    """Predicted operating point of a deployment at a given workload."""

    feasible: bool
    why: str
    weights_gib_per_gpu: float
    kv_tokens_per_gpu: float
    concurrency: int
    """Sequences that fit in the KV cache over the whole deployment (at the workload's mean sequence length)."""
    tpot_s: float
    """Seconds per generated token of one sequence at that concurrency (the plan then sets it at the decode batch
    its simulation keeps running)."""
    tokens_per_s: float
    """Decode tokens/s over the deployment at that operating point."""
    prefill_tokens_per_s: float
    assumptions: dict[str, float] = field(default_factory=dict)


def weights_per_gpu(shape: ModelShape, s: InferenceShape) -> float:
    dense = shape.dense_params / s.tp
    experts = shape.expert_params / (s.gpus_per_replica if s.ep else s.tp)
    return (dense + experts) * s.weight_bytes


def kv_bytes_per_token_per_gpu(shape: ModelShape, s: InferenceShape) -> float:
    """GQA heads split over tp (never below one head); a latent cache is replicated over tp."""
    if shape.kv_bytes_per_token is not None:
        return shape.kv_bytes()
    return shape.kv_bytes() / min(s.tp, shape.num_kv_heads)


def decode_step_s(
    shape: ModelShape, gpu: GpuSpec, s: InferenceShape, batch: float, context: float, a: InferenceAssumptions
) -> float:
    """One decode step of a dp rank holding `batch` sequences of mean context `context`."""
    bw = gpu.hbm_bytes_per_s * a.hbm_efficiency
    dense = shape.dense_params / s.tp * s.weight_bytes
    tokens_routed = batch * (s.dp if s.ep else 1) * shape.top_k / max(shape.num_experts, 1)
    touched = 1 - math.exp(-tokens_routed) if shape.num_experts else 0.0  # share of experts some token routes to
    experts = shape.expert_params / (s.gpus_per_replica if s.ep else s.tp) * s.weight_bytes * touched
    ctx = shape.attention_context(context)
    kv_read = batch * ctx * kv_bytes_per_token_per_gpu(shape, s)
    if shape.attention == "sparse":
        kv_read += batch * context * 128 / s.tp  # the indexer's small keys over the whole context (assumed)
    memory_s = (dense + experts + kv_read) / bw
    flops = 2 * batch * shape.active_params / s.tp
    compute_s = flops / (gpu.peak_bf16_flops * a.decode_mfu)
    comm = 2 * shape.num_layers * a.tp_allreduce_s if s.tp > 1 else 0.0
    if s.ep and s.gpus_per_replica > 1:
        factor = a.ep_inter_node_factor if s.nodes_per_replica > 1 else 1.0
        comm += shape.num_moe_layers * a.ep_dispatch_s * factor
    return max(memory_s, compute_s) + comm + a.step_overhead_s


def operating_point(
    shape: ModelShape,
    gpu: GpuSpec,
    s: InferenceShape,
    mean_seq_tokens: float,
    max_num_seqs: int,
    a: InferenceAssumptions | None = None,
) -> InferencePoint:
    """KV capacity, concurrency and decode speed of deployment `s` for sequences of `mean_seq_tokens` on average."""
    a = a or InferenceAssumptions()
    usable = gpu.memory_gib * 2**30 * a.gpu_memory_utilization - a.reserve_gib * 2**30
    weights = weights_per_gpu(shape, s)
    kv_tokens = max(0.0, usable - weights) / kv_bytes_per_token_per_gpu(shape, s)
    # a dp rank's KV lives on its tp GPUs; concurrency counts sequences over all dp ranks and replicas
    per_rank = min(max_num_seqs, int(kv_tokens // max(mean_seq_tokens, 1.0)))
    concurrency = per_rank * s.dp * s.num_replicas
    assumptions = a.model_dump()
    if weights > usable:
        why = f"weights need {weights / 2**30:.0f} GiB per GPU, {usable / 2**30:.0f} GiB usable"
        return InferencePoint(False, why, weights / 2**30, 0, 0, float("inf"), 0.0, 0.0, assumptions)
    if per_rank < 1:
        why = f"no sequence of {mean_seq_tokens:.0f} tokens fits the {kv_tokens:.0f}-token KV cache of a rank"
        return InferencePoint(False, why, weights / 2**30, kv_tokens, 0, float("inf"), 0.0, 0.0, assumptions)
    tpot = decode_step_s(shape, gpu, s, per_rank, mean_seq_tokens / 2, a)
    prefill = gpu.peak_bf16_flops * a.prefill_mfu * s.num_gpus / (2 * shape.active_params)
    return InferencePoint(
        True, "", weights / 2**30, kv_tokens, concurrency, tpot, concurrency / tpot, prefill, assumptions
    )


def candidate_shapes(shape: ModelShape, num_nodes: int, gpus_per_node: int, weight_bytes: Literal[1, 2]) -> list:
    """Deployment shapes over `num_nodes` whole nodes: tp in 1..gpus_per_node, replicas of 1, 2, 4... nodes."""
    shapes = []
    for nodes_per_replica in (1, 2, 4, 8, 16):
        if nodes_per_replica > num_nodes or num_nodes % nodes_per_replica:
            continue
        tp = 1
        while tp <= gpus_per_node:
            dp = nodes_per_replica * gpus_per_node // tp
            for ep in (True, False) if shape.num_experts else (False,):
                if ep and dp * tp == 1:
                    continue
                shapes.append(
                    InferenceShape(
                        tp=tp,
                        dp=dp,
                        ep=ep,
                        nodes_per_replica=nodes_per_replica,
                        num_replicas=num_nodes // nodes_per_replica,
                        weight_bytes=weight_bytes,
                    )
                )
            tp *= 2
    return shapes
