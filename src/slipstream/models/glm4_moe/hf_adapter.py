"""GLM-4.5 MoE weights: HF <-> ours. Dense parts are renamed as for Qwen3 (no o_proj bias), `mlp.gate` becomes
`mlp.router` (weight and `e_score_correction_bias`), `mlp.shared_experts` keeps its name, and routed experts are
stacked into [E, ...] tensors (either HF layout, common/hf_experts.py). Multi-token-prediction layers of the
checkpoint (`model.layers.{i}.*` for i >= num_layers) are dropped on import and absent on export."""

from functools import partial

from torch import Tensor

from slipstream.models.common.hf_experts import moe_from_hf, moe_to_hf, sigmoid_moe_pairs
from slipstream.models.common.hf_keys import KeyPairs, attention_pairs, dense_mlp_pairs, embedding_pairs
from slipstream.models.glm4_moe.args import Glm4MoeArgs


def non_expert_pairs(args: Glm4MoeArgs, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts'; without the routers' `e_score_correction_bias` buffers if not `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += [p for p in attention_pairs(args, layer) if not p[0].endswith("self_attn.o_proj.bias")]
        pairs += mlp_pairs(args, layer, buffers)
    return pairs


def mlp_pairs(args: Glm4MoeArgs, layer: int, buffers: bool) -> KeyPairs:
    """Layer `layer`'s dense SwiGLU, or its MoE block but the routed experts (router, selection bias, shared experts);
    GLM-5 (glm_moe_dsa) names them the same."""
    if not args.is_moe_layer(layer):
        return dense_mlp_pairs(layer, bias=False)
    hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
    return sigmoid_moe_pairs(hf, ours, "gate.e_score_correction_bias", buffers, shared_experts=True)


def moe_layers(args: Glm4MoeArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def from_hf(hf_sd: dict[str, Tensor], args: Glm4MoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF GLM-4.5 MoE state dict: a checkpoint (per-expert layout) or transformers 5.x's
    in-memory one (fused `gate_up_proj`); tensors are renamed, experts stacked, nothing cast. A dict of parameters
    only (gradients: no `e_score_correction_bias` buffer at all) converts too, without the buffers."""
    pairs = partial(non_expert_pairs, args)
    return moe_from_hf(hf_sd, args, pairs=pairs, moe_layers=moe_layers(args), what="glm4_moe from_hf")


def to_hf(sd: dict[str, Tensor], args: Glm4MoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict, experts per expert as views of our [E, ...] tensors (clone before save_file)."""
    return moe_to_hf(sd, pairs=non_expert_pairs(args), moe_layers=moe_layers(args), what="glm4_moe to_hf")
