"""Qwen3-MoE as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, L = MoE layers, E = experts.
"""

from torch import nn

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe import MoE
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.transformer import MoETransformerBlock, TransformerBlock
from slipstream.models.qwen3_moe.args import Qwen3MoeArgs


def build_block(args: Qwen3MoeArgs, layer: int) -> nn.Module:
    if args.is_moe_layer(layer):
        moe = MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )
        return MoETransformerBlock(args, moe)
    return TransformerBlock(args, SwiGLU(args.hidden_size, args.intermediate_size))


class Qwen3Moe(MoEDecoderLM):
    """Qwen3 blocks whose MLP is a routed MoE (`layers.{i}.mlp.router`, `layers.{i}.mlp.experts` with stacked
    [E, ...] weights) on the layers the config selects.

    API (from DecoderLM and common/moe_model.py): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`,
    `logits`, `forward`;
    plus `forward_with_aux_loss` (logits and the differentiable per-layer load-balance losses, never added to any
    loss by the model) and `moe_stats()` (detached load-balance statistics of the last forward, for logging).
    Experts run through torch._grouped_mm by default (GPU and CPU; in the autocast dtype under autocast);
    `set_grouped_mm(False)` switches every MoE layer to the per-expert loop (the reference).
    """

    def __init__(self, args: Qwen3MoeArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
