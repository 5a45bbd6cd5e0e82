"""MiniMax-M2 as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, H = query heads, G = key/value heads,
K = head dim, E = experts.
"""

from torch import Tensor, nn

from slipstream.models.common.attention import Attention, AttentionLayout, attention
from slipstream.models.common.moe import MoE
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.moe_routing import GroupLimitedSigmoidRouter
from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.rope import apply_rope
from slipstream.models.common.transformer import MoETransformerBlock
from slipstream.models.minimax_m2.args import MiniMaxM2Args


class FullWidthQKNormAttention(Attention):
    """Attention whose q/k RMSNorm spans the whole projection (all heads together: weights [H*K] and [G*K]), applied
    before the heads are split and before RoPE, as transformers' MiniMaxM2Attention (Qwen3 norms each head alone)."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, norm_eps: float):
        super().__init__(dim, num_heads, num_kv_heads, head_dim, bias=False, qk_norm=False, norm_eps=norm_eps)
        self.q_norm = RMSNorm(num_heads * head_dim, norm_eps)
        self.k_norm = RMSNorm(num_kv_heads * head_dim, norm_eps)

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_norm(self.q_proj(x_BTD)).view(B, T, self.num_heads, self.head_dim)
        k_BTGK = self.k_norm(self.k_proj(x_BTD)).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
        o_BTHK = attention(q_BTHK, k_BTGK, v_BTGK, layout)
        return self.o_proj(o_BTHK.reshape(B, T, self.num_heads * self.head_dim))


class SigmoidMoE(MoE):
    """Routed SwiGLU experts (no shared expert) behind a sigmoid router with a selection-only `e_score_correction_bias`
    (one group, top-k weights renormalised, no scaling): transformers' MiniMaxM2SparseMoeBlock. Router replay,
    statistics and the grouped experts are MoE's."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int):
        super().__init__(dim, hidden_dim, num_experts, top_k, norm_topk_prob=True)
        self.router = GroupLimitedSigmoidRouter(dim, num_experts, top_k, True)

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.zeros_(self.router.e_score_correction_bias)


def build_block(args: MiniMaxM2Args) -> MoETransformerBlock:
    moe = SigmoidMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts, args.num_experts_per_tok)
    block = MoETransformerBlock(args, moe)
    block.attn = FullWidthQKNormAttention(
        args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, norm_eps=args.rms_norm_eps
    )
    return block


class MiniMaxM2(MoEDecoderLM):
    """MiniMax-M2 blocks: attention (partial RoPE, full-width q/k norm, no biases) and `layers.{i}.mlp` = SigmoidMoE:
    `router` (sigmoid, with the `e_score_correction_bias` buffer) and `experts` (stacked [E, ...] weights).

    API (from DecoderLM): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward`
    (router replay through `replay_BTRA`, see common/moe_routing.py); plus `forward_with_aux_loss`, `moe_stats()` and
    `set_grouped_mm` as Qwen3Moe.
    """

    keep_in_fp32 = ("e_score_correction_bias",)
    """Published (and cast for the probe) in float32 whatever the published dtype: a rounded selection bias would
    route differently in inference (vLLM holds it in float32)."""

    def __init__(self, args: MiniMaxM2Args):
        super().__init__(args, [build_block(args) for _ in range(args.num_layers)])
