"""AFMoE (Arcee Trinity) as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, H = query heads, G = key/value heads,
K = head dim, E = experts.
"""

import torch
from torch import Tensor, nn

from slipstream.models.afmoe.args import AfmoeArgs
from slipstream.models.common.attention import Attention, AttentionLayout, attention, sliding_window_attention
from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.moe_routing import SharedExpertMoE
from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.rope import apply_rope


class AfmoeRMSNorm(RMSNorm):
    """transformers' AfmoeRMSNorm: the weight multiplies the float32 normalised input BEFORE the cast back (Llama's
    casts first); the same in float32, closer to the checkpoint's numerics in bf16."""

    def forward(self, x: Tensor) -> Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x_fp32).to(x.dtype)


class GatedAttention(Attention):
    """AFMoE's attention: per-head q/k RMSNorm, RoPE and a sliding window on the sliding layers only (full-attention
    layers use no positional encoding), and the heads' output times sigmoid(`gate_proj(x)`) before `o_proj`.

    Sliding layers always take the masked-SDPA path (O(T^2) mask per row; no fused kernel here takes both a window
    and packed samples), under context parallelism over the all-gathered K/V; full layers take whatever path the
    layout picked (common/attention.py)."""

    def __init__(self, args: AfmoeArgs, sliding: bool):
        H, G, K = args.num_heads, args.num_kv_heads, args.head_dim
        super().__init__(args.hidden_size, H, G, K, bias=args.attention_bias, qk_norm=True, norm_eps=args.rms_norm_eps)
        self.q_norm, self.k_norm = AfmoeRMSNorm(K, args.rms_norm_eps), AfmoeRMSNorm(K, args.rms_norm_eps)
        self.gate_proj = nn.Linear(args.hidden_size, H * K, bias=False)
        self.sliding_window = args.sliding_window if sliding else None

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_norm(self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim))
        k_BTGK = self.k_norm(self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim))
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        if self.sliding_window is None:
            o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        else:
            q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
            o_BTHK = sliding_window_attention(q_BTHK, k_BTGK, v_BTGK, layout, self.sliding_window)
        o_BTF = o_BTHK.reshape(B, T, self.num_heads * self.head_dim) * torch.sigmoid(self.gate_proj(x_BTD))
        return self.o_proj(o_BTF)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.normal_(self.gate_proj.weight, mean=0.0, std=std)


class AfmoeBlock(nn.Module):
    """`x + post_attn_norm(attn(attn_norm(x)))`, then `x + post_mlp_norm(mlp(mlp_norm(x)))` (sandwich norms)."""

    def __init__(self, args: AfmoeArgs, layer: int, mlp: nn.Module):
        super().__init__()
        eps = args.rms_norm_eps
        self.attn_norm, self.post_attn_norm = AfmoeRMSNorm(args.hidden_size, eps), AfmoeRMSNorm(args.hidden_size, eps)
        self.attn = GatedAttention(args, args.is_sliding(layer))
        self.mlp_norm, self.post_mlp_norm = AfmoeRMSNorm(args.hidden_size, eps), AfmoeRMSNorm(args.hidden_size, eps)
        self.mlp = mlp

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        x_BTD = x_BTD + self.post_attn_norm(self.attn(self.attn_norm(x_BTD), cos_BTK, sin_BTK, layout))
        return x_BTD + self.post_mlp_norm(self.mlp(self.mlp_norm(x_BTD)))

    def init_weights(self, std: float) -> None:
        for norm in (self.attn_norm, self.post_attn_norm, self.mlp_norm, self.post_mlp_norm):
            norm.init_weights()
        self.attn.init_weights(std)
        self.mlp.init_weights(std)


class AfmoeMoEBlock(AfmoeBlock):
    """An AfmoeBlock whose `mlp` is the MoE: returns (x_BTD, aux_loss) and takes a router replay (common/moe.py)."""

    routes_tokens = True

    def forward(
        self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout, replay_BTA: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        x_BTD = x_BTD + self.post_attn_norm(self.attn(self.attn_norm(x_BTD), cos_BTK, sin_BTK, layout))
        y_BTD, aux_loss = self.mlp(self.mlp_norm(x_BTD), replay_BTA)
        return x_BTD + self.post_mlp_norm(y_BTD), aux_loss


def build_block(args: AfmoeArgs, layer: int) -> AfmoeBlock:
    if not args.is_moe_layer(layer):
        return AfmoeBlock(args, layer, SwiGLU(args.hidden_size, args.intermediate_size))
    moe = SharedExpertMoE(
        args.hidden_size,
        args.moe_intermediate_size,
        args.num_experts,
        args.num_experts_per_tok,
        norm_topk_prob=True,
        shared_hidden_dim=args.moe_intermediate_size * args.num_shared_experts,
        routed_scaling_factor=args.route_scale,
    )
    return AfmoeMoEBlock(args, layer, moe)


class ScaledEmbedding(nn.Embedding):
    """Token embedding times a constant (muP's sqrt(D) input scaling); the weight, and a tied head, stay unscaled."""

    def __init__(self, *args, scale: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = scale

    def forward(self, input_ids: Tensor) -> Tensor:
        return super().forward(input_ids) * self.scale


class Afmoe(MoEDecoderLM):
    """AFMoE blocks (AfmoeBlock: sandwich norms, GatedAttention), a dense SwiGLU on the first `num_dense_layers`
    layers, then `layers.{i}.mlp` = SharedExpertMoE: `router` (sigmoid, one group, the `e_score_correction_bias`
    buffer = transformers' `expert_bias`), `experts` (stacked [E, ...] weights), `shared_experts` (dense SwiGLU).

    API (from DecoderLM): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward`
    (router replay through `replay_BTRA`); plus `forward_with_aux_loss`, `moe_stats()` and `set_grouped_mm`.
    """

    def __init__(self, args: AfmoeArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
        self.norm = AfmoeRMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.mup_enabled:
            scaled = ScaledEmbedding(
                args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id, scale=args.hidden_size**0.5
            )
            scaled.weight = self.embed_tokens.weight
            self.embed_tokens = scaled
