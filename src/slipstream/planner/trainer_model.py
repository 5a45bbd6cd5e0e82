"""Trainer step time and memory per GPU: a throughput model calibrated on benchmarks/RESULTS.md.

Per token and GPU, time = matmuls at the measured bf16 rate + routed experts at a fitted grouped rate + attention
from the measured kernel times (linear in context) + an elementwise term (norms, RoPE, casts, loss) fitted per
layer x hidden + AdamW over the local parameters at HBM speed. On top: FSDP traffic (all-gather of bf16 weights,
reduce-scatter of fp32 gradients, hidden behind compute by prefetching, so only its excess counts), expert-parallel
all-to-all (dispatch + combine per MoE layer, forward, backward and recomputation) and context-parallel all-gather
of K/V, both exposed. Two constants are fitted (`fit_calibration`); the rest are measured figures, each cited.
"""

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from slipstream.config.base import BaseConfig
from slipstream.planner.hardware import GpuSpec, ModelShape

Checkpointing = Literal["none", "keep_attention", "full"]


class TrainerCalibration(BaseConfig):
    """Constants of the throughput model (H100 figures; an H200 differs only in HBM bandwidth)."""

    matmul_flops_per_s: float = Field(740e12, gt=0)
    """bf16 matmuls in a training step: 740 TFLOP/s ("Where the packed dense step goes", RESULTS.md)."""
    attn_base_ns: float = Field(6.25, ge=0)
    """Attention forward + backward per token, layer and query head at zero context, ns."""
    attn_per_ctx_ns: float = Field(0.00125, ge=0)
    """... and per token of context. Both from RESULTS.md's kernel times (16 heads: cuDNN causal at 16384 tokens
    1.9 + 5.1 ms per layer; flash varlen 8 x 2048 2.31 ms)."""
    attn_forward_share: float = Field(0.27, ge=0, le=1)
    """Forward's share of attention time (1.9 of 7.0 ms), recomputed under full checkpointing."""
    elementwise_ns: float = Field(0.190, ge=0)
    """Per token, layer and hidden unit on an H100 (`fit_calibration` on RESULTS.md's Qwen3-0.6B 1 x 16384 full
    checkpointing row, 37,589 tokens/s; tests/unit/test_planner_trainer_model.py keeps the two in step)."""
    expert_flops_per_s: float = Field(153e12, gt=0)
    """Routed-expert matmuls including routing and row movement (`fit_calibration` on the Qwen3-30B-A3B 4-layer
    1 x 16384 row, 60,206 tokens/s). Fitted on experts 768 wide: wider experts (larger GEMMs) likely run faster."""
    lm_head_loss_share: float = Field(0.8, gt=0, le=1)
    """Tokens that go through the LM head (loss tokens; the benchmarks' 20% prompt)."""
    collective_efficiency: float = Field(0.5, gt=0, le=1)
    """Share of link bandwidth an all-to-all or all-gather reaches (RESULTS.md weight stream: 0.43-0.59 of a
    raw broadcast)."""


class TrainerShape(BaseConfig):
    """How the trainer is laid out: GPUs, expert and context parallel degrees, checkpointing, optimizer state."""

    num_gpus: int = Field(ge=1)
    """Trainer GPUs in all (FSDP over all of them)."""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs per node: collectives within a node use NVLink, wider ones the network."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (trainer.parallel.ep)."""
    cp: int = Field(1, ge=1)
    """Context-parallel degree (trainer.parallel.cp)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Tokens of one micro-batch before the cp split (activations are held for one at a time); None: all of a
    GPU's tokens at once."""
    checkpointing: Checkpointing = "keep_attention"
    """Activation checkpointing: none, every block but attention outputs kept (the default), or full."""
    optimizer_state_bytes: int = Field(8, ge=0)
    """Bytes of AdamW moments per parameter: 8 (float32), 4 (bfloat16)."""


@dataclass
class TrainerStep:
    """Predicted trainer step on one GPU (all GPUs do the same)."""

    step_s: float
    compute_s: float
    fsdp_s: float
    all_to_all_s: float
    cp_s: float
    tokens_per_s_per_gpu: float
    memory_gib: float


def _hbm_scale(gpu: GpuSpec) -> float:
    return 3.35e12 / gpu.hbm_bytes_per_s


def compute_time_per_token(
    shape: ModelShape, gpu: GpuSpec, context: float, checkpointing: Checkpointing, cal: TrainerCalibration
) -> float:
    """Seconds of GPU compute per token (one GPU holding the whole token path), no communication."""
    recompute = checkpointing != "none"
    layer_flops = (8 if recompute else 6) * shape.active_dense_matmul_params
    head_flops = 6 * shape.vocab * shape.hidden * cal.lm_head_loss_share
    expert_flops = (8 if recompute else 6) * shape.active_expert_params
    ctx = shape.attention_context(context)
    attn_ns = shape.num_layers * shape.num_heads * (cal.attn_base_ns + cal.attn_per_ctx_ns * ctx)
    if checkpointing == "full":
        attn_ns *= 1 + cal.attn_forward_share
    elementwise_ns = cal.elementwise_ns * shape.num_layers * shape.hidden * _hbm_scale(gpu)
    return (
        (layer_flops + head_flops) / cal.matmul_flops_per_s
        + expert_flops / cal.expert_flops_per_s
        + (attn_ns + elementwise_ns) * 1e-9
    )


def _link(gpu: GpuSpec, group: int, gpus_per_node: int, cal: TrainerCalibration) -> float:
    raw = gpu.intra_node_bytes_per_s if group <= gpus_per_node else gpu.inter_node_bytes_per_s
    return raw * cal.collective_efficiency


def local_params(shape: ModelShape, t: TrainerShape) -> float:
    """Parameters each GPU owns: dense ones sharded over all GPUs, experts over EP then FSDP-sharded further."""
    return (shape.dense_params + shape.expert_params) / t.num_gpus


def predict_step(
    shape: ModelShape,
    gpu: GpuSpec,
    t: TrainerShape,
    batch_tokens: float,
    context: float,
    cal: TrainerCalibration | None = None,
) -> TrainerStep:
    """Step time of `batch_tokens` tokens (samples of mean length `context`) over the trainer's GPUs."""
    cal = cal or TrainerCalibration()
    tokens = batch_tokens / (t.num_gpus // t.cp) / t.cp  # each GPU: its data-parallel share, 1/cp of each sample
    compute = tokens * compute_time_per_token(shape, gpu, context, t.checkpointing, cal)
    owned = local_params(shape, t)
    compute += owned * 16 / gpu.hbm_bytes_per_s  # AdamW: read/write masters, gradients, moments
    fsdp = 0.0
    if t.num_gpus > 1:
        shard = t.num_gpus if t.ep == 1 else t.num_gpus // t.ep
        frac = (shard - 1) / shard if shard > 1 else 0.0
        dense_frac = (t.num_gpus - 1) / t.num_gpus
        traffic = shape.dense_params * dense_frac * (2 + 2 + 4) + shape.expert_params / t.ep * frac * (2 + 2 + 4)
        fsdp = traffic / _link(gpu, t.num_gpus, t.gpus_per_node, cal)
    a2a = 0.0
    if t.ep > 1 and shape.num_moe_layers:
        # parallel/ep.py: each token goes once to every other rank of its ep group (bf16 row) and its float32 partial
        # sum comes back; backward sends both gradients back; a full recomputation repeats the forward's exchanges
        # (keep_attention saves their outputs).
        passes = 3 if t.checkpointing == "full" else 2
        per_token = shape.hidden * (2 + 4) * passes * shape.num_moe_layers * (t.ep - 1)
        a2a = tokens * per_token / _link(gpu, t.ep, t.gpus_per_node, cal)
    cp = 0.0
    if t.cp > 1:
        kv = shape.kv_bytes() * 2  # gather K/V forward, reduce their gradients backward
        cp = tokens * t.cp * kv * (t.cp - 1) / t.cp / _link(gpu, t.cp, t.gpus_per_node, cal)
    step = max(compute, fsdp) + a2a + cp
    return TrainerStep(
        step_s=step,
        compute_s=compute,
        fsdp_s=fsdp,
        all_to_all_s=a2a,
        cp_s=cp,
        tokens_per_s_per_gpu=tokens / step,
        memory_gib=trainer_memory_gib(shape, t, min(tokens, (t.micro_batch_tokens or tokens * t.cp) / t.cp), context),
    )


def trainer_memory_gib(shape: ModelShape, t: TrainerShape, tokens_per_gpu: float, context: float) -> float:
    # tokens_per_gpu: those whose activations are held at once (one micro-batch's share)
    """Peak memory per GPU: float32 masters and gradients + moments of the owned shard, one gathered layer in
    bf16 (two, with prefetch), saved activations and the chunked LM head's working set."""
    owned = local_params(shape, t)
    states = owned * (4 + 4 + t.optimizer_state_bytes)
    layer = (
        shape.dense_params - 2 * shape.vocab * shape.hidden
    ) / shape.num_layers + shape.expert_params_per_layer / t.ep
    gathered = 2 * 2 * layer + 2 * shape.vocab * shape.hidden if t.num_gpus > 1 else 0.0
    per_layer_saved = {"none": 34, "keep_attention": 4, "full": 2}[t.checkpointing] * shape.hidden
    activations = tokens_per_gpu * per_layer_saved * shape.num_layers + tokens_per_gpu * 34 * shape.hidden
    if shape.num_moe_layers:
        activations += tokens_per_gpu * shape.top_k * (shape.hidden + 3 * shape.moe_intermediate) * 2
    head = 8192 * shape.vocab * 4  # one float32 chunk of logits
    return (states + gathered + activations + head) / 2**30


@dataclass(frozen=True)
class Measured:
    """One recorded trainer figure: a shape, a layout and the tokens/s per GPU it reached."""

    label: str
    shape: ModelShape
    gpu: str
    trainer: TrainerShape
    tokens_per_gpu: int
    context: int
    tokens_per_s_per_gpu: float


def fit_calibration(dense: Measured, moe: Measured, base: TrainerCalibration | None = None) -> TrainerCalibration:
    """Fit `elementwise_ns` on a dense figure, then `expert_flops_per_s` on a MoE one (both single-GPU, H100)."""
    from slipstream.planner.hardware import GPUS

    cal = (base or TrainerCalibration()).model_copy(update={"elementwise_ns": 0.0})
    for m in (dense, moe):
        if m.trainer.num_gpus != 1:
            raise ValueError(f"{m.label}: calibrate on single-GPU figures")
    gpu = GPUS[dense.gpu]
    shape = dense.shape
    target = dense.tokens_per_gpu / dense.tokens_per_s_per_gpu
    rest = predict_step(shape, gpu, dense.trainer, dense.tokens_per_gpu, dense.context, cal).step_s
    per_unit = dense.tokens_per_gpu * shape.num_layers * shape.hidden * 1e-9 * _hbm_scale(gpu)
    cal = cal.model_copy(update={"elementwise_ns": (target - rest) / per_unit})
    shape, gpu = moe.shape, GPUS[moe.gpu]
    target = moe.tokens_per_gpu / moe.tokens_per_s_per_gpu
    no_experts = cal.model_copy(update={"expert_flops_per_s": 1e30})
    rest = predict_step(shape, gpu, moe.trainer, moe.tokens_per_gpu, moe.context, no_experts).step_s
    recompute = 8 if moe.trainer.checkpointing != "none" else 6
    expert_flops = moe.tokens_per_gpu * recompute * shape.active_expert_params
    return cal.model_copy(update={"expert_flops_per_s": expert_flops / (target - rest)})
