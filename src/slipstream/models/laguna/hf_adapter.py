"""Laguna weights: HF <-> ours. Attention keeps transformers' names (plus `g_proj`, the output gate), the two block
norms are renamed as for Llama, `mlp.gate` becomes `mlp.router` (weight and `e_score_correction_bias`), and routed
experts are stacked into [E, ...] tensors (either HF layout, common/hf_experts.py).

Laguna checkpoints name two tensors otherwise than transformers' memory (its conversion mapping renames them on
load and back on save): the selection bias `mlp.experts.e_score_correction_bias` (memory: `mlp.gate.`) and the shared
expert `mlp.shared_expert.*` (memory: `mlp.shared_experts.*`). Import reads either; export writes the checkpoint's
names and per-expert layout (what save_pretrained writes, and vLLM reads)."""

from torch import Tensor

from slipstream.models.common.hf_experts import moe_from_hf, moe_to_hf, sigmoid_moe_pairs
from slipstream.models.common.hf_keys import KeyPairs, attention_pairs, dense_mlp_pairs, embedding_pairs
from slipstream.models.laguna.args import LagunaArgs

CHECKPOINT_NAMES = (
    (".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
    (".mlp.shared_expert.", ".mlp.shared_experts."),
)
"""(checkpoint, transformers' memory) name parts."""


def _renamed(sd: dict[str, Tensor], to_checkpoint: bool) -> dict[str, Tensor]:
    out = {}
    for key, tensor in sd.items():
        for checkpoint, memory in CHECKPOINT_NAMES:
            key = key.replace(memory, checkpoint) if to_checkpoint else key.replace(checkpoint, memory)
        out[key] = tensor
    return out


def key_pairs(args: LagunaArgs, buffers: bool = True) -> KeyPairs:
    """Every key but the routed experts', in transformers' memory names; without the selection biases if not
    `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
        pairs += attention_pairs(args, layer) + [(f"{hf}self_attn.g_proj.weight", f"{ours}attn.g_proj.weight")]
        if args.is_moe_layer(layer):
            pairs += sigmoid_moe_pairs(f"{hf}mlp.", f"{ours}mlp.", "gate.e_score_correction_bias", buffers, True)
        else:
            pairs += dense_mlp_pairs(layer, bias=False)
    return pairs


def moe_layers(args: LagunaArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def from_hf(hf_sd: dict[str, Tensor], args: LagunaArgs) -> dict[str, Tensor]:
    """Our state dict from an HF Laguna state dict (checkpoint or transformers' in-memory layout and names); renamed
    and stacked, nothing cast. A dict without the selection biases (gradients of trained parameters) converts too."""
    hf_sd = _renamed(hf_sd, to_checkpoint=False)
    return moe_from_hf(
        hf_sd, args, pairs=lambda buffers: key_pairs(args, buffers), moe_layers=moe_layers(args), what="laguna from_hf"
    )


def to_hf(sd: dict[str, Tensor], args: LagunaArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict (checkpoint names; experts per expert: views of our [E, ...] tensors, clone before
    save_file)."""
    hf_sd = moe_to_hf(sd, pairs=key_pairs(args), moe_layers=moe_layers(args), what="laguna to_hf")
    return _renamed(hf_sd, to_checkpoint=True)
