"""Qwen3-MoE weights: HF <-> ours. Dense parts are renamed as for Qwen3, `mlp.gate` becomes `mlp.router`, and
per-expert weights are stacked into [E, ...] tensors (see `from_hf` for the two HF expert layouts)."""

import torch
from torch import Tensor

from slipstream.models.common.hf_keys import (
    KeyPairs,
    attention_pairs,
    check_keys,
    dense_mlp_pairs,
    embedding_pairs,
    prepare_hf,
    rename_keys,
)
from slipstream.models.qwen3_moe.args import Qwen3MoeArgs

PROJS = ("gate_proj", "up_proj", "down_proj")


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


def _pop_experts(hf_sd: dict[str, Tensor], args: Qwen3MoeArgs, layer: int) -> dict[str, Tensor]:
    """Our three stacked tensors of one layer, taken out of `hf_sd` (per-expert or fused layout)."""
    hf, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
    if hf + "gate_up_proj" in hf_sd:
        gate_EFD, up_EFD = hf_sd.pop(hf + "gate_up_proj").chunk(2, dim=1)
        return {ours + "gate_proj": gate_EFD, ours + "up_proj": up_EFD, ours + "down_proj": hf_sd.pop(hf + "down_proj")}
    keys = {p: [f"{hf}{e}.{p}.weight" for e in range(args.num_experts)] for p in PROJS}
    check_keys({k for k in hf_sd if k.startswith(hf)}, [k for ks in keys.values() for k in ks], f"experts {layer}")
    return {ours + p: torch.stack([hf_sd.pop(k) for k in ks]) for p, ks in keys.items()}


def from_hf(hf_sd: dict[str, Tensor], args: Qwen3MoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF Qwen3-MoE state dict, in either expert layout.

    transformers 5.x keeps experts FUSED in memory (`mlp.experts.gate_up_proj` [E, 2F, D], gate rows first;
    `mlp.experts.down_proj` [E, D, F]) but `save_pretrained` writes, and Hub checkpoints and vLLM use, the
    PER-EXPERT layout `mlp.experts.{e}.{gate,up,down}_proj.weight` (what transformers 4.x also holds in memory).
    """
    hf_sd = prepare_hf(hf_sd, args)
    experts = {}
    for layer in _moe_layers(args):
        experts.update(_pop_experts(hf_sd, args, layer))
    return {**rename_keys(hf_sd, non_expert_pairs(args), to_hf=False, what="qwen3_moe from_hf"), **experts}


def to_hf(sd: dict[str, Tensor], args: Qwen3MoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict in the per-expert layout. Unstacking does not copy: the per-expert tensors are views
    of our [E, ...] tensors, so clone them before `safetensors.torch.save_file` (it refuses shared storage)."""
    sd = dict(sd)
    experts = {}
    for layer in _moe_layers(args):
        for p in PROJS:
            stacked = sd.pop(f"layers.{layer}.mlp.experts.{p}")
            for e, weight in enumerate(stacked.unbind(0)):
                experts[f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"] = weight
    return {**rename_keys(sd, non_expert_pairs(args), to_hf=True, what="qwen3_moe to_hf"), **experts}
