"""Gradient-norm clipping that works on plain and FSDP-sharded (DTensor) gradients alike."""

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before clipping (a plain
    0-dim tensor, the same on every rank). Sharded gradients contribute their shard; the norm is reduced over
    the ranks that hold the shards."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm
