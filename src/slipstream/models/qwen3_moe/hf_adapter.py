"""Qwen3-MoE weights: HF <-> ours. Dense parts are renamed as for Qwen3, `mlp.gate` becomes `mlp.router`, and
per-expert weights are stacked into [E, ...] tensors (see `from_hf` for the two HF expert layouts)."""

from torch import Tensor

from slipstream.models.common.hf_experts import pop_stacked_experts, unstack_experts
from slipstream.models.common.hf_keys import (
    KeyPairs,
    attention_pairs,
    dense_mlp_pairs,
    embedding_pairs,
    prepare_hf,
    rename_keys,
)
from slipstream.models.qwen3_moe.args import Qwen3MoeArgs


def non_expert_pairs(args: Qwen3MoeArgs) -> KeyPairs:
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += attention_pairs(args, layer)
        if args.is_moe_layer(layer):
            pairs.append((f"model.layers.{layer}.mlp.gate.weight", f"layers.{layer}.mlp.router.weight"))
        else:
            pairs += dense_mlp_pairs(layer, bias=False)
    return pairs


def _moe_layers(args: Qwen3MoeArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def from_hf(hf_sd: dict[str, Tensor], args: Qwen3MoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF Qwen3-MoE state dict, in either expert layout.

    transformers 5.x keeps experts FUSED in memory (`mlp.experts.gate_up_proj` [E, 2F, D], gate rows first;
    `mlp.experts.down_proj` [E, D, F]) but `save_pretrained` writes, and Hub checkpoints and vLLM use, the
    PER-EXPERT layout `mlp.experts.{e}.{gate,up,down}_proj.weight` (what transformers 4.x also holds in memory).
    """
    hf_sd = prepare_hf(hf_sd, args)
    experts = {}
    for layer in _moe_layers(args):
        hf, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
        experts.update(pop_stacked_experts(hf_sd, hf, ours, args.num_experts))
    return {**rename_keys(hf_sd, non_expert_pairs(args), to_hf=False, what="qwen3_moe from_hf"), **experts}


def to_hf(sd: dict[str, Tensor], args: Qwen3MoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict in the per-expert layout. Unstacking does not copy: the per-expert tensors are views
    of our [E, ...] tensors, so clone them before `safetensors.torch.save_file` (it refuses shared storage)."""
    sd = dict(sd)
    experts = {}
    for layer in _moe_layers(args):
        experts.update(unstack_experts(sd, f"layers.{layer}.mlp.experts.", f"model.layers.{layer}.mlp.experts."))
    return {**rename_keys(sd, non_expert_pairs(args), to_hf=True, what="qwen3_moe to_hf"), **experts}
