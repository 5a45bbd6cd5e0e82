"""One optimizer step on one TrainingBatch: forward/backward per micro-batch, clip, step; returns its metrics."""

import torch
from torch import Tensor, nn

from slipstream.config.trainer import LossConfig
from slipstream.trainer.data import to_packed
from slipstream.trainer.logprobs import compute_logprobs, mixed_precision
from slipstream.trainer.loss import LossStats, rl_loss
from slipstream.transport.rollouts import TrainingBatch


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainingBatch,
    loss_config: LossConfig,
    max_grad_norm: float,
    device: torch.device,
    compute_dtype: torch.dtype = torch.float32,
) -> dict[str, float | None]:
    """Accumulate gradients of every micro-batch (each loss already divided by the step's loss-token count),
    clip the gradient norm, step the optimizer and zero the gradients.

    The model's parameters are the float32 masters; with a lower `compute_dtype` the forward runs under autocast
    (backward follows it), so AdamW always updates float32 weights.
    """
    model.train()
    total: LossStats | None = None
    entropy_sum = torch.zeros((), device=device)
    num_tokens = 0
    for mb in batch.micro_batches:
        packed = to_packed(mb, device)
        with mixed_precision(device, compute_dtype):
            logprobs_T, entropy_T = compute_logprobs(model, packed)
        loss, stats = rl_loss(
            logprobs_T,
            packed.inference_logprobs_T,
            packed.advantages_T,
            packed.loss_mask_T,
            num_loss_tokens=batch.num_loss_tokens,
            config=loss_config,
            position_ids_T=packed.position_ids_T,
        )
        loss.backward()
        total = stats if total is None else total + stats
        entropy_sum += torch.where(packed.loss_mask_T, entropy_T, 0.0).sum()
        num_tokens += packed.num_tokens
    if total is None:
        raise ValueError(f"batch of step {batch.step} rank {batch.rank} has no micro-batches")

    grad_norm = clip_and_step(model, optimizer, max_grad_norm, batch.step)
    return summarize_step(total, entropy_sum, grad_norm, optimizer, batch, num_tokens)


def clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float, step: int) -> Tensor:
    """Clip the global gradient norm, step, zero grads; return the norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"step {step}: gradient norm is {grad_norm.item()}; the weights were not updated. "
            "Lower trainer.optim.lr or check the batch (advantages, inference_logprobs) for inf/nan"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def summarize_step(
    total: LossStats,
    entropy_sum: Tensor,
    grad_norm: Tensor,
    optimizer: torch.optim.Optimizer,
    batch: TrainingBatch,
    num_tokens: int,
) -> dict[str, float | None]:
    """Exact means over this rank's loss tokens (None where a mean has no tokens)."""
    s = total.to_floats()
    num_loss, num_masked = s["num_loss_tokens"], s["num_masked"]
    return {
        "loss": s["loss"],
        "mismatch_kl": _mean(s["mismatch_kl_sum"], num_loss),
        "mismatch_kl_masked": _mean(s["mismatch_kl_masked_sum"], num_masked),
        "mismatch_kl_unmasked": _mean(s["mismatch_kl_unmasked_sum"], num_loss - num_masked),
        "masked_fraction": _mean(num_masked, num_loss),
        "entropy": _mean(entropy_sum.item(), num_loss),
        "grad_norm": grad_norm.item(),
        "lr": optimizer.param_groups[0]["lr"],
        "num_loss_tokens": batch.num_loss_tokens,
        "num_tokens": num_tokens,
    }


def _mean(value_sum: float, count: float) -> float | None:
    return value_sum / count if count > 0 else None
