"""HF <-> ours for stacked MoE experts: our [E, ...] `gate_proj`/`up_proj`/`down_proj` tensors of one layer from an HF
state dict in either expert layout, and back to the per-expert checkpoint layout (views, no copies).

transformers 5.x keeps experts FUSED in memory (`<prefix>gate_up_proj` [E, 2F, D], gate rows first;
`<prefix>down_proj` [E, D, F]) but `save_pretrained` writes, and Hub checkpoints and vLLM use, the PER-EXPERT layout
`<prefix>{e}.{gate,up,down}_proj.weight` (what transformers 4.x also holds in memory).
"""

import torch
from torch import Tensor

from slipstream.models.common.hf_keys import check_keys

PROJS = ("gate_proj", "up_proj", "down_proj")


def pop_stacked_experts(
    hf_sd: dict[str, Tensor], hf_prefix: str, our_prefix: str, num_experts: int
) -> dict[str, Tensor]:
    """Our three stacked tensors (`<our_prefix>{gate,up,down}_proj`), taken out of `hf_sd` (either layout)."""
    if hf_prefix + "gate_up_proj" in hf_sd:
        gate_EFD, up_EFD = hf_sd.pop(hf_prefix + "gate_up_proj").chunk(2, dim=1)
        down_EDF = hf_sd.pop(hf_prefix + "down_proj")
        return {our_prefix + "gate_proj": gate_EFD, our_prefix + "up_proj": up_EFD, our_prefix + "down_proj": down_EDF}
    keys = {p: [f"{hf_prefix}{e}.{p}.weight" for e in range(num_experts)] for p in PROJS}
    found = {k for k in hf_sd if k.startswith(hf_prefix)}
    check_keys(found, [k for ks in keys.values() for k in ks], f"experts {hf_prefix}")
    return {our_prefix + p: torch.stack([hf_sd.pop(k) for k in ks]) for p, ks in keys.items()}


def unstack_experts(sd: dict[str, Tensor], our_prefix: str, hf_prefix: str) -> dict[str, Tensor]:
    """The per-expert checkpoint tensors of one layer, popped from our `sd`: views of our [E, ...] tensors (clone them
    before `safetensors.torch.save_file`, which refuses shared storage)."""
    out = {}
    for p in PROJS:
        for e, weight in enumerate(sd.pop(our_prefix + p).unbind(0)):
            out[f"{hf_prefix}{e}.{p}.weight"] = weight
    return out
