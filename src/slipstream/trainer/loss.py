"""Default RL loss: DPPO binary trust-region (TV) mask + squared log-ratio KL penalty, per token (REFERENCE.md).

Legend: T = tokens of a packed micro-batch. lp = trainer log-prob, lq = inference log-prob, A = advantage.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class LossStats:
    """Detached sums over a micro-batch's loss tokens (0-dim tensors), added across micro-batches of a step."""

    loss: Tensor
    """The returned (normalised) loss, detached: summing it over micro-batches gives the step's loss."""
    mismatch_kl_sum: Tensor
    mismatch_kl_masked_sum: Tensor
    mismatch_kl_unmasked_sum: Tensor
    num_loss_tokens: Tensor
    num_masked: Tensor

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_floats(self) -> dict[str, float]:
        """Host copies of every field (one device sync)."""
        values = torch.stack([getattr(self, f.name).double() for f in fields(self)]).tolist()
        return {f.name: v for f, v in zip(fields(self), values, strict=True)}


def dppo_kl_loss(
    logprobs_T: Tensor,
    inference_logprobs_T: Tensor,
    advantages_T: Tensor,
    loss_mask_T: Tensor,
    num_loss_tokens: int,
    dp_threshold: float,
    kl_coef: float,
) -> tuple[Tensor, LossStats]:
    """Sum over loss tokens of `-(keep * A * ratio) + kl_coef * log_ratio^2`, divided by `num_loss_tokens`.

    A token is masked (keep = 0) when its probability already moved past the trust region in the direction
    its advantage pushes: `A > 0 and dp > dp_threshold` or `A <= 0 and dp < -dp_threshold`, with
    `dp = exp(lp) - exp(lq)`. `num_loss_tokens` is the whole step's count across all ranks, so summing the
    returned losses of every micro-batch of every rank gives the step's mean. Gradients flow through lp only.
    """
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be > 0 (got {num_loss_tokens}): the step has no loss tokens")
    inference_logprobs_T = inference_logprobs_T.detach()
    advantages_T = advantages_T.detach()
    log_ratio_T = torch.where(loss_mask_T, logprobs_T - inference_logprobs_T, torch.zeros_like(logprobs_T))
    ratio_T = torch.exp(log_ratio_T)

    with torch.no_grad():
        dp_T = torch.exp(logprobs_T) - torch.exp(inference_logprobs_T)
        pushed_up_T = (advantages_T > 0) & (dp_T > dp_threshold)
        pushed_down_T = (advantages_T <= 0) & (dp_T < -dp_threshold)
        masked_T = (pushed_up_T | pushed_down_T) & loss_mask_T
        keep_T = (loss_mask_T & ~masked_T).to(logprobs_T.dtype)

    loss_T = -(keep_T * advantages_T * ratio_T) + kl_coef * log_ratio_T.square()
    loss_T = torch.where(loss_mask_T, loss_T, torch.zeros_like(loss_T))
    loss = loss_T.sum() / num_loss_tokens

    with torch.no_grad():
        mismatch_kl_T = torch.where(loss_mask_T, ratio_T - log_ratio_T - 1, torch.zeros_like(ratio_T))
        stats = LossStats(
            loss=loss.detach(),
            mismatch_kl_sum=mismatch_kl_T.sum(),
            mismatch_kl_masked_sum=(mismatch_kl_T * masked_T).sum(),
            mismatch_kl_unmasked_sum=(mismatch_kl_T * (loss_mask_T & ~masked_T)).sum(),
            num_loss_tokens=loss_mask_T.sum(),
            num_masked=masked_T.sum(),
        )
    return loss, stats
