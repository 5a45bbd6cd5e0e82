"""GPT-OSS experts on the shared sorted-rows interface (common/moe.py: rows sorted by expert, per-expert counts;
grouped GEMM or the per-expert loop), with per-expert biases and GPT-OSS's clamped SwiGLU.

The weights keep transformers' layout (x @ W, gate and up INTERLEAVED in one tensor), not GroupedExperts' stacked
nn.Linear one: the HF export is then a rename (the same tensors, which the trainer's layer-by-layer weight stream,
weights/send/export.py, needs), and one grouped GEMM computes gate and up together. Still a GroupedExperts (LoRA
refuses it by name; expert parallelism is refused for the family: gpt_oss/model.py).

Legend: M = routed (token, expert) rows sorted by expert, D = hidden size, F = expert width, E = experts.
"""

import torch
from torch import Tensor, nn

from slipstream.models.common.moe import GroupedExperts, _local, grouped_mm, grouped_mm_dtype


def clamped_swiglu(gate_up_M2F: Tensor, alpha: float, limit: float) -> Tensor:
    """(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g) with g = clamp(gate, max=l), gate and up interleaved
    (transformers' GptOssExperts)."""
    gate_MF, up_MF = gate_up_M2F[..., 0::2], gate_up_M2F[..., 1::2]
    gate_MF = gate_MF.clamp(max=limit)
    up_MF = up_MF.clamp(min=-limit, max=limit)
    return (up_MF + 1) * (gate_MF * torch.sigmoid(gate_MF * alpha))


class BiasedClampedExperts(GroupedExperts):
    """`gate_up_proj` [E, D, 2F] (gate = even columns), `gate_up_proj_bias` [E, 2F], `down_proj` [E, F, D],
    `down_proj_bias` [E, D]; y = (clamped_swiglu(x W_gu + b_gu)) W_d + b_d for each row's expert."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, *, alpha: float, limit: float):
        nn.Module.__init__(self)  # not GroupedExperts' stacked nn.Linear-layout weights (see the module docstring)
        self.num_experts, self.use_grouped_mm = num_experts, True
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        """y_MD: row m through the biased clamped SwiGLU of the expert it is sorted under."""
        names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        weights = tuple(_local(getattr(self, n)) for n in names)
        if self.use_grouped_mm:
            return self._grouped_biased(x_MD, counts_E, *weights)
        return self._loop_biased(x_MD, counts_E, *weights)

    def _loop_biased(self, x_MD, counts_E, gate_up_ED2F, gate_up_E2F, down_EFD, down_ED) -> Tensor:
        outputs = []
        # Experts without rows still run (empty matmuls), so every expert weight gets a gradient (see GroupedExperts).
        for e, x_mD in enumerate(torch.split(x_MD, counts_E.tolist())):
            h_mF = clamped_swiglu(x_mD @ gate_up_ED2F[e] + gate_up_E2F[e], self.alpha, self.limit)
            outputs.append(h_mF @ down_EFD[e] + down_ED[e])
        return torch.cat(outputs)

    def _grouped_biased(self, x_MD, counts_E, gate_up_ED2F, gate_up_E2F, down_EFD, down_ED) -> Tensor:
        dtype = grouped_mm_dtype(x_MD.device.type, gate_up_ED2F.dtype)
        x_MD, gate_up_ED2F, down_EFD = (t.to(dtype) for t in (x_MD, gate_up_ED2F, down_EFD))
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        # Each row's expert, to add that expert's biases (output_size: no host sync, compile keeps the graph).
        experts_E = torch.arange(gate_up_E2F.shape[0], device=x_MD.device)
        expert_M = torch.repeat_interleave(experts_E, counts_E, output_size=x_MD.shape[0])
        gate_up_M2F = grouped_mm(x_MD, gate_up_ED2F, offsets_E) + gate_up_E2F[expert_M].to(dtype)
        h_MF = clamped_swiglu(gate_up_M2F, self.alpha, self.limit)
        return grouped_mm(h_MF, down_EFD, offsets_E) + down_ED[expert_M].to(dtype)

    def init_weights(self, std: float) -> None:
        """As transformers: normal weights, zero biases."""
        for weight in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)
        for bias in (self.gate_up_proj_bias, self.down_proj_bias):
            nn.init.zeros_(bias)
