"""Apply parallelism to a model from outside, in DESIGN order: expert parallelism (parallel/ep.py), activation
checkpointing per transformer block, then (optionally) torch.compile per block, then FSDP2 (`fully_shard`) per block
(EP-sharded experts first, on their own mesh) and on the root, with the mixed-precision policy of the compute dtype.
Context parallelism needs no module change: the policy shards each row itself (parallel/cp.py).

Gradients are SUMMED over data-parallel ranks, not averaged: the trainer's loss is already divided by the step's
loss-token count across all ranks, so the sum is the gradient of the step's mean loss.
"""

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from slipstream.config.trainer import ParallelConfig
from slipstream.parallel.ac import checkpoint_block
from slipstream.parallel.ep import apply_expert_parallel, install_capacity_hooks
from slipstream.parallel.mesh import TrainerMesh


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the shallowest nn.ModuleList named `layers` (ours: `layers`; transformers:
    `model.layers`; either under a wrapper)."""
    candidates = [
        (name.count("."), name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers"
    ]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList named 'layers' holding its transformer blocks; "
            "parallel/ shards and checkpoints per block and needs one"
        )
    return min(candidates, key=lambda c: c[:2])[2]


def fsdp_param_dtype(compute_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """Dtype FSDP all-gathers parameters in: the compute dtype on GPUs (bf16 params, fp32 gradient reduction);
    float32 on CPU, where the trainer runs bf16 matmuls under autocast instead."""
    return compute_dtype if device_type == "cuda" else torch.float32


def build_mp_policy(compute_dtype: torch.dtype, device_type: str) -> MixedPrecisionPolicy:
    """Parameters in `fsdp_param_dtype`, gradients reduced in float32. Forward inputs are never cast: they include
    per-token sampling temperatures that must stay float32."""
    return MixedPrecisionPolicy(
        param_dtype=fsdp_param_dtype(compute_dtype, device_type),
        reduce_dtype=torch.float32,
        cast_forward_inputs=False,
    )


def apply_activation_checkpointing(model: nn.Module, keep_attention: bool = True) -> None:
    """Wrap every transformer block so its activations are recomputed in backward (parallel/ac.py: with
    `keep_attention`, all but the attention kernels' outputs)."""
    blocks = find_blocks(model)
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_block(block, keep_attention)


def apply_compile(model: nn.Module) -> None:
    """torch.compile every transformer block in place (`nn.Module.compile`: state-dict keys unchanged). Blocks of
    one model share their code, so one compilation serves them all; a block already wrapped for activation
    checkpointing is compiled with its recomputation, which Inductor then plans itself.

    MoE layers record detached statistics on themselves in forward (common/moe.py: tokens per expert, router
    replay counts). Inside a checkpointed region Dynamo refuses such attribute writes by default and runs the
    whole block eagerly (measured on an H100: every MoE block of the Qwen3-30B-A3B cut ran uncompiled). Eager
    checkpointing writes them in forward and writes the same values again in the recomputation; skipping the second
    write (Dynamo's `skip_fwd_side_effects_in_bwd_under_checkpoint`) gives the same statistics and a compiled block
    (tests/unit/test_compile_moe.py). A torch without that setting compiles the same blocks with that break."""
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in find_blocks(model):
        block.compile()


def hook_at_block(unit: FSDPModule, block: nn.Module) -> None:
    """Run the FSDP unit `unit`'s forward hooks (all-gather before, reshard and the backward hooks after) on `block`,
    the outermost module of the transformer block holding it, instead of on `unit` itself.

    The experts' unit lives on its own mesh (`expert_fsdp`), so it cannot share the block's unit, and its hooks
    would fire inside the block: torch.compile does not trace FSDP hooks, and a graph break inside an
    activation-checkpointed block runs that whole block eagerly (what kept FSDP x EP blocks uncompiled). At the
    block's boundary they fire where the block's own unit's do, outside the compiled, checkpointed body: the
    experts are gathered before the block runs and released after it (the recomputation in backward finds them
    gathered by the pre-backward hook on the block's outputs), and their gradients are reduce-scattered once the
    block's input gradients exist, which is after every expert gradient of the block. The values are the same:
    only when the unit gathers and releases moves (tests/distributed/test_ep_exchange.py).

    FSDP2 has no public way to hook a unit on another module: this re-registers the unit's own hook methods and
    needs the handles FSDP keeps for them (torch 2.4 to 2.13 have them). A torch without them fails here, naming it."""
    state = unit._get_fsdp_state()
    pre = getattr(state, "_pre_forward_hook_handle", None)
    post = getattr(state, "_post_forward_hook_handle", None)
    if pre is None or post is None or pre is post:
        raise RuntimeError(
            f"torch {torch.__version__}: FSDP's state keeps no separate forward hook handles, which parallel/fsdp.py "
            "needs to run the experts' FSDP unit at the block's boundary; use torch 2.4 to 2.13, or ep equal to "
            "dp_shard x cp (no expert_fsdp) without cpu_offload"
        )
    pre.remove()
    post.remove()
    state._pre_forward_hook_handle = block.register_forward_pre_hook(state._pre_forward, prepend=True, with_kwargs=True)
    state._post_forward_hook_handle = block.register_forward_hook(state._post_forward, prepend=False)


def parallelize_model(
    model: nn.Module,
    mesh: TrainerMesh | None,
    config: ParallelConfig,
    compute_dtype: torch.dtype = torch.float32,
    compile: bool = False,
    experts: Sequence[nn.Module] = (),
    cpu_offload: bool = False,
    extra_blocks: Sequence[nn.Module] = (),
) -> nn.Module:
    """Expert parallelism over `mesh.ep` for the stacked-experts modules `experts` (when ep > 1), activation
    checkpointing (if configured), then torch.compile per block (if `compile`), then FSDP2 per block and on `model`
    (the root, which then owns the remaining parameters: embeddings, final norm, LM head). EP-sharded experts get
    their own FSDP unit over `mesh.expert_fsdp`. Without a mesh (one rank) nothing is sharded. Returns `model`,
    modified in place; its parameters end up on the mesh's device, or in (pinned) CPU memory with `cpu_offload`
    (FSDP2's CPUOffloadPolicy: sharded masters, their gradients and so the optimizer state stay on the CPU; each
    block's parameters are copied to the GPU for its forward and backward). `extra_blocks` (a trained vision
    encoder's blocks) become FSDP units of their own, ahead of the transformer blocks."""
    expert_parallel = mesh is not None and mesh.ep is not None
    capacity = apply_expert_parallel(experts, mesh.ep) if expert_parallel else None
    if config.activation_checkpointing:
        apply_activation_checkpointing(model, config.activation_checkpointing_keep_attention)
    if capacity is not None:
        install_capacity_hooks(capacity, model, find_blocks(model))
    if compile:
        apply_compile(model)
    if mesh is None:
        return model
    policy = build_mp_policy(compute_dtype, mesh.device_type)
    shard = dict(mp_policy=policy, offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    sharded_experts = {id(m) for m in experts} if expert_parallel else set()
    if expert_parallel and mesh.expert_fsdp.size() == 1 and not cpu_offload:
        # EP alone shards the experts (no other rank holds the same ones): an FSDP unit of theirs would have nothing
        # to gather or reduce, and its hooks, inside the block, are a graph break that runs a compiled,
        # checkpointed block eagerly. FSDP leaves them alone; their matmuls run in FSDP's parameter dtype
        # (parallel/ep.py: TokenDispatch.compute_dtype) and their float32 gradients are already summed over the
        # ep group by the all-to-all's backward.
        shard["ignored_params"] = {param for module in experts for param in module.parameters()}
        for module in experts:
            module.token_dispatch.compute_dtype = policy.param_dtype
        sharded_experts = set()
    for block in extra_blocks:
        fully_shard(block, mesh=mesh.fsdp, **shard)
    blocks = find_blocks(model)
    for i, block in enumerate(blocks):
        # The last block's parameters would be all-gathered again at once for backward: keep them.
        reshard = i < len(blocks) - 1
        for module in block.modules():
            if id(module) in sharded_experts:
                fully_shard(module, mesh=mesh.expert_fsdp, reshard_after_forward=reshard, **shard)
                hook_at_block(module, block)
        fully_shard(block, mesh=mesh.fsdp, reshard_after_forward=reshard, **shard)
    fully_shard(model, mesh=mesh.fsdp, **shard)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model
