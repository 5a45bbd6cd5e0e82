"""Nemotron-H weights: HF <-> ours. Checkpoints name the decoder `backbone.` (transformers' in-memory model:
`model.`); both import. Ours drops the prefix (`backbone.embeddings` -> `embed_tokens`, `backbone.norm_f` -> `norm`)
and keeps every block's names (`layers.{i}.norm`, `layers.{i}.mixer.*`) except the MoE router (`mixer.gate.weight`
-> `mixer.router.weight`, `mixer.gate.e_score_correction_bias` -> `mixer.router.e_score_correction_bias`) and the
routed experts: per expert in checkpoints (`mixer.experts.{e}.{up,down}_proj.weight`), stacked in transformers'
memory and ours (`mixer.experts.{up,down}_proj` [E, ...]). Export writes the checkpoint layout (what save_pretrained
writes). Multi-token-prediction weights (`mtp.*`, and any layer past the decoder's) are dropped on import."""

import re

import torch
from torch import Tensor

from slipstream.models.common.hf_keys import KeyPairs, check_keys, rename_keys
from slipstream.models.nemotron_h.args import NemotronHArgs

PREFIX = "backbone."
EXPERT_PROJS = ("up_proj", "down_proj")
_LAYER_RE = re.compile(r"^backbone\.layers\.(\d+)\.")


def _biased(names: list[str], bias: bool) -> list[str]:
    """`{name}.weight` for each linear of `names`, and `{name}.bias` if `bias`."""
    return [f"{n}.{p}" for n in names for p in (("weight", "bias") if bias else ("weight",))]


def mixer_names(args: NemotronHArgs, layer: int, buffers: bool) -> list[tuple[str, str]]:
    """(HF name, our name) of every non-expert tensor of block `layer`'s mixer, relative to `mixer.`."""
    kind = args.layer_types[layer]
    if kind == "linear_attention":
        names = ["dt_bias", "A_log", "D", "norm.weight", "conv1d.weight"] + (
            ["conv1d.bias"] if args.use_conv_bias else []
        )
        names += _biased(["in_proj", "out_proj"], args.mamba_bias)
    elif kind == "full_attention":
        names = _biased(["q_proj", "k_proj", "v_proj", "o_proj"], False)
    elif kind == "mlp":
        names = _biased(["up_proj", "down_proj"], args.mlp_bias)
    else:
        latent = ["fc1_latent_proj", "fc2_latent_proj"] if args.moe_latent_size is not None else []
        names = _biased(["shared_experts.up_proj", "shared_experts.down_proj", *latent], args.mlp_bias)
        pairs = [("gate.weight", "router.weight")]
        if buffers:
            pairs.append(("gate.e_score_correction_bias", "router.e_score_correction_bias"))
        return pairs + [(n, n) for n in names]
    return [(n, n) for n in names]


def key_pairs(args: NemotronHArgs, buffers: bool = True) -> KeyPairs:
    """Every key but the routed experts', HF checkpoint names (`backbone.`); without the selection biases if not
    `buffers`."""
    pairs = [(f"{PREFIX}embeddings.weight", "embed_tokens.weight"), (f"{PREFIX}norm_f.weight", "norm.weight")]
    pairs.append(("lm_head.weight", "lm_head.weight"))
    for layer in range(args.num_layers):
        hf, ours = f"{PREFIX}layers.{layer}.", f"layers.{layer}."
        pairs.append((f"{hf}norm.weight", f"{ours}norm.weight"))
        pairs += [(f"{hf}mixer.{theirs}", f"{ours}mixer.{mine}") for theirs, mine in mixer_names(args, layer, buffers)]
    return pairs


def moe_layers(args: NemotronHArgs) -> list[int]:
    return [layer for layer in range(args.num_layers) if args.is_moe_layer(layer)]


def _checkpoint_names(hf_sd: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """`model.` -> `backbone.` (transformers' in-memory names), without `mtp.*` and layers past `num_layers`."""
    out = {}
    for key, tensor in hf_sd.items():
        key = PREFIX + key.removeprefix("model.") if key.startswith("model.") else key
        m = _LAYER_RE.match(key)
        if key.startswith("mtp.") or (m is not None and int(m.group(1)) >= num_layers):
            continue
        out[key] = tensor
    return out


def _pop_experts(hf_sd: dict[str, Tensor], hf: str, ours: str, num_experts: int) -> dict[str, Tensor]:
    """Our stacked `up_proj`/`down_proj` of one layer, taken out of `hf_sd` (stacked or per-expert layout)."""
    if hf + "up_proj" in hf_sd:
        return {ours + p: hf_sd.pop(hf + p) for p in EXPERT_PROJS}
    keys = {p: [f"{hf}{e}.{p}.weight" for e in range(num_experts)] for p in EXPERT_PROJS}
    check_keys({k for k in hf_sd if k.startswith(hf)}, [k for ks in keys.values() for k in ks], f"experts {hf}")
    return {ours + p: torch.stack([hf_sd.pop(k) for k in ks]) for p, ks in keys.items()}


def from_hf(hf_sd: dict[str, Tensor], args: NemotronHArgs) -> dict[str, Tensor]:
    """Our state dict from an HF Nemotron-H state dict (checkpoint or transformers' in-memory layout), nothing cast.
    A dict without the selection biases (gradients of trained parameters only) converts too."""
    hf_sd = _checkpoint_names(hf_sd, args.num_layers)
    buffers = any(k.endswith("e_score_correction_bias") for k in hf_sd)
    experts = {}
    for layer in moe_layers(args):
        hf, ours = f"{PREFIX}layers.{layer}.mixer.experts.", f"layers.{layer}.mixer.experts."
        experts.update(_pop_experts(hf_sd, hf, ours, args.num_experts))
    return {**rename_keys(hf_sd, key_pairs(args, buffers), to_hf=False, what="nemotron_h from_hf"), **experts}


def to_hf(sd: dict[str, Tensor], args: NemotronHArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict (experts per expert: views of our [E, ...] tensors, clone before save_file)."""
    sd = dict(sd)
    experts = {}
    for layer in moe_layers(args):
        ours, hf = f"layers.{layer}.mixer.experts.", f"{PREFIX}layers.{layer}.mixer.experts."
        for p in EXPERT_PROJS:
            for e, weight in enumerate(sd.pop(ours + p).unbind(0)):
                experts[f"{hf}{e}.{p}.weight"] = weight
    return {**rename_keys(sd, key_pairs(args), to_hf=True, what="nemotron_h to_hf"), **experts}
