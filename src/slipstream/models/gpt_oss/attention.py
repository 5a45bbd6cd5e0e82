"""GPT-OSS attention: GQA with biases, a learned sink logit per query head (an extra softmax column whose value is
dropped: it only takes probability mass away), and causal or sliding-window masks.

Every layout (one sample per row, packed rows, prefix trees) runs the same masked path: the reference's
block-diagonal causal mask (common/attention.py: samples never see each other), narrowed to the last W positions of
the sample on sliding layers, and softmax over [scores, sink] computed by hand. No fused kernel here takes both the
sinks and packed rows (flash varlen and SDPA have no sink logit), so CUDA runs this path too: O(T^2) memory per row.
Under context parallelism (parallel/cp.py) the shard's queries attend to the all-gathered keys and values of the
whole rows with the shard's mask (common/attention.py), narrowed to the window by the same position rule: sinks are
per query, so the result is exact.

Legend: B = rows, T = tokens per row, D = hidden size, H = query heads, G = key/value heads, K = head dim.
"""

import torch
from torch import Tensor, nn

from slipstream.models.common.attention import Attention, AttentionLayout, build_packed_causal_mask
from slipstream.models.common.rope import apply_rope


def sink_attention_mask(position_ids_BT: Tensor, sliding_window: int | None) -> Tensor:
    """mask_B1TT (True = may attend): the packed causal mask, and with `sliding_window` W only keys fewer than W
    positions before the query (positions run on within a sample and a tree branch, so their difference is the
    distance)."""
    return narrow_to_window(build_packed_causal_mask(position_ids_BT), position_ids_BT, position_ids_BT, sliding_window)


def narrow_to_window(mask_B1tT: Tensor, q_positions_Bt: Tensor, kv_positions_BT: Tensor, window: int | None) -> Tensor:
    """`mask_B1tT` without the keys W or more positions before their query (unchanged without a window)."""
    if window is None:
        return mask_B1tT
    distance_BtT = q_positions_Bt[:, :, None] - kv_positions_BT[:, None, :]
    return mask_B1tT & (distance_BtT < window)[:, None]


def sink_attention(q_BHTK: Tensor, k_BGTK: Tensor, v_BGTK: Tensor, sinks_H: Tensor, mask_B1TT: Tensor) -> Tensor:
    """o_BHTK = softmax([q k^T / sqrt(K), sink_h]) without its last column, times v; G divides H."""
    H, G = q_BHTK.shape[1], k_BGTK.shape[1]
    k_BHTK, v_BHTK = k_BGTK.repeat_interleave(H // G, dim=1), v_BGTK.repeat_interleave(H // G, dim=1)
    scores_BHTT = (q_BHTK @ k_BHTK.transpose(-2, -1)) * q_BHTK.shape[-1] ** -0.5
    scores_BHTT = scores_BHTT.masked_fill(~mask_B1TT, float("-inf"))
    B, _, T, _ = scores_BHTT.shape
    sinks_BHT1 = sinks_H.to(scores_BHTT.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    logits_BHTS = torch.cat((scores_BHTT, sinks_BHT1), dim=-1)
    # Shifting by the row max keeps bf16 from overflowing (as transformers does); the sink column is never -inf.
    logits_BHTS = logits_BHTS - logits_BHTS.amax(dim=-1, keepdim=True).detach()
    probs_BHTT = logits_BHTS.softmax(dim=-1)[..., :-1]
    return probs_BHTT.to(v_BHTK.dtype) @ v_BHTK


class SinkAttention(Attention):
    """Attention with q/k/v/o biases and `sinks` [H]; `sliding_window` W on sliding layers, None on full ones."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, *, sliding_window: int | None):
        super().__init__(dim, num_heads, num_kv_heads, head_dim, bias=True, qk_norm=False, norm_eps=1e-6)
        self.sliding_window = sliding_window
        self.sinks = nn.Parameter(torch.empty(num_heads))

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        B, T, _ = x_BTD.shape
        q_BTHK = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim)
        k_BTGK = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        v_BTGK = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim)
        q_BTHK, k_BTGK = apply_rope(q_BTHK, cos_BTK, sin_BTK), apply_rope(k_BTGK, cos_BTK, sin_BTK)
        if layout.backend == "context_parallel":  # T is this rank's shard; keys and values become the whole rows'
            kv_BT2GK = layout.context.gather_kv(torch.stack((k_BTGK, v_BTGK), dim=2))
            k_BTGK, v_BTGK = kv_BT2GK[:, :, 0], kv_BT2GK[:, :, 1]
            kv_positions_BT = layout.context.kv_position_ids_BT
            mask_B1TT = narrow_to_window(layout.mask_B1TT, layout.position_ids_BT, kv_positions_BT, self.sliding_window)
        else:
            mask_B1TT = sink_attention_mask(layout.position_ids_BT, self.sliding_window)
        o_BHTK = sink_attention(
            q_BTHK.transpose(1, 2), k_BTGK.transpose(1, 2), v_BTGK.transpose(1, 2), self.sinks, mask_B1TT
        )
        return self.o_proj(o_BHTK.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.normal_(self.sinks, mean=0.0, std=std)
