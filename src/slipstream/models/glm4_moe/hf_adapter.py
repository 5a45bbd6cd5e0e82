"""GLM-4.5 MoE weights: HF <-> ours. Dense parts are renamed as for Qwen3 (no o_proj bias), `mlp.gate` becomes
`mlp.router` (weight and `e_score_correction_bias`), `mlp.shared_experts` keeps its name, and routed experts are
stacked into [E, ...] tensors (either HF layout, common/hf_experts.py). Multi-token-prediction layers of the
checkpoint (`model.layers.{i}.*` for i >= num_layers) are dropped on import and absent on export."""

import re

from torch import Tensor

from slipstream.models.common.hf_experts import PROJS, pop_stacked_experts, unstack_experts
from slipstream.models.common.hf_keys import (
    KeyPairs,
    attention_pairs,
    dense_mlp_pairs,
    embedding_pairs,
    prepare_hf,
    rename_keys,
)
from slipstream.models.glm4_moe.args import Glm4MoeArgs

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def non_expert_pairs(args: Glm4MoeArgs, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts'; without the routers' `e_score_correction_bias` buffers if not `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += [p for p in attention_pairs(args, layer) if not p[0].endswith("self_attn.o_proj.bias")]
        if args.is_moe_layer(layer):
            hf, ours = f"model.layers.{layer}.mlp.", f"layers.{layer}.mlp."
            pairs.append((hf + "gate.weight", ours + "router.weight"))
            if buffers:
                pairs.append((hf + "gate.e_score_correction_bias", ours + "router.e_score_correction_bias"))
            pairs += [(f"{hf}shared_experts.{p}.weight", f"{ours}shared_experts.{p}.weight") for p in PROJS]
        else:
            pairs += dense_mlp_pairs(layer, bias=False)
    return pairs


def _moe_layers(args: Glm4MoeArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def _drop_mtp_layers(hf_sd: dict[str, Tensor], args: Glm4MoeArgs) -> dict[str, Tensor]:
    """Without the multi-token-prediction layers (`model.layers.{i}` for i >= num_layers; not modelled)."""
    out = {}
    for key, tensor in hf_sd.items():
        m = _LAYER_RE.match(key)
        if m is None or int(m.group(1)) < args.num_layers:
            out[key] = tensor
    return out


def from_hf(hf_sd: dict[str, Tensor], args: Glm4MoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF GLM-4.5 MoE state dict: a checkpoint (per-expert layout) or transformers 5.x's
    in-memory one (fused `gate_up_proj`); tensors are renamed, experts stacked, nothing cast. A dict of parameters
    only (gradients: no `e_score_correction_bias` buffer at all) converts too, without the buffers."""
    hf_sd = prepare_hf(_drop_mtp_layers(hf_sd, args), args)
    buffers = any(k.endswith(".mlp.gate.e_score_correction_bias") for k in hf_sd)
    experts = {}
    for layer in _moe_layers(args):
        hf, ours = f"model.layers.{layer}.mlp.experts.", f"layers.{layer}.mlp.experts."
        experts.update(pop_stacked_experts(hf_sd, hf, ours, args.num_experts))
    renamed = rename_keys(hf_sd, non_expert_pairs(args, buffers), to_hf=False, what="glm4_moe from_hf")
    return {**renamed, **experts}


def to_hf(sd: dict[str, Tensor], args: Glm4MoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict, experts per expert as views of our [E, ...] tensors (clone before save_file)."""
    sd = dict(sd)
    experts = {}
    for layer in _moe_layers(args):
        experts.update(unstack_experts(sd, f"layers.{layer}.mlp.experts.", f"model.layers.{layer}.mlp.experts."))
    return {**rename_keys(sd, non_expert_pairs(args), to_hf=True, what="glm4_moe to_hf"), **experts}
