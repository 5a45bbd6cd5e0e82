"""Mamba2's two sequence mixers over packed rows, in pure torch: the causal depthwise conv1d and the SSD scan (the
selective state-space recurrence in its chunked "state space duality" form), both restarting at every sample boundary
(a token whose position_id is not its predecessor's + 1 starts a sample: no conv tap and no state crosses it).

The recurrence, per head, state h [S, P], for token t with step dt_t > 0 and decay a_t = dt_t A (A < 0 per head):
    h_t = exp(a_t) h_{t-1} + b_t (dt_t x_t)^T;   y_t = h_t^T c_t + D x_t,
b_t and c_t [S] shared by the heads of a group. Chunked: the row is cut into chunks of C tokens. Inside a chunk the
output is an attention-like product, y_i = sum_{j <= i} (c_i . b_j) exp(a_{j+1} + ... + a_i) dt_j x_j, over the pairs
(i, j) of ONE sample; the state at each chunk's end is the chunk's contribution of its last sample, plus the state
carried in from the chunk before when no sample began in the chunk. The states at chunk ends come from one matrix of
chunk-to-chunk decays (zero across any chunk where a sample began): no loop over chunks, everything is batched
matmuls. A token reads the carried state only if it belongs to the sample that was running when its chunk began.
Decays are sums over the token's own sample (a masked matmul), never a cumsum across samples then a difference,
whose rounding would depend on the packing. Mathematically exact; float32 (float64 for float64 inputs) whatever
the autocast.

Memory: two [B, H, T, C] float32 tensors (pair decays, c.b scores) per layer while it runs (and for its backward
unless the block is checkpointed). GPUs: this is the reference; a fused kernel (mamba_ssm's
`mamba_chunk_scan_combined` with `seq_idx` from the rows' sample starts, `causal_conv1d_fn` with `seq_idx`) would
replace it and must be checked against it (tests/unit/test_nemotron_h.py checks this one against transformers and
the token-by-token recurrence).

Legend: B = rows, T = tokens per row, H = heads, P = head dim, G = groups of heads sharing b and c, S = state size,
C = chunk size, N = chunks per row, W = conv kernel width, X = conv channels.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from slipstream.models.qwen3_5_moe.delta_rule import sample_starts


def tokens_since_sample_start(position_ids_BT: Tensor) -> Tensor:
    """run_BT: how many tokens of the token's own sample precede it in the row (0 at a sample start)."""
    T = position_ids_BT.shape[1]
    index_BT = torch.arange(T, device=position_ids_BT.device).expand_as(position_ids_BT)
    start_index_BT = torch.where(sample_starts(position_ids_BT), index_BT, torch.zeros_like(index_BT))
    return index_BT - start_index_BT.cummax(dim=1).values


def packed_causal_conv1d(x_BTX: Tensor, weight_XW: Tensor, bias_X: Tensor | None, position_ids_BT: Tensor) -> Tensor:
    """silu(depthwise causal conv1d + bias) of x_BTX within each sample: y_t = bias + sum_s w[W - 1 - s] x_{t - s}
    over the taps s < W whose token t - s belongs to t's sample (transformers' zero-padded conv, per sample)."""
    W = weight_XW.shape[-1]
    run_BT = tokens_since_sample_start(position_ids_BT)
    y_BTX = x_BTX * weight_XW[:, W - 1]
    for s in range(1, W):
        shifted_BTX = F.pad(x_BTX, (0, 0, s, 0))[:, : x_BTX.shape[1]]
        y_BTX = y_BTX + shifted_BTX * (run_BT >= s).unsqueeze(-1).to(x_BTX.dtype) * weight_XW[:, W - 1 - s]
    if bias_X is not None:
        y_BTX = y_BTX + bias_X
    return F.silu(y_BTX)


def chunked_ssd(
    x_BTHP: Tensor,
    dt_BTH: Tensor,
    A_H: Tensor,
    b_BTGS: Tensor,
    c_BTGS: Tensor,
    D_H: Tensor,
    position_ids_BT: Tensor,
    chunk_size: int,
) -> Tensor:
    """y_BTHP of the recurrence (module docstring) over packed rows, the state zero at every sample start; `dt_BTH`
    already positive (softplus and clamp applied). Computed and returned in float32 (float64 for float64 inputs),
    autocast off."""
    dtype = torch.promote_types(x_BTHP.dtype, torch.float32)
    with torch.autocast(x_BTHP.device.type, enabled=False):
        return _chunked(
            *(t.to(dtype) for t in (x_BTHP, dt_BTH, A_H, b_BTGS, c_BTGS, D_H)),
            sample_starts(position_ids_BT),
            chunk_size,
        )


def _heads_first_chunks(t_BTH_: Tensor, pad: int, C: int) -> Tensor:
    """[B, T, H, ...] -> [B, H, N, C, ...], zero-padded to N * C tokens."""
    t_BTH_ = F.pad(t_BTH_, (0, 0) * (t_BTH_.dim() - 2) + (0, pad))
    B, T, H = t_BTH_.shape[:3]
    return t_BTH_.view(B, T // C, C, H, *t_BTH_.shape[3:]).movedim(3, 1)


def _chunked(x_BTHP, dt_BTH, A_H, b_BTGS, c_BTGS, D_H, starts_BT, C: int) -> Tensor:
    B, T, H, P = x_BTHP.shape
    G = b_BTGS.shape[2]
    pad = (C - T % C) % C
    b_BTHS, c_BTHS = (t.repeat_interleave(H // G, dim=2) for t in (b_BTGS, c_BTGS))
    xdt_BHNCP = _heads_first_chunks(x_BTHP * dt_BTH.unsqueeze(-1), pad, C)
    a_BHNC = _heads_first_chunks(dt_BTH * A_H, pad, C)
    b_BHNCS, c_BHNCS = _heads_first_chunks(b_BTHS, pad, C), _heads_first_chunks(c_BTHS, pad, C)
    starts_BT = F.pad(starts_BT, (0, pad), value=True)  # padding tokens: samples of their own, dropped at the end
    N = (T + pad) // C
    sample_BNC = starts_BT.long().cumsum(dim=1).view(B, N, C)  # a sample id per token, increasing along the row
    # carried_BNC: the token belongs to the sample running when its chunk began (which did not start there).
    carried_BNC = (sample_BNC == sample_BNC[..., :1]) & ~starts_BT.view(B, N, C)[..., :1]
    causal_CC = torch.ones(C, C, dtype=torch.bool, device=x_BTHP.device).tril()
    pair_B1NCC = ((sample_BNC.unsqueeze(-1) == sample_BNC.unsqueeze(-2)) & causal_CC).unsqueeze(1)
    last_B1NC = (sample_BNC == sample_BNC[..., -1:]).unsqueeze(1)  # tokens of the chunk's last sample
    keeps_BN = carried_BNC[..., -1]  # no sample began in the chunk: the state carried in flows through it

    # Log decay from the chunk's start, or from the token's sample start if later, to each token (own sample only).
    cum_BHNC = (pair_B1NCC.to(a_BHNC.dtype) @ a_BHNC.unsqueeze(-1)).squeeze(-1)
    decay_BHNCC = (cum_BHNC.unsqueeze(-1) - cum_BHNC.unsqueeze(-2)).masked_fill(~pair_B1NCC, float("-inf")).exp()
    y_BHNCP = ((c_BHNCS @ b_BHNCS.transpose(-1, -2)) * decay_BHNCC) @ xdt_BHNCP

    # The state each chunk leaves from its last sample, then the states at chunk ends: S_n = sum_m W[n, m] local_m,
    # W[n, m] = exp(sum of the chunk decays of chunks m+1..n), zero if a sample began in any of them.
    to_end_BHNC = (cum_BHNC[..., -1:] - cum_BHNC).masked_fill(~last_B1NC, float("-inf")).exp()
    local_BHNSP = (b_BHNCS * to_end_BHNC.unsqueeze(-1)).transpose(-1, -2) @ xdt_BHNCP
    chunk_decay_BHN = torch.where(keeps_BN.unsqueeze(1), cum_BHNC[..., -1], torch.zeros_like(cum_BHNC[..., -1]))
    later_NN = torch.ones(N, N, dtype=torch.bool, device=x_BTHP.device).tril(diagonal=-1)  # [k, m]: k > m
    # seg[n, m] = sum of chunk_decay[k] over m < k <= n (a masked cumsum: only those terms enter each sum)
    seg_BHNN = chunk_decay_BHN.unsqueeze(-1).masked_fill(~later_NN, 0.0).cumsum(dim=-2)
    resets_BN = (~keeps_BN).long().cumsum(dim=1)
    linked_B1NN = ((resets_BN.unsqueeze(-1) == resets_BN.unsqueeze(-2)) & ~later_NN.T).unsqueeze(1)  # m <= n
    weight_BHNN = seg_BHNN.masked_fill(~linked_B1NN, float("-inf")).exp()
    state_end_BHNSP = torch.einsum("bhnm,bhmsp->bhnsp", weight_BHNN, local_BHNSP)
    state_start_BHNSP = F.pad(state_end_BHNSP[:, :, :-1], (0, 0, 0, 0, 1, 0))
    read_BHNC = cum_BHNC.exp() * carried_BNC.unsqueeze(1).to(cum_BHNC.dtype)
    y_BHNCP = y_BHNCP + (c_BHNCS * read_BHNC.unsqueeze(-1)) @ state_start_BHNSP

    y_BTHP = y_BHNCP.movedim(1, 3).reshape(B, N * C, H, P)[:, :T]
    return y_BTHP + D_H.unsqueeze(-1) * x_BTHP


def recurrent_ssd(
    x_BTHP: Tensor,
    dt_BTH: Tensor,
    A_H: Tensor,
    b_BTGS: Tensor,
    c_BTGS: Tensor,
    D_H: Tensor,
    position_ids_BT: Tensor,
) -> Tensor:
    """y_BTHP token by token (the definition; slow, float64): the reference the chunked form is tested against."""
    x_BTHP, dt_BTH, A_H, b_BTGS, c_BTGS, D_H = (t.double() for t in (x_BTHP, dt_BTH, A_H, b_BTGS, c_BTGS, D_H))
    B, T, H, P = x_BTHP.shape
    G = b_BTGS.shape[2]
    b_BTHS, c_BTHS = (t.repeat_interleave(H // G, dim=2) for t in (b_BTGS, c_BTGS))
    starts_BT = sample_starts(position_ids_BT)
    state_BHSP = x_BTHP.new_zeros(B, H, b_BTGS.shape[-1], P)
    outputs = []
    for t in range(T):
        keep_B111 = (~starts_BT[:, t]).to(state_BHSP.dtype).view(B, 1, 1, 1)
        decay_BH11 = (dt_BTH[:, t] * A_H).exp()[..., None, None]
        write_BHSP = b_BTHS[:, t].unsqueeze(-1) * (dt_BTH[:, t, :, None] * x_BTHP[:, t]).unsqueeze(-2)
        state_BHSP = state_BHSP * keep_B111 * decay_BH11 + write_BHSP
        outputs.append((state_BHSP * c_BTHS[:, t].unsqueeze(-1)).sum(-2) + D_H.unsqueeze(-1) * x_BTHP[:, t])
    return torch.stack(outputs, dim=1)
