"""AdamW with its two moments stored in bfloat16 (`trainer.optim.state_dtype = "bfloat16"`): half the optimizer
memory of torch's AdamW (8 -> 4 bytes per parameter) for the same float32 master weights.

The update itself runs in float32, chunk by chunk (a bounded float32 scratch, never a full float32 copy of the
moments); only the stored moments are rounded to bf16, stochastically (round up with probability equal to the
dropped fraction), so they stay unbiased: with round-to-nearest, the 0.1% per-step decay of the second moment at
beta2 = 0.999 is below bf16's half-ulp (0.2%) and would never happen. Accuracy cost: each moment carries ~3
significant digits plus that rounding noise, so each update differs from float32 AdamW's by a small relative noise
(tests/unit/test_moe_speed_path.py bounds it over a few steps); the weights themselves stay float32. The rounding
draws from torch's default generator of the parameters' device (saved and restored with trainer checkpoints).
"""

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

CHUNK_NUMEL = 1 << 24
"""Elements updated at once: bounds the float32 scratch to a few x 64 MiB however large a parameter is."""


class AdamWBf16Moments(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam (torch.optim.AdamW's maths, amsgrad off) with bf16 `exp_avg` / `exp_avg_sq`.
    Works on plain and FSDP-sharded (DTensor) parameters: each rank updates its own shard."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # Optimizer.load_state_dict casts moments to their parameter's dtype (float32): cast them back.
        self.register_load_state_dict_post_hook(_moments_to_bf16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: Tensor, group: dict) -> None:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        state["step"] += 1
        step = state["step"].item()
        beta1, beta2 = group["betas"]
        tensors = [_local(t) for t in (param, param.grad, state["exp_avg"], state["exp_avg_sq"])]
        # The step's scalars as one tensor: a compiled update then serves every step (a Python float would be
        # baked into the compiled code and recompile it as the learning rate and bias corrections change).
        lr, decay = group["lr"], group["weight_decay"]
        scalars = [1 - lr * decay, beta1, beta2, 1 - beta2**step, group["eps"], lr / (1 - beta1**step)]
        scalars_S = torch.tensor(scalars, dtype=torch.float32, device=tensors[0].device)
        update = _compiled_chunk_update() if tensors[0].is_cuda else _chunk_update
        for p, g, m, v in zip(*(_chunks(t) for t in tensors), strict=True):
            update(p, g, m, v, scalars_S)


def _chunk_update(p: Tensor, g: Tensor, m: Tensor, v: Tensor, scalars_S: Tensor) -> None:
    """One chunk of AdamW with bf16 moments, in place: float32 maths, moments stored with stochastic rounding.
    `scalars_S` = (1 - lr x weight_decay, beta1, beta2, 1 - beta2^step, eps, lr / (1 - beta1^step))."""
    keep, beta1, beta2, correction2, eps, step_size = scalars_S.unbind(0)
    g = g.float()
    m32 = m.float() * beta1 + g * (1 - beta1)
    v32 = v.float() * beta2 + g * g * (1 - beta2)
    p.copy_(p * keep - step_size * m32 / ((v32 / correction2).sqrt() + eps))
    stochastic_round_to_bf16_(m, m32)
    stochastic_round_to_bf16_(v, v32)


_COMPILED: list = []


def _compiled_chunk_update():
    """`_chunk_update` through torch.compile (GPUs): one fused kernel reading p, g, m, v and writing p, m, v, about
    20 bytes per parameter, instead of a dozen elementwise kernels with float32 temporaries."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_chunk_update, dynamic=True))
    return _COMPILED[0]


def stochastic_round_to_bf16_(out: Tensor, x: Tensor) -> Tensor:
    """out (bf16) = x (float32) rounded to one of its two nearest bf16 values, up with probability equal to the
    fraction dropped: E[out] = x. Adds 16 random low bits to x's bit pattern and truncates them (the bit pattern is
    sign-magnitude, so this rounds the magnitude for either sign)."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16)
    truncated = (bits + noise).bitwise_and_(-(1 << 16))  # keep the high 16 bits: exactly a bf16 value
    return out.copy_(truncated.view(torch.float32))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _chunks(t: Tensor) -> tuple[Tensor, ...]:
    return t.view(-1).split(CHUNK_NUMEL)


def _moments_to_bf16(optimizer: torch.optim.Optimizer) -> None:
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state and state[key].dtype != torch.bfloat16:
                state[key] = state[key].to(torch.bfloat16)
