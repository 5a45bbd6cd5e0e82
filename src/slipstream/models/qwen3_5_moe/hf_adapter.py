"""Qwen3.5-MoE weights: HF <-> ours. Norms keep their names under our block names (`input_layernorm` -> `attn_norm`,
`post_attention_layernorm` -> `mlp_norm`); a layer's token mixer, `linear_attn` (Gated DeltaNet) or `self_attn` (gated
attention), becomes `attn` with transformers' parameter names; `mlp.gate` becomes `mlp.router`, `mlp.shared_expert`
and `mlp.shared_expert_gate` keep theirs, and routed experts are stacked into [E, ...] tensors from either HF layout
(common/hf_experts.py). Multi-token-prediction weights (`mtp.*`) are dropped on import and absent on export."""

from functools import partial

from torch import Tensor

from slipstream.models.common.hf_experts import PROJS, moe_from_hf, moe_to_hf
from slipstream.models.common.hf_keys import KeyPairs, embedding_pairs
from slipstream.models.qwen3_5_moe.args import Qwen35MoeArgs

_LINEAR = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight", "in_proj_qkv.weight",
           "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # fmt: skip
_FULL = ("q_norm.weight", "k_norm.weight")
_FULL_BIASED = ("q_proj", "k_proj", "v_proj", "o_proj")


def layer_pairs(args: Qwen35MoeArgs, layer: int) -> KeyPairs:
    """Block `layer`: both norms, its token mixer and its MoE block but the routed experts."""
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
    pairs = [
        (hf + "input_layernorm.weight", ours + "attn_norm.weight"),
        (hf + "post_attention_layernorm.weight", ours + "mlp_norm.weight"),
        (hf + "mlp.gate.weight", ours + "mlp.router.weight"),
        (hf + "mlp.shared_expert_gate.weight", ours + "mlp.shared_expert_gate.weight"),
    ]
    pairs += [(f"{hf}mlp.shared_expert.{p}.weight", f"{ours}mlp.shared_expert.{p}.weight") for p in PROJS]
    if args.is_linear_layer(layer):
        return pairs + [(f"{hf}linear_attn.{n}", f"{ours}attn.{n}") for n in _LINEAR]
    params = ["weight", "bias"] if args.attention_bias else ["weight"]
    names = list(_FULL) + [f"{proj}.{p}" for proj in _FULL_BIASED for p in params]
    return pairs + [(f"{hf}self_attn.{n}", f"{ours}attn.{n}") for n in names]


def non_expert_pairs(args: Qwen35MoeArgs, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts' (the family has no buffers: `buffers` is moe_from_hf's argument)."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += layer_pairs(args, layer)
    return pairs


def _moe_layers(args: Qwen35MoeArgs) -> list[int]:
    return list(range(args.num_layers))


def from_hf(hf_sd: dict[str, Tensor], args: Qwen35MoeArgs) -> dict[str, Tensor]:
    """Our state dict from an HF Qwen3.5-MoE text state dict (checkpoint or transformers' in-memory layout), nothing
    cast; `mtp.*` (multi-token prediction) dropped."""
    hf_sd = {k: v for k, v in hf_sd.items() if not k.startswith("mtp.")}
    pairs = partial(non_expert_pairs, args)
    return moe_from_hf(hf_sd, args, pairs=pairs, moe_layers=_moe_layers(args), what="qwen3_5_moe from_hf")


def to_hf(sd: dict[str, Tensor], args: Qwen35MoeArgs) -> dict[str, Tensor]:
    """HF checkpoint state dict, experts per expert as views of our [E, ...] tensors (clone before save_file)."""
    return moe_to_hf(sd, pairs=non_expert_pairs(args), moe_layers=_moe_layers(args), what="qwen3_5_moe to_hf")
