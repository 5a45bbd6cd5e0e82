"""SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`, with HF's parameter names."""

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """Dense gated MLP (Llama, Qwen3, and the dense layers of Qwen3-MoE)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def init_weights(self, std: float) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
