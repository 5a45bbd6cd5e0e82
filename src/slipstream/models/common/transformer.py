"""Decoder-only skeleton shared by the families: pre-norm blocks, token embedding, final norm and LM head.

Legend: B = rows of a packed batch, T = tokens per row, D = hidden size, V = vocabulary, K = head dim,
L = blocks that return an auxiliary loss (MoE blocks).
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.args import TransformerArgs
from slipstream.models.common.attention import Attention, AttentionLayout, ContextShard, build_attention_layout
from slipstream.models.common.norm import RMSNorm
from slipstream.models.common.recurrent import refuse_split_state
from slipstream.models.common.rope import rope_cos_sin


def build_attention(args: TransformerArgs) -> Attention:
    return Attention(
        args.hidden_size,
        args.num_heads,
        args.num_kv_heads,
        args.head_dim,
        bias=args.attention_bias,
        qk_norm=args.qk_norm,
        norm_eps=args.rms_norm_eps,
    )


class TransformerBlock(nn.Module):
    """`x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`; `mlp` is a dense SwiGLU or an MoE layer."""

    def __init__(self, args: TransformerArgs, mlp: nn.Module):
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = build_attention(args)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos_BTK, sin_BTK, layout)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

    def init_weights(self, std: float) -> None:
        self.attn_norm.init_weights()
        self.mlp_norm.init_weights()
        self.attn.init_weights(std)
        self.mlp.init_weights(std)


class MoETransformerBlock(TransformerBlock):
    """A block whose `mlp` returns (y, aux_loss) (common/moe.py): returns (x_BTD, aux_loss)."""

    routes_tokens = True
    """Marks the blocks that take a router replay (`replay_BTA`: the experts inference chose, common/moe.py)."""

    def forward(
        self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout, replay_BTA: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos_BTK, sin_BTK, layout)
        y_BTD, aux_loss = self.mlp(self.mlp_norm(x_BTD), replay_BTA)
        return x_BTD + y_BTD, aux_loss


class DecoderLM(nn.Module):
    """Token embedding -> blocks -> final RMSNorm -> LM head, over packed rows (see common/attention.py).

    For the trainer: `forward_hidden` gives per-token hidden states and `lm_head_weight` the [V, D] matrix, so
    log-probs can be computed in chunks without materialising [tokens, V] logits; `forward` gives full logits.
    With tied embeddings there is no `lm_head` module: the head is `embed_tokens.weight` (one parameter, one key).
    A block returns its output, or (output, aux_loss) when it has an auxiliary loss (MoE load balance): those are
    collected by `forward_hidden_with_aux_loss`.
    """

    recurrent_state: tuple[str, str, str] | None = None
    """Families with recurrent layers (linear attention, Mamba): (family, what carries the state, the state's name)
    for common/recurrent.py's refusal of context shards and prefix-tree rows, checked by every forward."""

    def __init__(self, args: TransformerArgs, layers: list[nn.Module]):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, padding_idx=args.pad_token_id)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.packed_attention = "varlen"
        """Kernel for rows of several samples or prefix trees (common/attention.py PACKED_KERNELS)."""
        self.init_weights()

    @property
    def lm_head_weight(self) -> Tensor:
        """The [V, D] output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward_hidden(
        self,
        input_ids_BT: Tensor,
        position_ids_BT: Tensor,
        context: ContextShard | None = None,
        replay_BTRA: Tensor | None = None,
    ) -> Tensor:
        """h_BTD: final-normed hidden states; samples of a row (position_ids restart at 0) never see each other.
        With `context` (context parallelism) the rows are one shard of longer rows (common/attention.py).
        `replay_BTRA`: router replay, the experts inference chose per token for each of the R MoE blocks in depth
        order (-1 where it did not route the token); see common/moe.py."""
        return self.forward_hidden_with_aux_loss(input_ids_BT, position_ids_BT, context, replay_BTRA)[0]

    @property
    def num_moe_blocks(self) -> int:
        return sum(1 for layer in self.layers if getattr(layer, "routes_tokens", False))

    def forward_hidden_with_aux_loss(
        self,
        input_ids_BT: Tensor,
        position_ids_BT: Tensor,
        context: ContextShard | None = None,
        replay_BTRA: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(h_BTD, aux_loss_L): hidden states and the differentiable auxiliary losses of the blocks that have one
        (empty for dense models); adding them to a loss is the caller's choice."""
        if self.recurrent_state is not None:
            refuse_split_state(*self.recurrent_state, context, position_ids_BT)
        if replay_BTRA is not None and replay_BTRA.shape[:3] != (*input_ids_BT.shape, self.num_moe_blocks):
            raise ValueError(
                f"router replay of shape {tuple(replay_BTRA.shape)} for {tuple(input_ids_BT.shape)} tokens and "
                f"{self.num_moe_blocks} MoE blocks"
            )
        h_BTD = self.embed_tokens(input_ids_BT)
        cos_BTK, sin_BTK = rope_cos_sin(self.args.rope, self.args.head_dim, position_ids_BT, h_BTD.dtype)
        device_type = h_BTD.device.type
        autocast = torch.is_autocast_enabled(device_type)
        layout = build_attention_layout(
            position_ids_BT,
            torch.get_autocast_dtype(device_type) if autocast else h_BTD.dtype,
            context,
            self.packed_attention,
        )
        aux_losses = []
        moe_index = 0
        for layer in self.layers:
            if replay_BTRA is not None and getattr(layer, "routes_tokens", False):
                out = layer(h_BTD, cos_BTK, sin_BTK, layout, replay_BTRA[:, :, moe_index])
                moe_index += 1
            else:
                out = layer(h_BTD, cos_BTK, sin_BTK, layout)
            if isinstance(out, tuple):
                out, aux_loss = out
                aux_losses.append(aux_loss)
            h_BTD = out
        aux_loss_L = torch.stack(aux_losses) if aux_losses else h_BTD.new_zeros(0, dtype=torch.float32)
        return self.norm(h_BTD), aux_loss_L

    def logits(self, h_BTD: Tensor) -> Tensor:
        """logits_BTV (in the hidden states' dtype) from `forward_hidden`'s output, or from any slice of it."""
        return F.linear(h_BTD, self.lm_head_weight)

    def forward(self, input_ids_BT: Tensor, position_ids_BT: Tensor) -> Tensor:
        """logits_BTV for a packed batch."""
        return self.logits(self.forward_hidden(input_ids_BT, position_ids_BT))

    def init_weights(self) -> None:
        """Fresh random weights like transformers' init (normal(0, initializer_range), norms at 1); no-op on meta."""
        std = self.args.initializer_range
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        if self.embed_tokens.padding_idx is not None and not self.embed_tokens.weight.is_meta:
            self.embed_tokens.weight.data[self.embed_tokens.padding_idx].zero_()
        for layer in self.layers:
            layer.init_weights(std)
        self.norm.init_weights()
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)
