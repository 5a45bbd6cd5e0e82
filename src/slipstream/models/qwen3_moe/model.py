"""Qwen3-MoE as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, L = MoE layers, E = experts.
"""

from torch import nn

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe import MoE, MoEStats, collect_moe_stats
from slipstream.models.common.transformer import DecoderLM, TransformerBlock
from slipstream.models.qwen3_moe.args import Qwen3MoeArgs


def build_mlp(args: Qwen3MoeArgs, layer: int) -> nn.Module:
    if args.is_moe_layer(layer):
        return MoE(
            args.hidden_size,
            args.moe_intermediate_size,
            args.num_experts,
            args.num_experts_per_tok,
            args.norm_topk_prob,
        )
    return SwiGLU(args.hidden_size, args.intermediate_size)


class Qwen3Moe(DecoderLM):
    """Qwen3 blocks whose MLP is a routed MoE (`layers.{i}.mlp.router`, `layers.{i}.mlp.experts` with stacked
    [E, ...] weights) on the layers the config selects.

    API (from DecoderLM): `forward_hidden`, `lm_head_weight`, `logits`, `forward`; plus `moe_stats()` for the
    load-balance statistics of the last forward (never added to the loss by the model).
    Set `experts.use_grouped_mm = True` on each MoE layer (`set_grouped_mm`) to run experts via torch._grouped_mm.
    """

    def __init__(self, args: Qwen3MoeArgs):
        super().__init__(args, [TransformerBlock(args, build_mlp(args, i)) for i in range(args.num_layers)])

    def moe_stats(self) -> MoEStats:
        """tokens_per_expert_LE, router_prob_mean_LE, aux_loss_L of the last forward (see common/moe.py)."""
        return collect_moe_stats(self)

    def set_grouped_mm(self, enabled: bool) -> None:
        """Choose torch._grouped_mm (True) or the per-expert loop (False) for every MoE layer."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.experts.use_grouped_mm = enabled
