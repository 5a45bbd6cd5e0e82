"""Gradient-norm clipping that works on plain and FSDP-sharded (DTensor) gradients alike, including gradients on
several meshes (EP-sharded experts live on another mesh than the other parameters; DTensor ops cannot mix meshes)."""

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def _by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by the mesh of their gradient (plain tensors form one group), in first-seen order."""
    groups: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in params:
        groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    return list(groups.values())


def global_grad_norm(params: Iterable[nn.Parameter]) -> Tensor:
    """The global L2 norm of the gradients (a plain 0-dim tensor, the same on every rank). Sharded gradients
    contribute their shard; the norm is reduced over the ranks that hold the shards, one mesh at a time."""
    return _norm_and_groups([p for p in params if p.grad is not None])[0]


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Scale gradients so their global L2 norm is at most `max_norm`; return the norm before clipping (see
    `global_grad_norm`)."""
    total_norm, groups = _norm_and_groups([p for p in params if p.grad is not None])
    for group in groups:
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def clip_divisor(total_norm: Tensor, max_norm: float) -> Tensor:
    """What dividing the gradients by clips them as `clip_grad_norm` does (its coefficient max_norm / (norm + 1e-6),
    capped at 1, inverted): for optimizers that take a gradient divisor (fused AdamW's `grad_scale`)."""
    return torch.clamp((total_norm + 1e-6) / max_norm, min=1.0)


def _norm_and_groups(params: list[nn.Parameter]) -> tuple[Tensor, list[list[nn.Parameter]]]:
    groups = _by_mesh(params)
    norms = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0, error_if_nonfinite=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(()), groups
    return (torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]), groups
