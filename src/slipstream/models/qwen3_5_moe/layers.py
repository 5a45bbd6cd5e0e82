"""Qwen3.5-MoE's layers: the zero-centred RMSNorm, the gated RMSNorm, Gated DeltaNet (linear attention), gated full
attention and the MoE with a gated shared expert; transformers' parameter names.

Legend: B = rows, T = tokens per row, D = hidden size, H = query heads (linear: value heads), G = key/value heads
(linear: key heads), K = head dim (linear: key head dim), V = linear value head dim, X = conv channels (2 G K + H V).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.attention import AttentionLayout, attention
from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe import MoE
from slipstream.models.common.rope import apply_rope
from slipstream.models.qwen3_5_moe.args import Qwen35MoeArgs
from slipstream.models.qwen3_5_moe.delta_rule import chunk_gated_delta_rule, packed_causal_conv1d


class ZeroCenteredRMSNorm(nn.Module):
    """`(1 + weight) * x / sqrt(mean(x^2) + eps)`, in float32 then cast back (transformers' Qwen3_5MoeRMSNorm: the
    product happens in float32, unlike common/norm.py's); the weight starts at 0."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_fp32 * (1.0 + self.weight.float())).type_as(x)

    def init_weights(self) -> None:
        nn.init.zeros_(self.weight)


class GatedRMSNorm(nn.Module):
    """`weight * rmsnorm(x) * silu(gate)` (transformers' Qwen3_5MoeRMSNormGated; weight starts at 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_fp32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """Linear attention (transformers' Qwen3_5MoeGatedDeltaNet) over packed rows: q, k, v from one projection through
    a causal depthwise conv (silu), decay g = -exp(A_log) * softplus(a + dt_bias) and rate beta = sigmoid(b) per value
    head, the gated delta rule (delta_rule.py; conv taps and state restart at every sample), a gated RMSNorm by z,
    then `out_proj`. Ignores RoPE (`cos`/`sin`): position enters through the recurrence."""

    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        D = args.hidden_size
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.k_dim, self.v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        key_width, value_width = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        conv_width = 2 * key_width + value_width
        W = args.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_width, conv_width, W, groups=conv_width, bias=False, padding=W - 1)
        """Its weight only ([X, 1, W]); delta_rule.py applies it per sample."""
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(value_width, D, bias=False)
        self.in_proj_qkv = nn.Linear(D, conv_width, bias=False)
        self.in_proj_z = nn.Linear(D, value_width, bias=False)
        self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False)

    def forward(self, x_BTD: Tensor, cos_BTR: Tensor, sin_BTR: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        H, G = self.num_v_heads, self.num_k_heads
        qkv_BTX = packed_causal_conv1d(self.in_proj_qkv(x_BTD), self.conv1d.weight[:, 0], layout.position_ids_BT)
        q_BTGK, k_BTGK, v_BTHV = qkv_BTX.split([G * self.k_dim, G * self.k_dim, H * self.v_dim], dim=-1)
        q_BTHK = q_BTGK.reshape(B, T, G, self.k_dim).repeat_interleave(H // G, dim=2)
        k_BTHK = k_BTGK.reshape(B, T, G, self.k_dim).repeat_interleave(H // G, dim=2)
        beta_BTH = self.in_proj_b(x_BTD).sigmoid()
        g_BTH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BTD).float() + self.dt_bias)
        o_BTHV = chunk_gated_delta_rule(
            q_BTHK, k_BTHK, v_BTHV.reshape(B, T, H, self.v_dim), g_BTH, beta_BTH, layout.position_ids_BT
        )
        z_BTHV = self.in_proj_z(x_BTD).view(B, T, H, self.v_dim)
        return self.out_proj(self.norm(o_BTHV, z_BTHV).reshape(B, T, H * self.v_dim))

    def init_weights(self, std: float) -> None:
        for linear in (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a, self.out_proj, self.conv1d):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():  # transformers' init: A uniform in [0.01, 16], kept away from 0 so log(A) is finite
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.init_weights()


class GatedAttention(nn.Module):
    """transformers' Qwen3_5MoeAttention: `q_proj` gives each head its query and an output gate (per head, the query's
    K dims then the gate's K), q/k zero-centred RMSNorm per head, partial RoPE, GQA attention (common/attention.py,
    every packed and parallel path), output * sigmoid(gate), then `o_proj`."""

    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        D, H, G, K, bias = args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, args.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, K
        self.q_proj = nn.Linear(D, H * K * 2, bias=bias)
        self.k_proj = nn.Linear(D, G * K, bias=bias)
        self.v_proj = nn.Linear(D, G * K, bias=bias)
        self.o_proj = nn.Linear(H * K, D, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(K, args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(K, args.rms_norm_eps)

    def forward(self, x_BTD: Tensor, cos_BTR: Tensor, sin_BTR: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        H, G, K = self.num_heads, self.num_kv_heads, self.head_dim
        q_BTHK, gate_BTHK = self.q_proj(x_BTD).view(B, T, H, 2 * K).chunk(2, dim=-1)
        q_BTHK = apply_rope(self.q_norm(q_BTHK), cos_BTR, sin_BTR)
        k_BTGK = apply_rope(self.k_norm(self.k_proj(x_BTD).view(B, T, G, K)), cos_BTR, sin_BTR)
        v_BTGK = self.v_proj(x_BTD).view(B, T, G, K)
        o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        return self.o_proj((o_BTHK * torch.sigmoid(gate_BTHK).to(o_BTHK.dtype)).reshape(B, T, H * K))

    def init_weights(self, std: float) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.q_norm.init_weights()
        self.k_norm.init_weights()


class GatedSharedExpertMoE(MoE):
    """Softmax top-A routed experts (common/moe.py: grouped GEMM, expert parallelism, router replay, statistics) plus
    a shared SwiGLU every token goes through, scaled per token by sigmoid(`shared_expert_gate`(x)) (transformers'
    Qwen3_5MoeSparseMoeBlock). Returns (y_BTD, aux_loss), the aux loss over the routed experts only."""

    def __init__(self, args: Qwen35MoeArgs):
        D = args.hidden_size
        super().__init__(D, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok, True)
        self.shared_expert = SwiGLU(D, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def forward(self, x_BTD: Tensor, replay_BTA: Tensor | None = None) -> tuple[Tensor, Tensor]:
        y_BTD, aux_loss = super().forward(x_BTD, replay_BTA)
        shared_BTD = torch.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)
        return y_BTD + shared_BTD, aux_loss

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        self.shared_expert.init_weights(std)
        nn.init.normal_(self.shared_expert_gate.weight, mean=0.0, std=std)
