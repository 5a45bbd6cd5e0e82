"""Llama as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Legend: B = rows, T = tokens per row, D = hidden size, V = vocabulary.
"""

from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.transformer import DecoderLM, TransformerBlock
from slipstream.models.llama.args import LlamaArgs


class Llama(DecoderLM):
    """embed -> [x + attn(norm(x)); x + swiglu(norm(x))] * L -> norm -> lm_head (tied to embed when configured).

    API (from DecoderLM): `forward_hidden(input_ids_BT, position_ids_BT) -> h_BTD`, `lm_head_weight` ([V, D]),
    `logits(h_BTD) -> logits_BTV`, `forward(input_ids_BT, position_ids_BT) -> logits_BTV`.
    """

    def __init__(self, args: LlamaArgs):
        layers = [
            TransformerBlock(args, SwiGLU(args.hidden_size, args.intermediate_size, bias=args.mlp_bias))
            for _ in range(args.num_layers)
        ]
        super().__init__(args, layers)
