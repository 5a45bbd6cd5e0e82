"""HF <-> ours for MoE families: stacked experts (our [E, ...] `gate_proj`/`up_proj`/`down_proj` tensors of one layer
from an HF state dict in either expert layout, and back to the per-expert checkpoint layout, as views), and the whole
conversion of a family whose non-expert keys are a plain rename table.

transformers 5.x keeps experts FUSED in memory (`<prefix>gate_up_proj` [E, 2F, D], gate rows first;
`<prefix>down_proj` [E, D, F]) but `save_pretrained` writes, and Hub checkpoints and vLLM use, the PER-EXPERT layout
`<prefix>{e}.{gate,up,down}_proj.weight` (what transformers 4.x also holds in memory). Some families name the
per-expert projections otherwise in their checkpoints (MiniMax-M2: w1/w3/w2): `names` maps ours to theirs.
"""

import re
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from slipstream.models.common.hf_keys import KeyPairs, check_keys, prepare_hf, rename_keys

PROJS = ("gate_proj", "up_proj", "down_proj")
IDENTITY_NAMES = {p: p for p in PROJS}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def pop_stacked_experts(
    hf_sd: dict[str, Tensor],
    hf_prefix: str,
    our_prefix: str,
    num_experts: int,
    names: Mapping[str, str] = IDENTITY_NAMES,
) -> dict[str, Tensor]:
    """Our three stacked tensors (`<our_prefix>{gate,up,down}_proj`), taken out of `hf_sd` (either layout; the
    per-expert one with the checkpoint's projection `names`)."""
    if hf_prefix + "gate_up_proj" in hf_sd:
        gate_EFD, up_EFD = hf_sd.pop(hf_prefix + "gate_up_proj").chunk(2, dim=1)
        down_EDF = hf_sd.pop(hf_prefix + "down_proj")
        return {our_prefix + "gate_proj": gate_EFD, our_prefix + "up_proj": up_EFD, our_prefix + "down_proj": down_EDF}
    keys = {p: [f"{hf_prefix}{e}.{names[p]}.weight" for e in range(num_experts)] for p in PROJS}
    found = {k for k in hf_sd if k.startswith(hf_prefix)}
    check_keys(found, [k for ks in keys.values() for k in ks], f"experts {hf_prefix}")
    return {our_prefix + p: torch.stack([hf_sd.pop(k) for k in ks]) for p, ks in keys.items()}


def unstack_experts(
    sd: dict[str, Tensor], our_prefix: str, hf_prefix: str, names: Mapping[str, str] = IDENTITY_NAMES
) -> dict[str, Tensor]:
    """The per-expert checkpoint tensors of one layer, popped from our `sd`: views of our [E, ...] tensors (clone them
    before `safetensors.torch.save_file`, which refuses shared storage)."""
    out = {}
    for p in PROJS:
        for e, weight in enumerate(sd.pop(our_prefix + p).unbind(0)):
            out[f"{hf_prefix}{e}.{names[p]}.weight"] = weight
    return out


def drop_layers_from(hf_sd: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Without `model.layers.{i}.*` for i >= num_layers: the multi-token-prediction layers that GLM and MiniMax
    checkpoints hold after the decoder layers (not modelled; vLLM's loaders skip them too)."""
    out = {}
    for key, tensor in hf_sd.items():
        m = _LAYER_RE.match(key)
        if m is None or int(m.group(1)) < num_layers:
            out[key] = tensor
    return out


def sigmoid_moe_pairs(hf: str, ours: str, bias_key: str, buffers: bool, shared_experts: bool) -> KeyPairs:
    """An MoE block's router (`{hf}gate.weight` -> `{ours}router.weight`, and its selection bias `{hf}{bias_key}`
    unless not `buffers`) and, with `shared_experts`, its dense shared SwiGLU (same names on both sides)."""
    pairs = [(hf + "gate.weight", ours + "router.weight")]
    if buffers:
        pairs.append((hf + bias_key, ours + "router.e_score_correction_bias"))
    if shared_experts:
        pairs += [(f"{hf}shared_experts.{p}.weight", f"{ours}shared_experts.{p}.weight") for p in PROJS]
    return pairs


def moe_from_hf(
    hf_sd: dict[str, Tensor],
    args,
    *,
    pairs: Callable[[bool], KeyPairs],
    moe_layers: list[int],
    hf_block: str = "mlp",
    names: Mapping[str, str] = IDENTITY_NAMES,
    what: str,
) -> dict[str, Tensor]:
    """Our state dict from an HF one: layers past `args.num_layers` (MTP) dropped, experts of the `moe_layers` (under
    `model.layers.{i}.{hf_block}.experts.`) stacked, every other key renamed through `pairs(buffers)`; nothing cast.
    `buffers` says whether the routers' selection biases are there (a dict of parameters only, such as gradients,
    has none)."""
    hf_sd = prepare_hf(drop_layers_from(hf_sd, args.num_layers), args)
    buffers = any(k.endswith("e_score_correction_bias") for k in hf_sd)
    experts = {}
    for layer in moe_layers:
        hf, ours = f"model.layers.{layer}.{hf_block}.experts.", f"layers.{layer}.mlp.experts."
        experts.update(pop_stacked_experts(hf_sd, hf, ours, args.num_experts, names))
    return {**rename_keys(hf_sd, pairs(buffers), to_hf=False, what=what), **experts}


def moe_to_hf(
    sd: dict[str, Tensor],
    *,
    pairs: KeyPairs,
    moe_layers: list[int],
    hf_block: str = "mlp",
    names: Mapping[str, str] = IDENTITY_NAMES,
    what: str,
) -> dict[str, Tensor]:
    """HF checkpoint state dict: experts per expert (views of our [E, ...] tensors, clone before save_file), every
    other key renamed through `pairs`."""
    sd = dict(sd)
    experts = {}
    for layer in moe_layers:
        ours, hf = f"layers.{layer}.mlp.experts.", f"model.layers.{layer}.{hf_block}.experts."
        experts.update(unstack_experts(sd, ours, hf, names))
    return {**rename_keys(sd, pairs, to_hf=True, what=what), **experts}
