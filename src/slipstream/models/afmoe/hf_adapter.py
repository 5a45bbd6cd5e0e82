"""AFMoE weights: HF <-> ours. Attention keeps transformers' names (plus `gate_proj`, the output gate); the four
block norms are renamed (`input_layernorm` -> `attn_norm`, `post_attention_layernorm` -> `post_attn_norm`,
`pre_mlp_layernorm` -> `mlp_norm`, `post_mlp_layernorm` -> `post_mlp_norm`); in MoE layers `mlp.router.gate.weight`
-> `mlp.router.weight`, `mlp.expert_bias` -> `mlp.router.e_score_correction_bias`, and the experts (fused
`gate_up_proj` in transformers' memory, per expert in checkpoints) are stacked into [E, ...] tensors
(common/hf_experts.py). Export writes the per-expert checkpoint layout (what save_pretrained writes)."""

from torch import Tensor

from slipstream.models.afmoe.args import AfmoeArgs
from slipstream.models.common.hf_experts import PROJS, moe_from_hf, moe_to_hf
from slipstream.models.common.hf_keys import KeyPairs, dense_mlp_pairs, embedding_pairs

NORMS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_mlp_layernorm": "mlp_norm",
    "post_mlp_layernorm": "post_mlp_norm",
}


def layer_pairs(args: AfmoeArgs, layer: int, buffers: bool) -> KeyPairs:
    """Every non-expert key of block `layer`; without the selection bias if not `buffers`."""
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
    pairs = [(f"{hf}{theirs}.weight", f"{ours}{mine}.weight") for theirs, mine in NORMS.items()]
    params = ["weight", "bias"] if args.attention_bias else ["weight"]
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        pairs += [(f"{hf}self_attn.{proj}.{p}", f"{ours}attn.{proj}.{p}") for p in params]
    pairs += [(f"{hf}self_attn.{n}.weight", f"{ours}attn.{n}.weight") for n in ("q_norm", "k_norm", "gate_proj")]
    if not args.is_moe_layer(layer):
        return pairs + dense_mlp_pairs(layer, bias=False)
    pairs.append((f"{hf}mlp.router.gate.weight", f"{ours}mlp.router.weight"))
    if buffers:
        pairs.append((f"{hf}mlp.expert_bias", f"{ours}mlp.router.e_score_correction_bias"))
    return pairs + [(f"{hf}mlp.shared_experts.{p}.weight", f"{ours}mlp.shared_experts.{p}.weight") for p in PROJS]


def key_pairs(args: AfmoeArgs, buffers: bool = True) -> KeyPairs:
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += layer_pairs(args, layer, buffers)
    return pairs


def moe_layers(args: AfmoeArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def from_hf(hf_sd: dict[str, Tensor], args: AfmoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF AFMoE state dict (checkpoint or transformers' in-memory layout); renamed and stacked,
    nothing cast. A dict without the `expert_bias` tensors (gradients of trained parameters only) converts too."""
    buffers = any(k.endswith("mlp.expert_bias") for k in hf_sd)
    return moe_from_hf(
        hf_sd, args, pairs=lambda _: key_pairs(args, buffers), moe_layers=moe_layers(args), what="afmoe from_hf"
    )


def to_hf(sd: dict[str, Tensor], args: AfmoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict (experts per expert: views of our [E, ...] tensors, clone before save_file)."""
    return moe_to_hf(sd, pairs=key_pairs(args), moe_layers=moe_layers(args), what="afmoe to_hf")
