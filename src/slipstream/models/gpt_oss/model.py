"""GPT-OSS as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary, H = query heads, E = experts.
"""

from torch import nn

from slipstream.models.common.moe import MoE, TopKRouter
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.common.transformer import MoETransformerBlock
from slipstream.models.gpt_oss.args import GptOssArgs
from slipstream.models.gpt_oss.attention import SinkAttention
from slipstream.models.gpt_oss.experts import BiasedClampedExperts


class GptOssMoE(MoE):
    """Biased experts with the clamped SwiGLU behind a biased softmax router: top-A on the logits, gate weights the
    softmax over the A chosen logits (= the full softmax renormalised over them): transformers' GptOssMLP. Router
    replay, statistics and the sorted-rows dispatch are MoE's."""

    def __init__(self, args: GptOssArgs):
        dim, hidden_dim, num_experts = args.hidden_size, args.moe_intermediate_size, args.num_experts
        super().__init__(dim, hidden_dim, num_experts, args.num_experts_per_tok, norm_topk_prob=True)
        self.router = TopKRouter(dim, num_experts, args.num_experts_per_tok, norm_topk_prob=True, bias=True)
        self.experts = BiasedClampedExperts(
            dim, hidden_dim, num_experts, alpha=args.swiglu_alpha, limit=args.swiglu_limit
        )

    def init_weights(self, std: float) -> None:
        super().init_weights(std)
        nn.init.normal_(self.router.bias, mean=0.0, std=std)


def build_block(args: GptOssArgs, layer: int) -> MoETransformerBlock:
    block = MoETransformerBlock(args, GptOssMoE(args))
    window = args.sliding_window if args.layer_types[layer] == "sliding_attention" else None
    block.attn = SinkAttention(
        args.hidden_size, args.num_heads, args.num_kv_heads, args.head_dim, sliding_window=window
    )
    return block


class GptOss(MoEDecoderLM):
    """GPT-OSS blocks: `attn` (SinkAttention: biases, `sinks`, a sliding window on sliding layers) and `mlp`
    (GptOssMoE: `router` with a bias, `experts` with biases in transformers' fused layout).

    API (from DecoderLM / MoEDecoderLM): `forward_hidden` (context parallelism through `context`),
    `forward_hidden_with_aux_loss`, `lm_head_weight`, `logits`, `forward` (router replay through `replay_BTRA`),
    `forward_with_aux_loss`, `moe_stats()`, `set_grouped_mm`.
    """

    supports_expert_parallel = False
    """The model table runs GPT-OSS without EP (no EP parity test covers its biased, fused experts):
    trainer/setup.py refuses ep > 1. Context parallelism is supported (attention.py)."""

    def __init__(self, args: GptOssArgs):
        super().__init__(args, [build_block(args, layer) for layer in range(args.num_layers)])
