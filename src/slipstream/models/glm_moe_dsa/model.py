"""GLM-5 (glm_moe_dsa) as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, L = MoE layers, E = experts.
"""

from torch import nn

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.transformer import MoETransformerBlock, TransformerBlock
from slipstream.models.glm4_moe.model import build_shared_expert_moe
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs
from slipstream.models.glm_moe_dsa.attention import MlaSparseAttention


def build_block(args: GlmMoeDsaArgs, layer: int) -> nn.Module:
    if args.is_moe_layer(layer):
        block = MoETransformerBlock(args, build_shared_expert_moe(args))
    else:
        block = TransformerBlock(args, SwiGLU(args.hidden_size, args.intermediate_size))
    block.attn = MlaSparseAttention(args)
    return block


class GlmMoeDsa(MoEDecoderLM):
    """GLM-5 blocks: `attn` = MLA restricted to the DSA indexer's top-k keys (attention.py), then a dense SwiGLU
    (layers `mlp_layer_types` marks "dense") or `mlp` = SharedExpertMoE as GLM-4.5's: `router` (sigmoid,
    group-limited, with the `e_score_correction_bias` buffer), `experts` (stacked [E, ...]), `shared_experts`.

    API (from DecoderLM): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward`
    (router replay through `replay_BTRA`, see common/moe_routing.py); plus `forward_with_aux_loss`, `moe_stats()` and
    `set_grouped_mm` as Qwen3Moe. The indexers' parameters never get a gradient (attention.py says why).
    """

    keep_in_fp32 = ("e_score_correction_bias",)
    """Published (and cast for the probe) in float32 whatever the published dtype, as transformers keeps it."""

    def __init__(self, args: GlmMoeDsaArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
