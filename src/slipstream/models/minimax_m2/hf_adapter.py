"""MiniMax-M2 weights: HF <-> ours. Attention and norms are renamed as for Qwen3 (q/k norms of full width), the MoE
block (`block_sparse_moe` in checkpoints, `mlp` in transformers 5.x's memory) becomes `mlp`: `gate.weight` ->
`router.weight`, the block's `e_score_correction_bias` -> `router.e_score_correction_bias`, and the experts
(`experts.{e}.w1/w3/w2.weight` = gate/up/down in checkpoints, fused `gate_up_proj`/`down_proj` in memory) are stacked
into [E, ...] tensors. Export writes the checkpoint layout (what save_pretrained writes and vLLM loads).
Multi-token-prediction modules of the checkpoint (`model.layers.{i}.*` for i >= num_layers) are dropped on import."""

import re

import torch
from torch import Tensor

from slipstream.models.common.hf_experts import PROJS, pop_stacked_experts
from slipstream.models.common.hf_keys import KeyPairs, attention_pairs, embedding_pairs, prepare_hf, rename_keys
from slipstream.models.minimax_m2.args import MiniMaxM2Args

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_CHECKPOINT_PROJS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def non_expert_pairs(args: MiniMaxM2Args, moe: str, buffers: bool = True) -> KeyPairs:
    """All keys but the routed experts', with the MoE block named `moe` (`block_sparse_moe` or `mlp`); without the
    `e_score_correction_bias` buffers if not `buffers`."""
    pairs = embedding_pairs(args)
    for layer in range(args.num_layers):
        pairs += attention_pairs(args, layer)
        hf, ours = f"model.layers.{layer}.{moe}.", f"layers.{layer}.mlp."
        pairs.append((hf + "gate.weight", ours + "router.weight"))
        if buffers:
            pairs.append((hf + "e_score_correction_bias", ours + "router.e_score_correction_bias"))
    return pairs


def _drop_mtp_layers(hf_sd: dict[str, Tensor], args: MiniMaxM2Args) -> dict[str, Tensor]:
    out = {}
    for key, tensor in hf_sd.items():
        m = _LAYER_RE.match(key)
        if m is None or int(m.group(1)) < args.num_layers:
            out[key] = tensor
    return out


def _pop_checkpoint_experts(hf_sd: dict[str, Tensor], hf_prefix: str, our_prefix: str, num_experts: int):
    """Checkpoint layout (`{e}.w1/w2/w3.weight`) renamed to `{e}.{gate,up,down}_proj.weight`, then stacked."""
    renamed = {}
    for e in range(num_experts):
        for ours, theirs in _CHECKPOINT_PROJS.items():
            key = f"{hf_prefix}{e}.{theirs}.weight"
            if key in hf_sd:
                renamed[f"{hf_prefix}{e}.{ours}.weight"] = hf_sd.pop(key)
    hf_sd.update(renamed)
    return pop_stacked_experts(hf_sd, hf_prefix, our_prefix, num_experts)


def from_hf(hf_sd: dict[str, Tensor], args: MiniMaxM2Args) -> dict[str, Tensor]:
    """Our state dict from an HF MiniMax-M2 state dict: a checkpoint (`block_sparse_moe`, per-expert w1/w2/w3) or
    transformers 5.x's in-memory one (`mlp`, fused `gate_up_proj`); renamed and stacked, nothing cast. A dict of
    parameters only (gradients: no `e_score_correction_bias` buffer) converts too, without the buffers."""
    hf_sd = prepare_hf(_drop_mtp_layers(hf_sd, args), args)
    moe = "block_sparse_moe" if any(".block_sparse_moe." in k for k in hf_sd) else "mlp"
    buffers = any(k.endswith(f".{moe}.e_score_correction_bias") for k in hf_sd)
    experts = {}
    for layer in range(args.num_layers):
        hf, ours = f"model.layers.{layer}.{moe}.experts.", f"layers.{layer}.mlp.experts."
        experts.update(_pop_checkpoint_experts(hf_sd, hf, ours, args.num_experts))
    renamed = rename_keys(hf_sd, non_expert_pairs(args, moe, buffers), to_hf=False, what="minimax_m2 from_hf")
    return {**renamed, **experts}


def to_hf(sd: dict[str, Tensor], args: MiniMaxM2Args) -> dict[str, Tensor]:
    """HF checkpoint state dict (`block_sparse_moe`, experts per expert as w1/w2/w3: views of our [E, ...] tensors,
    clone before save_file)."""
    sd = dict(sd)
    experts = {}
    for layer in range(args.num_layers):
        ours, hf = f"layers.{layer}.mlp.experts.", f"model.layers.{layer}.block_sparse_moe.experts."
        for proj in PROJS:
            stacked: torch.Tensor = sd.pop(ours + proj)
            for e, weight in enumerate(stacked.unbind(0)):
                experts[f"{hf}{e}.{_CHECKPOINT_PROJS[proj]}.weight"] = weight
    pairs = non_expert_pairs(args, "block_sparse_moe")
    return {**rename_keys(sd, pairs, to_hf=True, what="minimax_m2 to_hf"), **experts}
