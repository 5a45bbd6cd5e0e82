"""GLM-4.5 MoE as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, L = MoE layers, H = query heads, K = head dim.
"""

from torch import nn

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.moe_routing import SharedExpertMoE
from slipstream.models.common.transformer import MoETransformerBlock, TransformerBlock
from slipstream.models.glm4_moe.args import Glm4MoeArgs


def build_shared_expert_moe(args: Glm4MoeArgs) -> SharedExpertMoE:
    """GLM-4.5's MoE layer (GLM-5's too): routed experts behind the sigmoid group-limited router, plus shared ones."""
    return SharedExpertMoE(
        args.hidden_size,
        args.moe_intermediate_size,
        args.num_experts,
        args.num_experts_per_tok,
        args.norm_topk_prob,
        shared_hidden_dim=args.moe_intermediate_size * args.n_shared_experts,
        num_groups=args.n_group,
        topk_groups=args.topk_group,
        routed_scaling_factor=args.routed_scaling_factor,
    )


def build_block(args: Glm4MoeArgs, layer: int) -> nn.Module:
    if args.is_moe_layer(layer):
        block = MoETransformerBlock(args, build_shared_expert_moe(args))
    else:
        block = TransformerBlock(args, SwiGLU(args.hidden_size, args.intermediate_size))
    if args.attention_bias:  # GLM: biases on q/k/v only, never on the output projection
        block.attn.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)
    return block


class Glm4Moe(MoEDecoderLM):
    """GLM-4.5 blocks: attention (partial RoPE, q/k/v biases, optional q/k norm), a dense SwiGLU on the first
    `first_k_dense_replace` layers, then `layers.{i}.mlp` = SharedExpertMoE: `router` (sigmoid, group-limited, with
    the `e_score_correction_bias` buffer), `experts` (stacked [E, ...] weights) and `shared_experts` (dense SwiGLU).

    API (from DecoderLM): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward`
    (router replay through `replay_BTRA`, see common/moe_routing.py); plus `forward_with_aux_loss`, `moe_stats()` and
    `set_grouped_mm` as Qwen3Moe.
    """

    keep_in_fp32 = ("e_score_correction_bias",)
    """Tensors published (and cast for the probe) in float32 whatever the published dtype, as transformers keeps
    them (`_keep_in_fp32_modules_strict`): a rounded selection bias would route differently in inference."""

    def __init__(self, args: Glm4MoeArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
