"""Gated DeltaNet's two sequence mixers over packed rows, in pure torch: the causal depthwise conv1d and the chunked
gated delta rule, both restarting at every sample boundary (a token whose position_id is not its predecessor's + 1
starts a sample: no conv tap and no recurrent state crosses it).

Gated delta rule, per value head, state S [K, V], for token t with decay g_t <= 0 (log space) and rate beta_t:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t,
with q, k L2-normalised and q scaled by 1 / sqrt(K), as transformers' `torch_chunk_gated_delta_rule` (the FLA
library's algorithm): the row is cut into chunks of C tokens; inside a chunk the updates are condensed with a UT
transform (one triangular solve), and one state carries from chunk to chunk. Samples are separated by masks, never
by moving tokens: intra-chunk pairs (i, j) count only within one sample, the carried state reaches only the chunk's
tokens of the sample that was running when the chunk began (none when a sample starts at its first token), and the
state at a chunk's end keeps only its last sample's keys. Mathematically exact; float32 whatever the autocast.

The delta rule runs as one custom op (`slipstream::chunk_gated_delta_rule`), opaque to torch.compile, whose backward
recomputes its forward. Memory: three [B, H, T, C] float32 tensors (pair decays, UT system, intra-chunk scores) per
layer, ~400 MB for T = 16384, H = 32 (Qwen3.5-35B-A3B), held inside the op only.

GPUs: this is the reference, in batched matmuls and a Python loop over T / C chunks. A fused kernel (FLA's
`chunk_gated_delta_rule` with `cu_seqlens` from the rows' sample starts; `causal_conv1d_fn` with `seq_idx` for the
conv) would register as this op's CUDA implementation; it is not a dependency here, and must be checked against
this function (tests/unit/test_qwen3_5_moe.py checks this one against transformers and the token-by-token rule).

Legend: B = rows, T = tokens per row, H = value heads, K = key head dim, V = value head dim, C = chunk size,
N = chunks per row, W = conv kernel width, X = conv channels.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_SIZE = 64
"""transformers' and FLA's chunk size."""


def sample_starts(position_ids_BT: Tensor) -> Tensor:
    """starts_BT (bool): tokens that begin a sample (position_ids not counting on from the previous token), and every
    row's first token."""
    breaks_BT = position_ids_BT[:, 1:] != position_ids_BT[:, :-1] + 1
    return F.pad(breaks_BT, (1, 0), value=True)


def packed_causal_conv1d(x_BTX: Tensor, weight_XW: Tensor, position_ids_BT: Tensor) -> Tensor:
    """silu(depthwise causal conv1d) of x_BTX within each sample: y_t = sum_s w[W - 1 - s] * x_{t - s} over the taps
    s < W whose token t - s belongs to t's sample (transformers' `causal_conv1d_fn`, zero-padded on the left, per
    sample). Tap s reaches back into t's sample iff the s tokens before t count on (`run_BT` >= s)."""
    W = weight_XW.shape[-1]
    run_BT = _tokens_since_sample_start(position_ids_BT)
    y_BTX = x_BTX * weight_XW[:, W - 1]
    for s in range(1, W):
        shifted_BTX = F.pad(x_BTX, (0, 0, s, 0))[:, : x_BTX.shape[1]]
        y_BTX = y_BTX + shifted_BTX * (run_BT >= s).unsqueeze(-1).to(x_BTX.dtype) * weight_XW[:, W - 1 - s]
    return F.silu(y_BTX)


def _tokens_since_sample_start(position_ids_BT: Tensor) -> Tensor:
    """run_BT: how many tokens of the token's own sample precede it in the row (0 at a sample start)."""
    T = position_ids_BT.shape[1]
    index_BT = torch.arange(T, device=position_ids_BT.device).expand_as(position_ids_BT)
    start_index_BT = torch.where(sample_starts(position_ids_BT), index_BT, torch.zeros_like(index_BT))
    return index_BT - start_index_BT.cummax(dim=1).values


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (transformers' and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q_BTHK: Tensor,
    k_BTHK: Tensor,
    v_BTHV: Tensor,
    g_BTH: Tensor,
    beta_BTH: Tensor,
    position_ids_BT: Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> Tensor:
    """o_BTHV of the gated delta rule (module docstring) over packed rows, state zero at every sample start; q and k
    are L2-normalised here. Computed in float32 (float64 for float64 inputs) with autocast off, returned in v's
    dtype, through the `slipstream::chunk_gated_delta_rule` op (see `_delta_rule_op`)."""
    out_dtype = v_BTHV.dtype
    dtype = torch.promote_types(out_dtype, torch.float32)
    heads_first = (x.to(dtype).transpose(1, 2).contiguous() for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
    o_BHTV = _delta_rule_op(*heads_first, sample_starts(position_ids_BT), chunk_size)
    return o_BHTV.transpose(1, 2).to(out_dtype)


@torch.library.custom_op("slipstream::chunk_gated_delta_rule", mutates_args=())
def _delta_rule_op(
    q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, g_BHT: Tensor, beta_BHT: Tensor, starts_BT: Tensor, chunk_size: int
) -> Tensor:
    """One opaque op, so torch.compile neither traces nor compiles the chunk loop and its triangular solves (inductor
    took ~25 s per layer shape to compile them on CPU, for no speed-up: they are batched matmuls already), and the
    place where a fused GPU kernel would register. Backward recomputes the forward under autograd (`_backward`)."""
    with torch.autocast(v_BHTV.device.type, enabled=False):
        return _chunked(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, starts_BT, chunk_size).contiguous()


@_delta_rule_op.register_fake
def _(q_BHTK, k_BHTK, v_BHTV, g_BHT, beta_BHT, starts_BT, chunk_size):
    return torch.empty_like(v_BHTV)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:6])
    ctx.chunk_size = inputs[6]


def _backward(ctx, grad_BHTV: Tensor):
    """Gradients of the five float inputs: the forward again, this time recorded, and its vector-Jacobian product
    (one more forward of the delta rule per backward, as activation checkpointing would cost anyway)."""
    *floats, starts_BT = ctx.saved_tensors
    with torch.enable_grad(), torch.autocast(grad_BHTV.device.type, enabled=False):
        floats = [x.detach().requires_grad_() for x in floats]
        o_BHTV = _chunked(*floats, starts_BT, ctx.chunk_size)
        grads = torch.autograd.grad(o_BHTV, floats, grad_BHTV)
    return (*grads, None, None)


_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


def _chunked(
    q_BHTK: Tensor, k_BHTK: Tensor, v_BHTV: Tensor, g_BHT: Tensor, beta_BHT: Tensor, starts_BT: Tensor, C: int
) -> Tensor:
    B, H, T, K = k_BHTK.shape
    V = v_BHTV.shape[-1]
    q_BHTK = l2norm(q_BHTK) * K**-0.5
    k_BHTK = l2norm(k_BHTK)
    pad = (C - T % C) % C
    q_BHTK, k_BHTK, v_BHTV = (F.pad(x, (0, 0, 0, pad)) for x in (q_BHTK, k_BHTK, v_BHTV))
    g_BHT, beta_BHT = (F.pad(x, (0, pad)) for x in (g_BHT, beta_BHT))
    starts_BT = F.pad(starts_BT, (0, pad), value=True)  # padding tokens: samples of their own, dropped at the end
    N = (T + pad) // C
    sample_BNC = starts_BT.long().cumsum(dim=1).view(B, N, C)  # a sample id per token, increasing along the row
    # carried_BNC: the token belongs to the sample running when its chunk began (which did not start there), so it
    # sees the state carried from earlier chunks.
    carried_BNC = (sample_BNC == sample_BNC[..., :1]) & ~starts_BT.view(B, N, C)[..., :1]
    same_BNCC = sample_BNC.unsqueeze(-1) == sample_BNC.unsqueeze(-2)
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q_BHTK.device).tril()
    pair_B1NCC = (same_BNCC & causal_CC).unsqueeze(1)  # (i, j): j <= i in i's sample
    last_B1NC = (sample_BNC == sample_BNC[..., -1:]).unsqueeze(1)  # tokens of the chunk's last sample
    carried_B1NC1 = carried_BNC.unsqueeze(1).unsqueeze(-1).to(q_BHTK.dtype)
    keeps_state_B1N11 = carried_BNC[..., -1].view(B, 1, N, 1, 1).to(q_BHTK.dtype)  # no sample began in the chunk

    q_BHNCK, k_BHNCK = q_BHTK.view(B, H, N, C, K), k_BHTK.view(B, H, N, C, K)
    v_beta_BHNCV = (v_BHTV * beta_BHT.unsqueeze(-1)).view(B, H, N, C, V)
    k_beta_BHNCK = (k_BHTK * beta_BHT.unsqueeze(-1)).view(B, H, N, C, K)
    # Log decay from the chunk's start, or from the token's sample start if later, to each token: a sum over the
    # token's own sample only (not a cumsum across samples then a difference, whose rounding depends on the packing).
    cum_BHNC = (pair_B1NCC.to(g_BHT.dtype) @ g_BHT.view(B, H, N, C, 1)).squeeze(-1)
    decay_BHNCC = (cum_BHNC.unsqueeze(-1) - cum_BHNC.unsqueeze(-2)).masked_fill(~pair_B1NCC, float("-inf")).exp()
    # UT transform: (I + strictly-lower(beta k k^T * decay)) u = beta v, and the same for the decayed keys that read
    # the carried state; the diagonal is the identity (unitriangular).
    ut_BHNCC = (k_beta_BHNCK @ k_BHNCK.transpose(-1, -2)) * decay_BHNCC
    u_BHNCV = torch.linalg.solve_triangular(ut_BHNCC, v_beta_BHNCV, upper=False, unitriangular=True)
    k_read_BHNCK = k_beta_BHNCK * cum_BHNC.exp().unsqueeze(-1) * carried_B1NC1
    w_BHNCK = torch.linalg.solve_triangular(ut_BHNCC, k_read_BHNCK, upper=False, unitriangular=True)
    intra_BHNCC = (q_BHNCK @ k_BHNCK.transpose(-1, -2)) * decay_BHNCC
    q_read_BHNCK = q_BHNCK * cum_BHNC.exp().unsqueeze(-1) * carried_B1NC1
    to_end_BHNC = (cum_BHNC[..., -1:] - cum_BHNC).masked_fill(~last_B1NC, float("-inf")).exp()
    k_write_BHNCK = k_BHNCK * to_end_BHNC.unsqueeze(-1)
    chunk_decay_BHN11 = cum_BHNC[..., -1].exp()[..., None, None] * keeps_state_B1N11

    state_BHKV = q_BHTK.new_zeros(B, H, K, V)
    outputs = []
    for n in range(N):
        u_new_BHCV = u_BHNCV[:, :, n] - w_BHNCK[:, :, n] @ state_BHKV
        outputs.append(q_read_BHNCK[:, :, n] @ state_BHKV + intra_BHNCC[:, :, n] @ u_new_BHCV)
        state_BHKV = state_BHKV * chunk_decay_BHN11[:, :, n] + k_write_BHNCK[:, :, n].transpose(-1, -2) @ u_new_BHCV
    return torch.cat(outputs, dim=2)[:, :, :T]


def recurrent_gated_delta_rule(
    q_BTHK: Tensor, k_BTHK: Tensor, v_BTHV: Tensor, g_BTH: Tensor, beta_BTH: Tensor, position_ids_BT: Tensor
) -> Tensor:
    """o_BTHV token by token (the definition; slow): the reference the chunked form is tested against."""
    q_BTHK = l2norm(q_BTHK.float()) * q_BTHK.shape[-1] ** -0.5
    k_BTHK = l2norm(k_BTHK.float())
    v_BTHV, g_BTH, beta_BTH = v_BTHV.float(), g_BTH.float(), beta_BTH.float()
    starts_BT = sample_starts(position_ids_BT)
    B, T, H, K = k_BTHK.shape
    state_BHKV = v_BTHV.new_zeros(B, H, K, v_BTHV.shape[-1])
    outputs = []
    for t in range(T):
        keep_B111 = (~starts_BT[:, t]).to(state_BHKV.dtype).view(B, 1, 1, 1)
        state_BHKV = state_BHKV * keep_B111 * g_BTH[:, t].exp()[..., None, None]
        k_BHK = k_BTHK[:, t]
        delta_BHV = (v_BTHV[:, t] - (state_BHKV * k_BHK.unsqueeze(-1)).sum(-2)) * beta_BTH[:, t].unsqueeze(-1)
        state_BHKV = state_BHKV + k_BHK.unsqueeze(-1) * delta_BHV.unsqueeze(-2)
        outputs.append((state_BHKV * q_BTHK[:, t].unsqueeze(-1)).sum(-2))
    return torch.stack(outputs, dim=1)
