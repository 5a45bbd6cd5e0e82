"""Activation checkpointing per transformer block (state-dict keys unchanged), in one of two modes:

- full: the block keeps only its input; backward recomputes its whole forward, attention included;
- keep_attention (the default): as full, but each attention kernel's outputs (the attention output and its
  log-sum-exp, T x H x K x 2 bytes and T x H x 4 bytes per block) are saved, so backward reruns everything except
  the attention kernel, the most expensive op to recompute. Measured on an H100 (benchmarks/RESULTS.md). Under
  expert parallelism the outputs of the all-to-alls are saved too (parallel/ep.py: per MoE block, the ep x N rows
  a rank's experts received, in the compute dtype, and the ep x N partial sums it got back, in float32; N = its
  tokens): the recomputation exchanges nothing between ranks.

Both give the same gradients as no checkpointing (the recomputation is deterministic: no dropout here).
"""

import importlib
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten


def attention_ops() -> set:
    """The attention kernels' ops on every path of models/common/attention.py (and linear attention's delta rule), as
    the checkpoint policy sees them."""
    ops = {
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._flash_attention_forward.default,
        aten._efficient_attention_forward.default,
        aten._cudnn_attention_forward.default,
    }
    flex = getattr(
        importlib.import_module("torch._higher_order_ops"), "flex_attention", None
    )  # trainer.packed_attention = "flex"
    if flex is not None:
        ops.add(flex)
    try:  # qwen3_5_moe's linear attention (models/qwen3_5_moe/delta_rule.py), registered when its module is imported
        ops.add(torch.ops.slipstream.chunk_gated_delta_rule.default)
    except AttributeError:
        pass
    try:  # torch >= 2.10: the packed (varlen) path is a custom op, registered when its module is imported
        importlib.import_module("torch.nn.attention.varlen")  # (an import statement would make `torch` local here)
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    return ops


def exchange_ops() -> set:
    """The functional all-to-all that expert parallelism's exchanges run as (parallel/ep.py), as the policy sees it."""
    ops = set()
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        packet = getattr(getattr(torch.ops, namespace), "all_to_all_single", None)
        if packet is not None:
            ops.add(packet.default)
    return ops


def _keep_attention_policy(ops: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_context():
    """The selective-checkpoint contexts that save the attention kernels' and the expert all-to-alls' outputs and
    recompute the rest."""
    return create_selective_checkpoint_contexts(partial(_keep_attention_policy, attention_ops() | exchange_ops()))


def _ignore_profiler_ops() -> None:
    """Selective checkpointing matches every op of the recomputation to the forward's by invocation count; the
    profiler's record_function markers (which c10d collectives open, e.g. expert parallelism's all_to_all under
    context parallelism) do not repeat one for one there, and then the recomputation fails ("invocation index ...
    not found in storage"). They carry no values: torch's public SAC_IGNORED_OPS (which already holds detach and
    similar ops) is where such ops go."""
    profiler = torch.ops.profiler
    for packet in (
        profiler._record_function_enter,
        profiler._record_function_enter_new,
        profiler._record_function_exit,
    ):
        SAC_IGNORED_OPS.update(getattr(packet, name) for name in packet.overloads())


_ignore_profiler_ops()


def checkpoint_block(block: nn.Module, keep_attention: bool) -> nn.Module:
    """`block` wrapped for activation checkpointing (no RNG state: no dropout in RL/SFT here)."""
    if keep_attention:
        return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=keep_attention_context)
    return checkpoint_wrapper(block, preserve_rng_state=False)
