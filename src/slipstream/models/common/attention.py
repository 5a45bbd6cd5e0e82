"""Self-attention over PACKED rows (samples share a row; position_ids restart at 0 at each sample; no token sees
another sample). This CPU path (block-diagonal causal mask + SDPA) is the reference: the GPU paths to come (varlen
flash attention from cu_seqlens, flex_attention with a document mask) must match `packed_attention`.

Legend: B = rows, T = tokens per row, D = hidden size, H = query heads, G = key/value heads, K = head dim.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.rope import apply_rope


def sample_ids(position_ids_BT: Tensor) -> Tensor:
    """sample_ids_BT: index of the sample each token belongs to; a new sample starts wherever position_ids == 0
    (the trainer's packing convention, and how varlen flash attention derives cu_seqlens)."""
    return (position_ids_BT == 0).cumsum(dim=-1)


def build_packed_causal_mask(position_ids_BT: Tensor) -> Tensor:
    """mask_B1TT (bool, True = may attend): causal and block-diagonal over the samples of each row.

    O(T^2) memory per row: a reference for CPU and tests, not for long GPU sequences.
    """
    num_tokens = position_ids_BT.shape[-1]
    ids_BT = sample_ids(position_ids_BT)
    same_sample_BTT = ids_BT[:, :, None] == ids_BT[:, None, :]
    causal_TT = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=position_ids_BT.device).tril()
    return (same_sample_BTT & causal_TT).unsqueeze(1)


def packed_attention(q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor, position_ids_BT: Tensor) -> Tensor:
    """o_BHTK: softmax(q k^T / sqrt(K)) v within each sample, causally; G divides H (grouped-query attention)."""
    mask_B1TT = build_packed_causal_mask(position_ids_BT)
    return F.scaled_dot_product_attention(q_BHTK, k_BGTK, v_BGTK, attn_mask=mask_B1TT, enable_gqa=True)


class Attention(nn.Module):
    """Multi-head attention with GQA, RoPE and optional per-head q/k RMSNorm (Qwen3); HF's parameter names."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        bias: bool,
        qk_norm: bool,
        norm_eps: float,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=bias)
        # Qwen3 normalises each head's query and key before RoPE (one weight of size K shared by all heads).
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, position_ids_BT: Tensor) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q_BTHK, k_BTGK = self.q_norm(q_BTHK), self.k_norm(k_BTGK)
        q_BHTK = apply_rope(q_BTHK.transpose(1, 2), cos_BTK, sin_BTK)
        k_BGTK = apply_rope(k_BTGK.transpose(1, 2), cos_BTK, sin_BTK)
        o_BHTK = packed_attention(q_BHTK, k_BGTK, v_BTGK.transpose(1, 2), position_ids_BT)
        return self.o_proj(o_BHTK.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()
