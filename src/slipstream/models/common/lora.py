"""Low-rank adapters (LoRA), applied from outside to a model (ours, or transformers' linear layers): a targeted
nn.Linear computes `x W^T + b + s * (drop(x) A^T) B^T`, and a stacked-experts module does the same for each expert's
gate, up and down projection inside its SwiGLU, with s = alpha / rank, A [R, I] initialised as PEFT does
(kaiming-uniform) and B [O, R] at zero, so the adapted model starts as the base model.

The base weights keep their names and are frozen; the adapters sit beside them (`q_proj.lora_A`, `q_proj.lora_B`;
`experts.gate_proj_lora_A` [E, R, D]), so FSDP shards them with their block and expert parallelism shards the experts'
adapters on dim 0 like the expert weights. `merged_weight` folds an adapter in (W + s B A): what a merged export
publishes and what the tests compare against.

Legend: M = routed rows, D = hidden size, F = expert hidden size, E = experts, R = rank, I / O = in / out features.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.moe import GroupedExperts, _local, grouped_mm, grouped_mm_dtype

EXPERTS_TARGET = "experts"
"""Target name of the stacked-experts modules (all three projections of every expert)."""
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _init_lora_A(a: Tensor) -> None:
    """PEFT's default init of A (kaiming-uniform with a = sqrt(5), as nn.Linear's weight), per [R, I] matrix."""
    for a_RI in a.view(-1, *a.shape[-2:]):
        nn.init.kaiming_uniform_(a_RI, a=math.sqrt(5))


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank adapter (made by `apply_lora` from an existing nn.Linear, whose weight and bias it
    keeps under the same names)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter

    def setup_lora(self, rank: int, scale: float, dropout: float) -> None:
        self.lora_scale = scale
        self.lora_dropout = (nn.Dropout(dropout) if dropout > 0 else nn.Identity()).train(self.training)
        device = self.weight.device
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device))
        if not self.weight.is_meta:
            _init_lora_A(self.lora_A.data)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)
        return y + self.lora_scale * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    def merged_weight(self, weight: Tensor | None = None) -> Tensor:
        """W + s B A (float32 maths, W's dtype), from `weight` (e.g. an unsharded copy) or the module's own."""
        w = self.weight if weight is None else weight
        delta = self.lora_scale * (_full(self.lora_B).float() @ _full(self.lora_A).float())
        return (w.float() + delta).to(w.dtype)


class LoRAGroupedExperts(GroupedExperts):
    """GroupedExperts with an adapter on each expert's gate, up and down projection (`<proj>_lora_A` [E, R, in],
    `<proj>_lora_B` [E, out, R]); same row layout and kernels (grouped matmul or the per-expert loop)."""

    def setup_lora(self, rank: int, scale: float, dropout: float) -> None:
        self.lora_scale = scale
        self.lora_dropout = (nn.Dropout(dropout) if dropout > 0 else nn.Identity()).train(self.training)
        for proj in EXPERT_PROJECTIONS:
            weight = getattr(self, proj)
            num_experts, out_features, in_features = weight.shape
            a = nn.Parameter(torch.empty(num_experts, rank, in_features, device=weight.device))
            b = nn.Parameter(torch.zeros(num_experts, out_features, rank, device=weight.device))
            if not weight.is_meta:
                _init_lora_A(a.data)
            self.register_parameter(f"{proj}_lora_A", a)
            self.register_parameter(f"{proj}_lora_B", b)

    def forward(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        """y_MD: each row through the adapted SwiGLU of its expert."""
        offsets_E = counts_E.cumsum(0).to(torch.int32) if self.use_grouped_mm else None
        splits = None if self.use_grouped_mm else counts_E.tolist()

        def project(x_MI: Tensor, proj: str) -> Tensor:
            w_EOI, a_ERI, b_EOR = (_local(getattr(self, n)) for n in (proj, f"{proj}_lora_A", f"{proj}_lora_B"))
            if offsets_E is not None:
                a_ERI, b_EOR = _pad_rank(a_ERI, b_EOR)
            low_MR = _expert_linear(self.lora_dropout(x_MI), a_ERI, offsets_E, splits)
            delta_MO = _expert_linear(low_MR, b_EOR, offsets_E, splits)
            y_MO = _expert_linear(x_MI, w_EOI, offsets_E, splits)
            return y_MO + self.lora_scale * delta_MO.to(y_MO.dtype)

        h_MF = F.silu(project(x_MD, "gate_proj")) * project(x_MD, "up_proj")
        return project(h_MF, "down_proj")

    def merged_weight(self, proj: str, weight: Tensor | None = None) -> Tensor:
        """W + s B A per expert for projection `proj` ([E, out, in], W's dtype)."""
        w = getattr(self, proj) if weight is None else weight
        a, b = (_full(getattr(self, f"{proj}_lora_{x}")).float() for x in "AB")
        return (w.float() + self.lora_scale * torch.bmm(b, a)).to(w.dtype)


RANK_ALIGNMENT = 8
"""torch._grouped_mm wants 16-byte aligned row strides (checked by its meta kernel under torch.compile): the
adapters' rank dimension is zero-padded to a multiple of 8 elements for it (exactly the same result)."""


def _pad_rank(a_ERI: Tensor, b_EOR: Tensor) -> tuple[Tensor, Tensor]:
    pad = -a_ERI.shape[1] % RANK_ALIGNMENT
    if pad == 0:
        return a_ERI, b_EOR
    return F.pad(a_ERI, (0, 0, 0, pad)), F.pad(b_EOR, (0, pad))


def _expert_linear(x_MI: Tensor, w_EOI: Tensor, offsets_E: Tensor | None, splits: list[int] | None) -> Tensor:
    """y_MO = x @ w[e]^T for the rows of each expert e: one grouped matmul (`offsets_E`), or a loop over `splits`."""
    if offsets_E is not None:
        dtype = grouped_mm_dtype(x_MI.device.type, w_EOI.dtype)
        return grouped_mm(x_MI.to(dtype), w_EOI.to(dtype).transpose(-2, -1), offsets_E)
    return torch.cat([x_mI @ w_EOI[e].T for e, x_mI in enumerate(torch.split(x_MI, splits))])


def _full(t: Tensor) -> Tensor:
    """A whole tensor from a possibly sharded one (DTensor, duck-typed: collective when sharded)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]) -> list[str]:
    """Add adapters to `model` in place (before any parallelism wraps it) and freeze everything else; returns the
    adapted modules' names. Linear layers whose last name part is in `target_modules` and, with "experts" listed,
    every GroupedExperts module are adapted; the LM head and embeddings only when named."""
    targets = set(target_modules)
    scale = alpha / rank
    adapted = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, GroupedExperts) and EXPERTS_TARGET in targets:
            if type(module) is not GroupedExperts:
                raise ValueError(f"{name} is a {type(module).__name__}; LoRA adapts plain GroupedExperts only")
            module.__class__ = LoRAGroupedExperts
        elif type(module) is nn.Linear and leaf in targets:
            module.__class__ = LoRALinear
        else:
            continue
        module.setup_lora(rank, scale, dropout)
        adapted.append(name)
    if not adapted:
        raise ValueError(
            f"model.lora.target_modules {sorted(targets)} matched no module of this {type(model).__name__}: list "
            "linear layer names it has (e.g. q_proj, v_proj) or 'experts'"
        )
    for param_name, param in model.named_parameters():
        param.requires_grad_(is_lora_name(param_name))
    return adapted


def init_adapters(model: nn.Module, seed: int) -> None:
    """(Re)initialise every adapter of `model` from `seed` alone (A as PEFT does, B at zero, in module order),
    leaving the global RNG as it was: the same modules and seed always give the same adapters, whatever ran before
    (one run's trainer and a multi-tenant trainer's tenant start alike)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for module in model.modules():
            if isinstance(module, LoRALinear):
                pairs = [(module.lora_A, module.lora_B)]
            elif isinstance(module, LoRAGroupedExperts):
                pairs = [(getattr(module, f"{p}_lora_A"), getattr(module, f"{p}_lora_B")) for p in EXPERT_PROJECTIONS]
            else:
                continue
            for a, b in pairs:
                if not a.is_meta:
                    _init_lora_A(a.data)
                    b.data.zero_()


def is_lora_name(name: str) -> bool:
    """Whether a parameter / state-dict name is an adapter's."""
    return "lora_A" in name or "lora_B" in name


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRALinear, LoRAGroupedExperts)) for m in model.modules())


def merged_tensor(module: nn.Module, attr: str, tensor: Tensor) -> Tensor:
    """`tensor` (module.attr, possibly an unsharded copy) with the module's adapter folded in, when attr has one."""
    if isinstance(module, LoRALinear) and attr == "weight":
        return module.merged_weight(tensor)
    if isinstance(module, LoRAGroupedExperts) and attr in EXPERT_PROJECTIONS:
        return module.merged_weight(attr, tensor)
    return tensor


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The base model's state dict (adapter keys left out) with every adapter folded into its weight; the model must
    be whole (not sharded)."""
    out = {}
    for prefix, module in model.named_modules():
        for attr, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if is_lora_name(attr):
                continue
            key = f"{prefix}.{attr}" if prefix else attr
            out[key] = merged_tensor(module, attr, tensor.detach())
    state = model.state_dict()  # keeps only persistent buffers, in the model's key order
    return {k: out[k] for k in state if not is_lora_name(k)}
