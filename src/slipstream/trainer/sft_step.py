"""One SFT optimizer step and the validation loss: cross-entropy of the loss tokens as an exact per-token mean over
the whole step (every rank and micro-batch divides its sum by the step's global loss-token count, known to every
rank before the step since all ranks see the same data; FSDP sums gradients over ranks, parallel/fsdp.py).

As in trainer/step.py, every rank runs the same number of passes (FSDP's collectives run in lockstep): a rank with
fewer micro-batches repeats its last one with its loss multiplied by 0.

Legend: T = tokens of a packed micro-batch.
"""

import math

import torch
from torch import Tensor

from slipstream.parallel.dist import all_reduce_max, all_reduce_sum
from slipstream.trainer.logprobs import mixed_precision
from slipstream.trainer.row_layout import tree_row_costs
from slipstream.trainer.setup import Trainer
from slipstream.trainer.sft_data import pack_micro_batches, packed_micro_batch
from slipstream.trainer.sft_render import SFTSample
from slipstream.trainer.sft_trees import PrefixSharing, TreeCost, Unit
from slipstream.trainer.step import clip_and_step


def sft_loss(logprobs_T: Tensor, loss_mask_T: Tensor, num_loss_tokens: int, owned_T: Tensor | None = None) -> Tensor:
    """-(sum of the log-probs of this rank's loss tokens) / `num_loss_tokens` (the whole step's count, all ranks).
    `owned_T` (context parallelism): the tokens whose loss this rank adds up."""
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be > 0 (got {num_loss_tokens})")
    mask_T = loss_mask_T if owned_T is None else loss_mask_T & owned_T
    return -torch.where(mask_T, logprobs_T, 0.0).sum() / num_loss_tokens


def prefix_sharing(trainer: Trainer, shared_prefix: bool, min_prefix_tokens: int) -> PrefixSharing | None:
    """How this trainer's micro-batches share prefixes (SFTConfig.shared_prefix): None (conversations packed whole)
    when sharing is off, or where the policy would write a tree back out as its conversations (CUDA without context
    parallelism, transformers models, recurrent layers): the same result, and micro_batch_tokens then bounds what
    actually runs."""
    policy = trainer.policy
    if not shared_prefix or not policy.runs_prefix_trees(trainer.device):
        return None
    per_token, per_pair = tree_row_costs(policy.model, policy.context_parallel is not None)
    return PrefixSharing(min_prefix_tokens, TreeCost(per_token, per_pair))


def run_passes(trainer: Trainer, micro_batches: list[list[Unit]], num_loss_tokens: int, backward: bool) -> Tensor:
    """Forward (and backward) of every micro-batch; returns this rank's share of the step's mean loss (detached)."""
    device, policy = trainer.device, trainer.policy
    num_passes = all_reduce_max(len(micro_batches), device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(num_passes):
        is_padding = i >= len(micro_batches)
        packed = packed_micro_batch(micro_batches[min(i, len(micro_batches) - 1)], device)
        with mixed_precision(device, trainer.autocast_dtype):
            logprobs_T, _ = policy(
                packed.input_ids_T,
                packed.position_ids_T,
                packed.temperatures_T,
                packed.loss_mask_T,
                layout=packed.layout,
            )
        owned_T = policy.owned_tokens(packed.num_tokens, device, packed.position_ids_T)
        loss = sft_loss(logprobs_T, packed.loss_mask_T, num_loss_tokens, owned_T)
        if is_padding:
            if backward:
                (loss * 0.0).backward()  # keeps this rank in step with the others' collectives; adds no gradient
            continue
        if backward:
            loss.backward()
        loss_sum += loss.detach().double()
    return loss_sum


def sft_step(
    trainer: Trainer,
    step_samples: list[SFTSample],
    rank_samples: list[SFTSample],
    micro_batch_tokens: int,
    max_grad_norm: float,
    sharing: PrefixSharing | None = None,
) -> dict[str, float]:
    """Train on `rank_samples` (this data rank's share of the step's `step_samples`; prefix trees with `sharing`),
    clip, step; returns the step's mean loss per loss token over all ranks, the gradient norm, and the tokens the
    forward passes ran over all data ranks (`num_packed_tokens`: a shared prefix once per tree)."""
    if not rank_samples:
        raise ValueError("this rank has no samples in the step: batch_size must be >= world_size / cp")
    trainer.policy.train()
    num_loss_tokens = sum(s.num_loss_tokens for s in step_samples)
    micro_batches = pack_micro_batches(rank_samples, micro_batch_tokens, sharing)
    loss_sum = run_passes(trainer, micro_batches, num_loss_tokens, backward=True)
    grad_norm, skipped = clip_and_step(trainer.policy, trainer.optimizer, max_grad_norm)
    return {
        "loss": float(all_reduce_sum(loss_sum)),
        "grad_norm": grad_norm.item(),
        "nonfinite/skipped": float(skipped),
        "num_loss_tokens": num_loss_tokens,
        "num_tokens": sum(s.num_tokens for s in step_samples),
        "num_packed_tokens": packed_tokens(trainer, micro_batches),
        "num_micro_batches": len(micro_batches),
    }


def packed_tokens(trainer: Trainer, micro_batches: list[list[Unit]]) -> int:
    """Tokens of the micro-batches of every data rank (the cp ranks of a group hold the same ones: counted once)."""
    local = sum(u.num_tokens for mb in micro_batches for u in mb)
    total = all_reduce_sum(torch.tensor(local, dtype=torch.float64, device=trainer.device))
    return round(float(total) * trainer.num_data_ranks / trainer.world_size)


@torch.no_grad()
def validation_loss(
    trainer: Trainer,
    samples: list[SFTSample],
    micro_batch_tokens: int,
    data_rank: int,
    num_data_ranks: int,
    sharing: PrefixSharing | None = None,
) -> dict[str, float]:
    """Mean loss per loss token of `samples` (all ranks together) and its perplexity."""
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    share = samples[data_rank::num_data_ranks] or samples[:1]  # a rank without samples still runs the passes
    micro_batches = pack_micro_batches(share, micro_batch_tokens, sharing)
    was_training = trainer.policy.training
    trainer.policy.eval()
    try:
        loss_sum = run_passes(trainer, micro_batches, num_loss_tokens, backward=False)
    finally:
        trainer.policy.train(was_training)
    if data_rank >= len(samples):
        loss_sum.zero_()  # its passes repeated another rank's sample: count nothing
    loss = float(all_reduce_sum(loss_sum))
    return {"val/loss": loss, "val/perplexity": math.exp(min(loss, 700.0)), "val/num_loss_tokens": num_loss_tokens}
