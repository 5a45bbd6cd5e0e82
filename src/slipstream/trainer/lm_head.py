"""Fused LM head: per-token log-probs (at each token's sampling temperature) and entropies of one chunk of hidden
states, keeping no [C, V] tensor for backward. Forward reduces the chunk's logits to a few numbers per token;
backward recomputes the logits and forms their gradient in one pass, then the two matmuls.

The two [C, V] passes (`logit_stats`, `logits_grad`) are plain torch, the reference; on CUDA they run through
torch.compile, where Inductor fuses the upcast, temperature, softmax and reductions so that only the logits (and
their gradient) exist in the compute dtype, never a float32 [C, V] tensor.

On the CPU, with float32 logits (`_CpuLMHead`), the softmax runs over blocks of `CPU_BLOCK_ROWS` rows that stay in
the cache, in place in the logits, and the probabilities are kept for backward instead of recomputing the logits:
one matmul of four saved and every [C, V] pass but one in cache. That costs C x V x 4 bytes until backward, so
`chunked_lm_head_logprobs` takes this path only for micro-batches within `CPU_SAVED_PROBS_BYTES`.

Legend: C = tokens of a chunk, D = hidden size, V = vocabulary.
"""

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor


def logit_stats(logits_CV: Tensor, token_ids_C: Tensor, temperatures_C: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logprobs_C, entropy_C, lse_C), float32, of softmax(logits / temperature); lse_C is what backward needs."""
    z_CV = logits_CV.float() / temperatures_C.unsqueeze(-1)
    lse_C = torch.logsumexp(z_CV, dim=-1)
    logp_CV = z_CV - lse_C.unsqueeze(-1)
    logprobs_C = logp_CV.gather(-1, token_ids_C.unsqueeze(-1)).squeeze(-1)
    entropy_C = -(logp_CV.exp() * logp_CV).sum(-1)
    return logprobs_C, entropy_C, lse_C


def logits_grad(
    logits_CV: Tensor, token_ids_C: Tensor, temperatures_C: Tensor, lse_C: Tensor, grad_logprobs_C: Tensor
) -> Tensor:
    """grad_logits_CV (logits' dtype) = grad_logprobs * (onehot(token) - softmax(z)) / temperature."""
    inv_temperature_C1 = 1.0 / temperatures_C.unsqueeze(-1)
    probs_CV = torch.exp(logits_CV.float() * inv_temperature_C1 - lse_C.unsqueeze(-1))
    vocab_V = torch.arange(logits_CV.shape[-1], device=logits_CV.device)
    onehot_CV = (vocab_V == token_ids_C.unsqueeze(-1)).float()
    return ((onehot_CV - probs_CV) * (grad_logprobs_C.unsqueeze(-1) * inv_temperature_C1)).to(logits_CV.dtype)


@cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)


def _kernel(fn: Callable, x: Tensor) -> Callable:
    """The compiled `fn` for CUDA tensors with elements, else the reference."""
    return _compiled(fn) if x.device.type == "cuda" and x.numel() > 0 else fn


class _FusedLMHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, compute_dtype, logits_dtype):
        logits_CV = _logits(hidden_CD, weight_VD, bias_V, compute_dtype, logits_dtype)
        logprobs_C, entropy_C, lse_C = _kernel(logit_stats, logits_CV)(logits_CV, token_ids_C, temperatures_C)
        ctx.save_for_backward(hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, lse_C)
        ctx.compute_dtype, ctx.logits_dtype = compute_dtype, logits_dtype
        ctx.mark_non_differentiable(entropy_C)  # entropy is logged, never trained on
        return logprobs_C, entropy_C

    @staticmethod
    def backward(ctx, grad_logprobs_C, _grad_entropy_C):
        hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, lse_C = ctx.saved_tensors
        dtype = ctx.compute_dtype
        hidden_c, weight_c = hidden_CD.to(dtype), weight_VD.to(dtype)
        logits_CV = _logits(hidden_c, weight_c, bias_V, dtype, ctx.logits_dtype)
        grad = _kernel(logits_grad, logits_CV)(logits_CV, token_ids_C, temperatures_C, lse_C, grad_logprobs_C)
        del logits_CV
        grad = grad.to(dtype)  # float32 logits (head_dtype): the two matmuls still run in the compute dtype
        grad_hidden = (grad @ weight_c).to(hidden_CD.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad.T @ hidden_c).to(weight_VD.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(bias_V.dtype) if bias_V is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


CPU_SAVED_PROBS_BYTES = 1 << 30
"""Largest [N, V] float32 probabilities a CPU micro-batch keeps for backward (`_CpuLMHead`): 1 GiB is 5,461 loss
tokens of a 49,152-token vocabulary. Beyond it the head recomputes its logits in backward, chunk by chunk."""

CPU_BLOCK_ROWS = 32
"""Rows of the CPU softmax's blocks: 32 x a 49,152-token vocabulary in float32 is 6 MiB, within a CPU's L3 cache."""


def _softmax_in_place(
    logits_CV: Tensor,
    token_ids_C: Tensor,
    temperatures_C: Tensor,
    logprobs_C: Tensor,
    entropy_C: Tensor,
    exp_RV: Tensor,
) -> None:
    """Turn float32 logits into softmax(logits / temperature) in place, block by block, writing each row's log-prob of
    its token and its entropy."""
    for start in range(0, logits_CV.shape[0], CPU_BLOCK_ROWS):
        rows = slice(start, start + CPU_BLOCK_ROWS)
        logp_RV = logits_CV[rows].div_(temperatures_C[rows].unsqueeze(-1))
        logp_RV.sub_(torch.logsumexp(logp_RV, dim=-1, keepdim=True))
        logprobs_C[rows] = logp_RV.gather(-1, token_ids_C[rows].unsqueeze(-1)).squeeze(-1)
        p_RV = torch.exp(logp_RV, out=exp_RV[: logp_RV.shape[0]])
        entropy_C[rows] = -torch.bmm(p_RV.unsqueeze(1), logp_RV.unsqueeze(2)).view(-1)
        logp_RV.copy_(p_RV)


class _CpuLMHead(torch.autograd.Function):
    """The fused head on the CPU for float32 logits: the [C, V] logits computed once, turned into probabilities block by
    block in place, kept for backward, where they become the logits' gradient in place."""

    @staticmethod
    def forward(ctx, hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, compute_dtype):
        probs_CV = _logits(hidden_CD, weight_VD, bias_V, compute_dtype, torch.float32)
        logprobs_C = torch.empty(probs_CV.shape[0], dtype=torch.float32)
        entropy_C = torch.empty_like(logprobs_C)
        exp_RV = torch.empty(min(CPU_BLOCK_ROWS, probs_CV.shape[0]), probs_CV.shape[1])
        with torch.autocast("cpu", enabled=False):
            _softmax_in_place(probs_CV, token_ids_C, temperatures_C, logprobs_C, entropy_C, exp_RV)
        ctx.save_for_backward(hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C)
        ctx.probs_CV, ctx.compute_dtype = probs_CV, compute_dtype
        ctx.mark_non_differentiable(entropy_C)  # entropy is logged, never trained on
        return logprobs_C, entropy_C

    @staticmethod
    def backward(ctx, grad_logprobs_C, _grad_entropy_C):
        hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C = ctx.saved_tensors
        if ctx.probs_CV is None:
            raise RuntimeError("the CPU LM head's saved probabilities are used up: backward runs once per forward")
        # grad_logits = grad_logprobs * (onehot(token) - softmax(z)) / temperature, in the probabilities' storage
        scale_C = grad_logprobs_C / temperatures_C
        grad_CV, ctx.probs_CV = ctx.probs_CV.mul_(-scale_C.unsqueeze(-1)), None
        grad_CV[torch.arange(grad_CV.shape[0]), token_ids_C] += scale_C
        dtype = ctx.compute_dtype
        grad_c = grad_CV.to(dtype)  # float32 logits (head_dtype): the two matmuls still run in the compute dtype
        grad_hidden = (grad_c @ weight_VD.to(dtype)).to(hidden_CD.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (grad_c.T @ hidden_CD.to(dtype)).to(weight_VD.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad_c.sum(0).to(bias_V.dtype) if bias_V is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(
    hidden_CD: Tensor, weight_VD: Tensor, bias_V: Tensor | None, dtype: torch.dtype, logits_dtype: torch.dtype
) -> Tensor:
    """hidden @ W^T + b with both operands rounded to `dtype`, the product kept in `logits_dtype` (float32 logits
    from bfloat16 operands: what vLLM computes with head_dtype float32)."""
    with torch.autocast(hidden_CD.device.type, enabled=False):
        hidden_CD, weight_VD = hidden_CD.to(dtype), weight_VD.to(dtype)
        if logits_dtype == dtype:
            return F.linear(hidden_CD, weight_VD, None if bias_V is None else bias_V.to(dtype))
        if hidden_CD.is_cuda and logits_dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16):
            logits_CV = torch.mm(hidden_CD, weight_VD.t(), out_dtype=torch.float32)  # float32 out, no upcast copies
        else:
            logits_CV = F.linear(hidden_CD.to(logits_dtype), weight_VD.to(logits_dtype))
        return logits_CV if bias_V is None else logits_CV + bias_V.to(logits_dtype)


def lm_head_logprobs(
    hidden_CD: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    token_ids_C: Tensor,
    temperatures_C: Tensor,
    head_dtype: torch.dtype | None = None,
    keep_probs: bool = False,
) -> tuple[Tensor, Tensor]:
    """(logprobs_C, entropy_C), float32, of token_ids_C under softmax((hidden @ W^T + b) / temperature).

    The matmul runs in the autocast dtype when autocast is on (as inference computes its logits), else in the
    inputs' dtype; its output (the logits) is in that dtype too unless `head_dtype` is wider (model.head_dtype =
    "float32": operands rounded to the compute dtype, product kept in float32, as vLLM's float32 head). The softmax is
    float32. Gradients flow to hidden, W and b through logprobs_C only. `keep_probs` (CPU, float32 logits): keep
    the [C, V] probabilities for backward (`_CpuLMHead`) rather than recompute the logits there.
    """
    device_type = hidden_CD.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden_CD.dtype, weight_VD.dtype)
    logits_dtype = compute_dtype if head_dtype is None else torch.promote_types(compute_dtype, head_dtype)
    if keep_probs and device_type == "cpu" and logits_dtype == torch.float32:
        return _CpuLMHead.apply(hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, compute_dtype)
    return _FusedLMHead.apply(hidden_CD, weight_VD, bias_V, token_ids_C, temperatures_C, compute_dtype, logits_dtype)
