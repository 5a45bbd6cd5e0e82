"""Qwen3.5-MoE as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Context parallelism is refused: a Gated DeltaNet layer's output at token t depends on every earlier token of its
sample through a recurrent state (and the conv's last taps), so a cp shard that starts mid-sample would need the
state at its first token from the ranks before it (state passing, not modelled). All-gathering keys and values, as
the full-attention layers do, does not give it: the result would silently differ from the unsharded model.
Prefix-tree rows (branches that continue a shared prompt) are refused as well: a branch would need the recurrent
state at its fork point.

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, R = MoE blocks, A = active experts.
"""

from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.transformer import MoETransformerBlock
from slipstream.models.qwen3_5_moe.args import Qwen35MoeArgs
from slipstream.models.qwen3_5_moe.layers import (
    GatedAttention,
    GatedDeltaNet,
    GatedSharedExpertMoE,
    ZeroCenteredRMSNorm,
)


def build_block(args: Qwen35MoeArgs, layer: int) -> MoETransformerBlock:
    block = MoETransformerBlock(args, GatedSharedExpertMoE(args))
    block.attn = GatedDeltaNet(args) if args.is_linear_layer(layer) else GatedAttention(args)
    block.attn_norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
    block.mlp_norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
    return block


class Qwen35Moe(MoEDecoderLM):
    """Qwen3.5-MoE blocks: `attn` = GatedDeltaNet on the layers `layer_types` marks "linear_attention" (transformers'
    `linear_attn`), GatedAttention on the "full_attention" ones (`self_attn`); `mlp` = GatedSharedExpertMoE (`router`,
    stacked `experts`, `shared_expert`, `shared_expert_gate`) on every layer; zero-centred RMSNorms.

    API (from DecoderLM and common/moe_model.py): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`,
    `logits`, `forward` (router replay through `replay_BTRA`), `forward_with_aux_loss`, `moe_stats()`,
    `set_grouped_mm`, as Qwen3Moe.
    """

    supports_context_parallel = False
    """Read by whoever sets up context parallelism: this model refuses it (module docstring)."""
    recurrent_state = (
        "qwen3_5_moe",
        "its Gated DeltaNet (linear attention) layers",
        "the linear-attention state",
    )
    supports_prefix_trees = False
    """Rows must hold plain samples: a caller writes prefix trees out as their samples first (trainer/data.py's
    `expand_trees`), or the forward refuses them."""

    def __init__(self, args: Qwen35MoeArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, args.rms_norm_eps)
