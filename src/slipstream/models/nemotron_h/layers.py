"""Nemotron-H's layers: its RMSNorm, the grouped gated RMSNorm, the Mamba2 mixer, NoPE attention, the squared-ReLU
MLP and experts, and the MoE with a shared expert and an optional latent space; transformers' parameter names.

Legend: B = rows, T = tokens per row, D = hidden size, H = Mamba heads (attention: query heads), P = Mamba head dim,
G = groups of Mamba heads (attention: key/value heads), S = SSM state size, I = Mamba width (H P), X = conv channels
(I + 2 G S), K = attention head dim, N = tokens (B T), E = experts, A = active experts per token, M = routed
(token, expert) rows sorted by expert, F = expert width, L = experts' input width (latent size or D).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.attention import Attention, AttentionLayout, attention
from slipstream.models.common.moe import (
    GroupedExperts,
    MoE,
    _local,
    grouped_mm,
    grouped_mm_dtype,
    mix_experts,
)
from slipstream.models.common.moe_routing import GroupLimitedSigmoidRouter
from slipstream.models.common.norm import RMSNorm
from slipstream.models.nemotron_h.args import NemotronHArgs
from slipstream.models.nemotron_h.ssd import chunked_ssd, packed_causal_conv1d


class NemotronHRMSNorm(RMSNorm):
    """transformers' NemotronHRMSNorm: the weight multiplies the float32 normalised input BEFORE the cast back
    (Llama's casts first); the same in float32."""

    def forward(self, x: Tensor) -> Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x_fp32).to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """`weight * groupnorm(x * silu(gate))`: an RMSNorm over each group of `group_size` channels of the gated input,
    in float32, cast back to x's dtype before the weight (transformers' Zamba2RMSNormGated, as Nemotron-H uses it)."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.eps, self.group_size = eps, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        h = x.float() * F.silu(gate.float())
        h_grouped = h.unflatten(-1, (-1, self.group_size))
        h_grouped = h_grouped * torch.rsqrt(h_grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h_grouped.flatten(-2).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Mamba2Mixer(nn.Module):
    """transformers' NemotronHMamba2Mixer over packed rows: `in_proj` gives the gate z [I], the conv input (x [I],
    b [G S], c [G S]) and dt [H]; the conv (silu) and the SSD scan restart at every sample (ssd.py), with
    dt = clamp(softplus(dt + dt_bias), min=time_step_min) and A = -exp(A_log); then the grouped gated RMSNorm by z and
    `out_proj`. The scan and the norm run in float32."""

    def __init__(self, args: NemotronHArgs):
        super().__init__()
        H, P, G, S = args.mamba_num_heads, args.mamba_head_dim, args.mamba_n_groups, args.ssm_state_size
        self.num_heads, self.head_dim, self.num_groups, self.state_size = H, P, G, S
        self.intermediate_size, self.conv_dim = H * P, H * P + 2 * G * S
        self.time_step_min, self.chunk_size = args.time_step_min, args.chunk_size
        W = args.conv_kernel
        self.in_proj = nn.Linear(args.hidden_size, 2 * H * P + 2 * G * S + H, bias=args.mamba_bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, W, groups=self.conv_dim, bias=args.use_conv_bias, padding=W - 1
        )
        """Its weight [X, 1, W] and bias only; ssd.py applies them per sample."""
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.D = nn.Parameter(torch.empty(H))
        self.norm = GatedGroupRMSNorm(H * P, H * P // G, args.rms_norm_eps)
        self.out_proj = nn.Linear(H * P, args.hidden_size, bias=args.mamba_bias)

    def forward(self, x_BTD: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        H, P, G, S = self.num_heads, self.head_dim, self.num_groups, self.state_size
        z_BTI, xbc_BTX, dt_BTH = self.in_proj(x_BTD).split([H * P, self.conv_dim, H], dim=-1)
        position_ids_BT = layout.position_ids_BT
        xbc_BTX = packed_causal_conv1d(xbc_BTX, self.conv1d.weight[:, 0], self.conv1d.bias, position_ids_BT)
        x_BTI, b_BTGS, c_BTGS = xbc_BTX.split([H * P, G * S, G * S], dim=-1)
        dt_BTH = F.softplus(dt_BTH.float() + self.dt_bias.float()).clamp(min=self.time_step_min)
        y_BTHP = chunked_ssd(
            x_BTI.view(B, T, H, P),
            dt_BTH,
            -self.A_log.float().exp(),
            b_BTGS.view(B, T, G, S),
            c_BTGS.view(B, T, G, S),
            self.D.float(),
            position_ids_BT,
            self.chunk_size,
        )
        return self.out_proj(self.norm(y_BTHP.reshape(B, T, H * P), z_BTI).to(x_BTD.dtype))

    def init_weights(self, std: float) -> None:
        """transformers' init: A = 1..H, D = 1, dt log-uniform in [1e-3, 1e-1] through the inverse softplus."""
        for linear in (self.in_proj, self.out_proj, self.conv1d):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        with torch.no_grad():
            H = self.num_heads
            self.A_log.copy_(torch.arange(1, H + 1, dtype=torch.float32).log())
            dt_H = (torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).exp().clamp(min=1e-4)
            self.dt_bias.copy_(dt_H + torch.log(-torch.expm1(-dt_H)))
        nn.init.ones_(self.D)
        self.norm.init_weights()


class NoPEAttention(Attention):
    """transformers' NemotronHAttention: GQA over packed rows (common/attention.py), no positional encoding, no
    biases, no q/k norm."""

    def __init__(self, args: NemotronHArgs):
        super().__init__(
            args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, bias=False, qk_norm=False, norm_eps=0.0
        )

    def forward(self, x_BTD: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        return self.o_proj(o_BTHK.reshape(B, T, self.num_heads * self.head_dim))


def relu2(x: Tensor) -> Tensor:
    """relu(x)^2 (transformers' "relu2")."""
    return F.relu(x).square()


class Relu2MLP(nn.Module):
    """`down_proj(relu(up_proj(x))^2)`: Nemotron-H's dense MLP and shared expert (no gate)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(relu2(self.up_proj(x)))

    def init_weights(self, std: float) -> None:
        for linear in (self.up_proj, self.down_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)


class Relu2Experts(GroupedExperts):
    """E squared-ReLU experts (no gate) on the sorted-rows interface of common/moe.py (expert parallelism shards
    them as any GroupedExperts): `up_proj` [E, F, L], `down_proj` [E, L, F] (nn.Linear layout, transformers' own);
    grouped GEMM or the per-expert loop (the reference), same result. LoRA refuses them (not plain GroupedExperts)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        nn.Module.__init__(self)  # not GroupedExperts' three SwiGLU projections
        self.num_experts, self.use_grouped_mm = num_experts, True
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x_ML: Tensor, counts_E: Tensor) -> Tensor:
        up_EFL, down_ELF = _local(self.up_proj), _local(self.down_proj)
        if self.use_grouped_mm:
            dtype = grouped_mm_dtype(x_ML.device.type, up_EFL.dtype)
            x_ML, up_EFL, down_ELF = x_ML.to(dtype), up_EFL.to(dtype), down_ELF.to(dtype)
            offsets_E = counts_E.cumsum(0).to(torch.int32)
            h_MF = relu2(grouped_mm(x_ML, up_EFL.transpose(-2, -1), offsets_E))
            return grouped_mm(h_MF, down_ELF.transpose(-2, -1), offsets_E)
        outputs = []
        # Experts without rows still run (empty matmuls), so every expert weight gets a gradient (see GroupedExperts).
        for e, x_mL in enumerate(torch.split(x_ML, counts_E.tolist())):
            outputs.append(relu2(x_mL @ up_EFL[e].T) @ down_ELF[e].T)
        return torch.cat(outputs)

    def init_weights(self, std: float) -> None:
        for weight in (self.up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)


class NemotronHMoE(MoE):
    """transformers' NemotronHMoE: sigmoid group-limited routing with a selection bias (GroupLimitedSigmoidRouter:
    `router`, transformers' `gate`), squared-ReLU routed experts that run in the latent space when the config has one
    (`fc1_latent_proj` before them, `fc2_latent_proj` after their weighted sum), plus a squared-ReLU shared expert on
    the input. Returns (y_BTD, aux_loss) (common/moe.py; the aux loss over the routed experts only)."""

    def __init__(self, args: NemotronHArgs):
        D, F_, E, A = args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok
        L = args.moe_latent_size or D
        super().__init__(D, F_, E, A, args.norm_topk_prob)
        self.router = GroupLimitedSigmoidRouter(
            D,
            E,
            A,
            args.norm_topk_prob,
            num_groups=args.num_groups,
            topk_groups=args.topk_groups,
            routed_scaling_factor=args.routed_scaling_factor,
        )
        self.experts = Relu2Experts(L, F_, E)
        self.shared_experts = Relu2MLP(D, args.shared_expert_intermediate_size, args.mlp_bias)
        latent = args.moe_latent_size is not None
        self.fc1_latent_proj = nn.Linear(D, L, bias=args.mlp_bias) if latent else None
        self.fc2_latent_proj = nn.Linear(L, D, bias=args.mlp_bias) if latent else None

    def forward(self, x_BTD: Tensor, replay_BTA: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """As MoE.forward, but the routed rows are the latent projection of the tokens the router saw."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        replay_NA = None if replay_BTA is None else replay_BTA.reshape(x_ND.shape[0], -1)
        probs_NE, expert_ids_NA, weights_NA = self.router(x_ND, replay_NA)
        rows_NL = x_ND if self.fc1_latent_proj is None else self.fc1_latent_proj(x_ND)
        y_NL = mix_experts(self.experts, rows_NL, expert_ids_NA, weights_NA, dtype=x_ND.dtype)
        y_ND = y_NL if self.fc2_latent_proj is None else self.fc2_latent_proj(y_NL)
        y_BTD = y_ND.view_as(x_BTD) + self.shared_experts(x_BTD)
        return y_BTD, self._load_balance_loss(probs_NE, expert_ids_NA)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.zeros_(self.router.e_score_correction_bias)
        self.shared_experts.init_weights(std)
        for linear in (self.fc1_latent_proj, self.fc2_latent_proj):
            if linear is not None:
                nn.init.normal_(linear.weight, mean=0.0, std=std)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
