"""Token-level RL losses (docs/algorithm.md): DPPO binary TV mask (default), truncated IS, IcePop and a geometric
sequence mask, each plus the squared log-ratio penalty and normalised by the step's loss-token count.

Legend: T = tokens of a packed micro-batch, S = sample slots (one per token; sample s uses slot s).
lp = trainer log-prob, lq = inference log-prob, A = advantage, ratio = exp(lp - lq).
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from slipstream.config.trainer import LossConfig
from slipstream.models.common.prefix_tree import segment_index


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
    """Loss tokens the kind's rule acted on: masked (dppo_tv, icepop, geo_mask) or weight-truncated (tis)."""

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def to_floats(self) -> dict[str, float]:
        """Host copies of every field (one device sync)."""
        values = torch.stack([getattr(self, f.name).double() for f in fields(self)]).tolist()
        return {f.name: v for f, v in zip(fields(self), values, strict=True)}


def rl_loss(
    logprobs_T: Tensor,
    inference_logprobs_T: Tensor,
    advantages_T: Tensor,
    loss_mask_T: Tensor,
    num_loss_tokens: int,
    config: LossConfig,
    position_ids_T: Tensor | None = None,
    owned_T: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """Sum over loss tokens of `pg + kl_coef * log_ratio^2`, divided by `num_loss_tokens`; `pg` per `config.kind`
    (see LossConfig.kind). Gradients flow through lp only.

    `num_loss_tokens` is the whole step's count across all ranks, so summing the returned losses of every
    micro-batch of every rank gives the step's mean. `position_ids_T` (restarting at 0 at each packed sample)
    is required by "geo_mask" to find the samples. With `owned_T` (context parallelism: ranks share a micro-batch)
    the loss and the stats add up only those tokens, while masks still see every token of the micro-batch.
    """
    if num_loss_tokens <= 0:
        raise ValueError(f"num_loss_tokens must be > 0 (got {num_loss_tokens}): the step has no loss tokens")
    inference_logprobs_T = inference_logprobs_T.detach()
    advantages_T = advantages_T.detach()
    log_ratio_T = torch.where(loss_mask_T, logprobs_T - inference_logprobs_T, torch.zeros_like(logprobs_T))

    if config.kind == "tis":
        pg_T, acted_T = tis_term(log_ratio_T, advantages_T, loss_mask_T, config.tis_cap)
    else:
        with torch.no_grad():
            masked_T = _mask(
                config, log_ratio_T, logprobs_T, inference_logprobs_T, advantages_T, loss_mask_T, position_ids_T
            )
        keep_T = loss_mask_T & ~masked_T
        # exp of 0 on dropped tokens: an overflowing ratio there must not turn into 0 * inf = nan.
        kept_ratio_T = torch.exp(torch.where(keep_T, log_ratio_T, torch.zeros_like(log_ratio_T)))
        pg_T, acted_T = -(keep_T.to(logprobs_T.dtype) * advantages_T * kept_ratio_T), masked_T

    loss_T = pg_T + config.kl_coef * log_ratio_T.square()
    summed_T = loss_mask_T if owned_T is None else loss_mask_T & owned_T
    loss = torch.where(summed_T, loss_T, torch.zeros_like(loss_T)).sum() / num_loss_tokens
    return loss, _stats(loss, log_ratio_T, summed_T, acted_T & summed_T)


def dppo_kl_loss(
    logprobs_T: Tensor,
    inference_logprobs_T: Tensor,
    advantages_T: Tensor,
    loss_mask_T: Tensor,
    num_loss_tokens: int,
    dp_threshold: float,
    kl_coef: float,
) -> tuple[Tensor, LossStats]:
    """The default loss ("dppo_tv") with explicit parameters: `rl_loss` with `LossConfig(kind="dppo_tv", ...)`."""
    config = LossConfig(kind="dppo_tv", dp_threshold=dp_threshold, kl_coef=kl_coef)
    return rl_loss(logprobs_T, inference_logprobs_T, advantages_T, loss_mask_T, num_loss_tokens, config)


def tis_term(log_ratio_T: Tensor, advantages_T: Tensor, loss_mask_T: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """Truncated IS: `-(min(ratio, cap).detach() * A * log_ratio)` and the mask of truncated loss tokens.

    lq is a constant, so the gradient is the IS-weighted REINFORCE one, `-(min(ratio, cap) * A * grad lp)`,
    while the value does not depend on the absolute log-prob (it is 0 on policy).
    """
    with torch.no_grad():
        ratio_T = torch.exp(log_ratio_T)
        weight_T = ratio_T.clamp(max=cap)
        truncated_T = (ratio_T > cap) & loss_mask_T
    return -(weight_T * advantages_T * log_ratio_T), truncated_T


def dppo_tv_mask(logprobs_T: Tensor, inference_logprobs_T: Tensor, advantages_T: Tensor, dp_threshold: float) -> Tensor:
    """Tokens whose probability already moved past the trust region in the direction their advantage pushes."""
    dp_T = torch.exp(logprobs_T) - torch.exp(inference_logprobs_T)
    return ((advantages_T > 0) & (dp_T > dp_threshold)) | ((advantages_T <= 0) & (dp_T < -dp_threshold))


def ratio_outside_mask(log_ratio_T: Tensor, low: float, high: float) -> Tensor:
    """Tokens whose ratio exp(log_ratio) is outside [low, high] (IcePop)."""
    ratio_T = torch.exp(log_ratio_T)
    return (ratio_T < low) | (ratio_T > high)


def sample_ids_from_positions(position_ids_T: Tensor) -> Tensor:
    """Index of the packed sample each token belongs to: a sample starts where position_ids restart at 0, and in a
    prefix tree each branch is a sample (models/common/prefix_tree.py; its shared prefix carries no loss, so the
    branch's loss tokens are exactly its sample's)."""
    if position_ids_T.ndim != 1 or position_ids_T.numel() == 0 or int(position_ids_T[0]) != 0:
        raise ValueError(
            "position_ids_T must be a non-empty 1-D tensor starting at 0 (one packed micro-batch), "
            f"got shape {tuple(position_ids_T.shape)}"
        )
    return segment_index(position_ids_T)


def geo_mask(log_ratio_T: Tensor, loss_mask_T: Tensor, position_ids_T: Tensor, low: float, high: float) -> Tensor:
    """Every token of the samples whose geometric-mean ratio over their loss tokens is outside [low, high]."""
    sample_T = sample_ids_from_positions(position_ids_T)
    weights_T = loss_mask_T.to(log_ratio_T.dtype)
    # One slot per token bounds the number of samples without a device sync.
    log_ratio_sum_S = torch.zeros_like(log_ratio_T).index_add_(0, sample_T, log_ratio_T * weights_T)
    num_loss_S = torch.zeros_like(log_ratio_T).index_add_(0, sample_T, weights_T)
    geo_ratio_S = torch.exp(log_ratio_sum_S / num_loss_S.clamp(min=1.0))
    outside_S = (geo_ratio_S < low) | (geo_ratio_S > high)
    return outside_S[sample_T]


def _mask(
    config: LossConfig,
    log_ratio_T: Tensor,
    logprobs_T: Tensor,
    inference_logprobs_T: Tensor,
    advantages_T: Tensor,
    loss_mask_T: Tensor,
    position_ids_T: Tensor | None,
) -> Tensor:
    """Loss tokens whose policy-gradient term `config.kind` drops (call under no_grad)."""
    if config.kind == "dppo_tv":
        masked_T = dppo_tv_mask(logprobs_T, inference_logprobs_T, advantages_T, config.dp_threshold)
    elif config.kind == "icepop":
        masked_T = ratio_outside_mask(log_ratio_T, config.icepop_low, config.icepop_high)
    elif config.kind == "geo_mask":
        if position_ids_T is None:
            raise ValueError('loss kind "geo_mask" needs position_ids_T to find the samples of the micro-batch')
        if position_ids_T.shape != loss_mask_T.shape:
            raise ValueError(f"position_ids_T {tuple(position_ids_T.shape)} != loss_mask_T {tuple(loss_mask_T.shape)}")
        masked_T = geo_mask(log_ratio_T, loss_mask_T, position_ids_T, config.geo_low, config.geo_high)
    else:
        raise ValueError(f"unknown loss kind {config.kind!r}")
    return masked_T & loss_mask_T


def _stats(loss: Tensor, log_ratio_T: Tensor, loss_mask_T: Tensor, acted_T: Tensor) -> LossStats:
    with torch.no_grad():
        log_ratio_T = log_ratio_T.detach()
        mismatch_kl_T = torch.where(loss_mask_T, torch.exp(log_ratio_T) - log_ratio_T - 1, 0.0)
        return LossStats(
            loss=loss.detach(),
            mismatch_kl_sum=mismatch_kl_T.sum(),
            mismatch_kl_masked_sum=(mismatch_kl_T * acted_T).sum(),
            mismatch_kl_unmasked_sum=(mismatch_kl_T * (loss_mask_T & ~acted_T)).sum(),
            num_loss_tokens=loss_mask_T.sum(),
            num_masked=acted_T.sum(),
        )
