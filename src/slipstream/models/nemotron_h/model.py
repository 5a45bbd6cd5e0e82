"""Nemotron-H as a plain nn.Module over packed rows (samples separated by position_ids restarting at 0).

Context parallelism is refused: a Mamba2 layer's output at token t depends on every earlier token of its sample
through the SSM state (and the conv's last taps), so a cp shard that starts mid-sample would need the state at its
first token from the ranks before it (state passing, not modelled). All-gathering keys and values, as the attention
layers do, does not give it: the result would silently differ from the unsharded model. Prefix-tree rows (branches
that continue a shared prompt) are refused as well: a branch would need the SSM state at its fork point.

Legend: B = rows, T = tokens per row, D = hidden size, K = head dim, R = MoE blocks, A = active experts.
"""

from torch import Tensor, nn

from slipstream.models.common.attention import AttentionLayout
from slipstream.models.common.moe_model import MoEDecoderLM
from slipstream.models.nemotron_h.args import NemotronHArgs
from slipstream.models.nemotron_h.layers import Mamba2Mixer, NemotronHMoE, NemotronHRMSNorm, NoPEAttention, Relu2MLP


class NemotronHBlock(nn.Module):
    """`x + mixer(norm(x), layout)`: a sequence mixer (Mamba2Mixer or NoPEAttention) behind a pre-norm. The blocks
    take (and ignore) the skeleton's RoPE tables: no Nemotron-H layer rotates."""

    def __init__(self, args: NemotronHArgs, mixer: nn.Module):
        super().__init__()
        self.norm = NemotronHRMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mixer = mixer

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        return x_BTD + self.mixer(self.norm(x_BTD), layout)

    def init_weights(self, std: float) -> None:
        self.norm.init_weights()
        self.mixer.init_weights(std)


class NemotronHMLPBlock(NemotronHBlock):
    """`x + mlp(norm(x))` with the squared-ReLU MLP (token-wise: no layout)."""

    def forward(self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout) -> Tensor:
        return x_BTD + self.mixer(self.norm(x_BTD))


class NemotronHMoEBlock(NemotronHBlock):
    """`x + moe(norm(x))`: returns (x_BTD, aux_loss) and takes a router replay (common/moe.py)."""

    routes_tokens = True

    def forward(
        self, x_BTD: Tensor, cos_BTK: Tensor, sin_BTK: Tensor, layout: AttentionLayout, replay_BTA: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        y_BTD, aux_loss = self.mixer(self.norm(x_BTD), replay_BTA)
        return x_BTD + y_BTD, aux_loss


def build_block(args: NemotronHArgs, layer: int) -> NemotronHBlock:
    kind = args.layer_types[layer]
    if kind == "linear_attention":
        return NemotronHBlock(args, Mamba2Mixer(args))
    if kind == "full_attention":
        return NemotronHBlock(args, NoPEAttention(args))
    if kind == "mlp":
        return NemotronHMLPBlock(args, Relu2MLP(args.hidden_size, args.intermediate_size, args.mlp_bias))
    return NemotronHMoEBlock(args, NemotronHMoE(args))


class NemotronH(MoEDecoderLM):
    """Nemotron-H blocks `layers.{i}` = `norm` + `mixer`, the mixer a Mamba2Mixer ("linear_attention"), NoPEAttention
    ("full_attention"), Relu2MLP ("mlp") or NemotronHMoE ("moe": `router`, stacked `experts`, `shared_experts`,
    optional latent projections), per `layer_types`; untied head, NemotronHRMSNorm everywhere.

    API (from DecoderLM and common/moe_model.py): `forward_hidden`, `forward_hidden_with_aux_loss`, `lm_head_weight`,
    `logits`, `forward` (router replay through `replay_BTRA`), `forward_with_aux_loss`, `moe_stats()`,
    `set_grouped_mm`.
    """

    keep_in_fp32 = ("e_score_correction_bias",)
    """Published in float32 whatever the weights' dtype, as transformers keeps it (`_keep_in_fp32_modules_strict`):
    a rounded selection bias would route differently in inference."""
    supports_context_parallel = False
    """Read by whoever sets up context parallelism: this model refuses it (module docstring)."""
    recurrent_state = ("nemotron_h", "its Mamba2 layers", "the Mamba2 state")
    supports_prefix_trees = False
    """Rows must hold plain samples: a caller writes prefix trees out as their samples first (trainer/logprobs.py),
    or the forward refuses them."""

    def __init__(self, args: NemotronHArgs):
        super().__init__(args, [build_block(args, i) for i in range(args.num_layers)])
        self.norm = NemotronHRMSNorm(args.hidden_size, args.rms_norm_eps)
