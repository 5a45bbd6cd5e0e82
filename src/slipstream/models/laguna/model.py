"""Laguna (Poolside) as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Context parallelism is exact: full layers take common/attention.py's paths, sliding layers afmoe's windowed mask over
the all-gathered keys (positions measure the window), and RoPE, the q/k norms and the output gate are per token.

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, H = query heads (per layer), G = key/value
heads, K = head dim, N = tokens, E = experts.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.attention import Attention, AttentionLayout, attention, sliding_window_attention
from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.moe_routing import GroupLimitedSigmoidRouter, SharedExpertMoE
from slipstream.models.common.rope import RopeArgs, apply_rope, rope_cos_sin
from slipstream.models.common.transformer import MoETransformerBlock, TransformerBlock
from slipstream.models.laguna.args import LagunaArgs


class SoftcappedSigmoidRouter(GroupLimitedSigmoidRouter):
    """GroupLimitedSigmoidRouter (one group) whose float32 logits are softcapped first: c * tanh(logits / c) when
    `softcap` c > 0 (transformers' LagunaTopKRouter); selection, replay and gate weights are the parent's."""

    def __init__(self, *args, softcap: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.softcap = softcap

    def logits(self, x_ND: Tensor) -> Tensor:
        logits_NE = super().logits(x_ND)
        if self.softcap > 0:
            logits_NE = torch.tanh(logits_NE / self.softcap) * self.softcap
        return logits_NE


def build_moe(args: LagunaArgs) -> SharedExpertMoE:
    """Sigmoid-routed experts (renormalised gates times `routed_scaling_factor`) + the shared SwiGLU."""
    dim, num_experts, top_k = args.hidden_size, args.num_experts, args.num_experts_per_tok
    moe = SharedExpertMoE(
        dim,
        args.moe_intermediate_size,
        num_experts,
        top_k,
        norm_topk_prob=True,
        shared_hidden_dim=args.shared_expert_intermediate_size,
        routed_scaling_factor=args.routed_scaling_factor,
    )
    moe.router = SoftcappedSigmoidRouter(
        dim,
        num_experts,
        top_k,
        True,
        routed_scaling_factor=args.routed_scaling_factor,
        softcap=args.router_logit_softcapping,
    )
    return moe


class SoftplusGatedAttention(Attention):
    """Laguna's attention: per-head q/k RMSNorm, RoPE (the sliding layers' own `rope` when it differs from the one the
    decoder passes in), a sliding window on sliding layers, and the heads' output times softplus(`g_proj(x)`) (one
    gate per head, broadcast over K, or one per head dim) before `o_proj`.

    A sliding layer with its own RoPE computes its [T, K] cos/sin table itself (small next to attention); sliding
    layers always take the masked-SDPA path (common/attention.py's sliding_window_attention: O(T^2) mask per row)."""

    def __init__(self, args: LagunaArgs, layer: int):
        H, G, K = args.num_heads_per_layer[layer], args.num_kv_heads, args.head_dim
        super().__init__(args.hidden_size, H, G, K, bias=args.attention_bias, qk_norm=True, norm_eps=args.rms_norm_eps)
        self.gate_per_head = args.gate_per_head
        self.g_proj = nn.Linear(args.hidden_size, H if args.gate_per_head else H * K, bias=False)
        sliding = args.is_sliding(layer)
        self.sliding_window = args.sliding_window if sliding else None
        self.rope: RopeArgs | None = args.sliding_rope if sliding and args.sliding_rope != args.rope else None

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        H, K = self.num_heads, self.head_dim
        q_BTHK = self.q_norm(self.q_proj(x_BTD).view(B, T, H, K))
        k_BTGK = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, K))
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, K)
        if self.rope is not None:
            cos_BTK, sin_BTK = rope_cos_sin(self.rope, K, layout.position_ids_BT, cos_BTK.dtype)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
        if self.sliding_window is None:
            o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        else:
            o_BTHK = sliding_window_attention(q_BTHK, k_BTGK, v_BTGK, layout, self.sliding_window)
        # softplus in float32, cast to the output's dtype, as transformers
        gate_BTX = F.softplus(self.g_proj(x_BTD).float()).to(o_BTHK.dtype)
        gate_BTHk = gate_BTX.view(B, T, H, 1) if self.gate_per_head else gate_BTX.view(B, T, H, K)
        return self.o_proj((o_BTHK * gate_BTHk).reshape(B, T, H * K))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.normal_(self.g_proj.weight, mean=0.0, std=std)


def build_block(args: LagunaArgs, layer: int) -> TransformerBlock:
    if args.is_moe_layer(layer):
        block = MoETransformerBlock(args, build_moe(args))
    else:
        block = TransformerBlock(args, SwiGLU(args.hidden_size, args.intermediate_size))
    block.attn = SoftplusGatedAttention(args, layer)
    return block


class Laguna(MoEDecoderLM):
    """Laguna blocks (pre-norm: `attn_norm`, `attn` = SoftplusGatedAttention, `mlp_norm`, `mlp`): `mlp` a dense SwiGLU
    on the layers `mlp_layer_types` marks "dense", else SharedExpertMoE with `router` = SoftcappedSigmoidRouter (its
    `e_score_correction_bias` buffer), stacked `experts` and `shared_experts`. The decoder's RoPE table is the full
    layers' (`args.rope`).

    API (from DecoderLM / MoEDecoderLM): `forward_hidden` (context parallelism through `context`),
    `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward` (router replay through `replay_BTRA`),
    `forward_with_aux_loss`, `moe_stats()`, `set_grouped_mm`.
    """

    keep_in_fp32 = ("e_score_correction_bias",)
    """Published in float32 whatever the weights' dtype (transformers' Laguna does not insist, GLM-4.5's does): a
    rounded selection bias would route differently in inference."""

    def __init__(self, args: LagunaArgs):
        super().__init__(args, [build_block(args, layer) for layer in range(args.num_layers)])
