"""RMSNorm, computed in float32 and cast back as transformers' Llama/Qwen3 RMSNorm does (bit-compatible numerics)."""

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast before the weight multiply, like transformers: the product then happens in the weight's dtype.
        return self.weight * x_fp32.to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
