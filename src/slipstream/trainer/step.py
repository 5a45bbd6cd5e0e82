"""One optimizer step on one TrainingBatch: forward/backward per micro-batch, clip, step; returns its metrics.

With several ranks every rank runs the same number of forward/backward passes (FSDP's collectives run in
lockstep): a rank with fewer micro-batches repeats its last one with its loss multiplied by 0. Metrics are
sums over all ranks' loss tokens.
"""

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from slipstream.config.trainer import LossConfig
from slipstream.models.common.moe import TopKRouter
from slipstream.parallel.dist import all_reduce_max, all_reduce_sum
from slipstream.parallel.grad import clip_divisor, clip_grad_norm, global_grad_norm
from slipstream.trainer.data import to_packed
from slipstream.trainer.logprobs import mixed_precision
from slipstream.trainer.loss import LossStats, rl_loss
from slipstream.transport.rollouts import MicroBatch, TrainingBatch

ImageInputsFn = Callable[[MicroBatch, torch.device], Any]
"""Vision-language models: a micro-batch's images as the model takes them (trainer/vlm_batch.py), None without."""


def train_step(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainingBatch,
    loss_config: LossConfig,
    max_grad_norm: float,
    device: torch.device,
    autocast_dtype: torch.dtype = torch.float32,
    image_inputs: ImageInputsFn | None = None,
) -> dict[str, float | None]:
    """Accumulate gradients of every micro-batch (each loss already divided by the step's loss-token count across
    ranks), clip the global gradient norm, step the optimizer and zero the gradients.

    `policy` (trainer/policy.py) maps (input_ids_T, position_ids_T, temperatures_T, loss_mask_T) to (logprobs_T,
    entropy_T), both 0 outside the loss mask, and says which tokens' loss this rank owns (`owned_tokens`).
    Its parameters are the float32 masters; with `autocast_dtype` bfloat16 the forward runs under autocast
    (backward follows it), so AdamW always updates float32 weights. `image_inputs` ([model.vlm]) turns the images a
    micro-batch carries into the model's inputs; a batch with images is refused without it.
    """
    if not batch.micro_batches:
        raise ValueError(f"batch of step {batch.step} rank {batch.rank} has no micro-batches")
    policy.train()
    total: LossStats | None = None
    entropy_sum = torch.zeros((), device=device)
    num_tokens = model_tokens = 0
    writes_out_trees = not policy.runs_prefix_trees(device)
    num_passes = all_reduce_max(len(batch.micro_batches), device)
    routers = [m for m in policy.modules() if isinstance(m, TopKRouter)]
    replay_sums = torch.zeros(3, dtype=torch.float64, device=device)  # (token-layers, replayed, agreeing)
    for i in range(num_passes):
        is_padding = i >= len(batch.micro_batches)
        mb = batch.micro_batches[min(i, len(batch.micro_batches) - 1)]
        packed = to_packed(mb, device)
        extra = _image_kwargs(mb, device, image_inputs, batch.step)
        with mixed_precision(device, autocast_dtype):
            # Only loss tokens go through the LM head: the loss and the logged entropy read nothing else.
            logprobs_T, entropy_T = policy(
                packed.input_ids_T,
                packed.position_ids_T,
                packed.temperatures_T,
                packed.loss_mask_T,
                replay_TRA=packed.replay_TRA,
                layout=packed.layout,
                **extra,
            )
        # Context parallelism: the cp ranks share this micro-batch, and each adds up the loss of its own tokens.
        owned_T = policy.owned_tokens(packed.num_tokens, device, packed.position_ids_T)
        loss, stats = rl_loss(
            logprobs_T,
            packed.inference_logprobs_T,
            packed.advantages_T,
            packed.loss_mask_T,
            num_loss_tokens=batch.num_loss_tokens,
            config=loss_config,
            position_ids_T=packed.position_ids_T,
            owned_T=owned_T,
        )
        if is_padding:
            (loss * 0.0).backward()  # keeps this rank in step with the others' collectives; adds no gradient
            continue
        if packed.replay_TRA is not None:
            # Each router counts the tokens its forward ran (a cp rank its shard; a prefix written out per sample
            # once per sample), so the fraction and the agreement are over the same token-layers.
            replay_sums += sum(r.replay_counts for r in routers if r.replay_counts is not None)
            for router in routers:
                router.replay_counts = None
        loss.backward()
        total = stats if total is None else total + stats
        summed_T = packed.loss_mask_T if owned_T is None else packed.loss_mask_T & owned_T
        entropy_sum += torch.where(summed_T, entropy_T, 0.0).sum()
        owned = packed.num_tokens if owned_T is None else int(owned_T.sum())
        num_tokens += owned
        model_tokens += packed.sample_tokens if writes_out_trees and packed.sample_tokens is not None else owned

    grad_norm, skipped = clip_and_step(policy, optimizer, max_grad_norm)
    metrics = summarize_step(total, entropy_sum, grad_norm, optimizer, batch, (num_tokens, model_tokens), replay_sums)
    return metrics | {"nonfinite/skipped": float(skipped)}


def _image_kwargs(
    mb: MicroBatch, device: torch.device, image_inputs: ImageInputsFn | None, step: int
) -> dict[str, Any]:
    """The policy's `images` argument for a micro-batch ({} for text models)."""
    if image_inputs is None:
        if mb.images:
            raise ValueError(
                f"the batch of step {step} carries images but the trainer's model is a text model: set [model.vlm] "
                "for a vision-language checkpoint, or train on an environment without images"
            )
        return {}
    images = image_inputs(mb, device)
    return {} if images is None else {"images": images}


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float) -> tuple[Tensor, bool]:
    """Clip the global gradient norm (over all ranks' shards), step, zero grads; return the norm before clipping
    and whether the step was skipped. A NaN/inf norm (the same on every rank) skips the optimizer step, so one
    bad batch cannot poison the weights or the Adam moments.

    torch's fused AdamW over plain (unsharded) parameters clips inside its own kernel: it divides each gradient by
    `grad_scale` as it reads it and skips the update where `found_inf` is set, which saves a read and a write of
    every gradient (the separate clipping pass: 9 ms of a 286 ms MoE step on an H100) and waits for nothing."""
    params = [p for p in model.parameters() if p.grad is not None]
    if _fused_adamw_clips(optimizer, params):
        norm = global_grad_norm(params)
        optimizer.grad_scale = clip_divisor(norm, max_grad_norm)
        optimizer.found_inf = (~torch.isfinite(norm)).float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        skipped = not bool(torch.isfinite(norm))
    else:
        norm = clip_grad_norm(params, max_grad_norm)
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def _fused_adamw_clips(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> bool:
    """torch's AdamW with fused=True, over parameters none of which is sharded (DTensor ops would refuse the plain
    scale tensors next to sharded gradients)."""
    fused = isinstance(optimizer, torch.optim.AdamW) and all(g.get("fused") for g in optimizer.param_groups)
    return fused and bool(params) and not any(isinstance(p, DTensor) for p in params)


def summarize_step(
    total: LossStats,
    entropy_sum: Tensor,
    grad_norm: Tensor,
    optimizer: torch.optim.Optimizer,
    batch: TrainingBatch,
    num_tokens: tuple[int, int],
    replay_sums: Tensor | None = None,
) -> dict[str, float | None]:
    """Exact means over the step's loss tokens on all ranks (None where a mean has no tokens); one all-reduce.
    `num_tokens`: this rank's (packed tokens, tokens its model ran: more where prefix trees were written out as their
    samples). `replay_sums`: router replay's (token-layers of replayed micro-batches, replayed, agreeing) here."""
    names = [f.name for f in fields(total)]
    local = [getattr(total, name).double() for name in names]
    local += [entropy_sum.double(), *torch.tensor(num_tokens, dtype=torch.float64, device=entropy_sum.device)]
    replay = replay_sums if replay_sums is not None else torch.zeros(3, dtype=torch.float64, device=entropy_sum.device)
    local += list(replay.unbind(0))
    values = all_reduce_sum(torch.stack(local)).tolist()
    replay_names = ["replay_token_layers", "replayed", "agreeing"]
    s = dict(zip([*names, "entropy_sum", "num_tokens", "num_model_tokens", *replay_names], values, strict=True))
    num_loss, num_masked = s["num_loss_tokens"], s["num_masked"]
    replay_metrics = {}
    if s["replay_token_layers"] > 0:
        replay_metrics = {
            "router/replayed_fraction": s["replayed"] / s["replay_token_layers"],
            "router/agreement": _mean(s["agreeing"], s["replayed"]),
        }
    return replay_metrics | {
        "loss": s["loss"],
        "mismatch_kl": _mean(s["mismatch_kl_sum"], num_loss),
        "mismatch_kl_masked": _mean(s["mismatch_kl_masked_sum"], num_masked),
        "mismatch_kl_unmasked": _mean(s["mismatch_kl_unmasked_sum"], num_loss - num_masked),
        "masked_fraction": _mean(num_masked, num_loss),
        "entropy": _mean(s["entropy_sum"], num_loss),
        "grad_norm": grad_norm.item(),
        "lr": optimizer.param_groups[0]["lr"],
        "num_loss_tokens": batch.num_loss_tokens,
        "num_tokens": int(s["num_tokens"]),
        "num_model_tokens": int(s["num_model_tokens"]),
    }


def _mean(value_sum: float, count: float) -> float | None:
    return value_sum / count if count > 0 else None
