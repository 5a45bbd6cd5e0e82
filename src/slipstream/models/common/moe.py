"""Token-choice mixture of experts: softmax top-k router with float32 logits, and SwiGLU experts stored as stacked
[E, ...] tensors so that `torch._grouped_mm` can run all experts in one call. The experts module takes the routed
rows already sorted by expert, with per-expert counts: expert parallelism (parallel/ep.py) wraps exactly that call.

Legend: N = tokens (rows x tokens per row, flattened), D = hidden size, E = experts, A = active experts per token
(top-k), F = expert hidden size, M = N * A routed (token, expert) pairs.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

REPLAY_PAD = -2
"""A router-replay slot that holds no token (a padded row's or a context-parallel shard's padding); -1 marks a real
token that inference did not route (a prompt token it never forwarded, tool output), which the router routes itself."""


def replay_counts(own_NA: Tensor, replay_NA: Tensor) -> tuple[Tensor, Tensor]:
    """(routed_N: the tokens inference routed, counts: (tokens, of those routed, of those the ones whose own top-A set
    was inference's)): what `TopKRouter.replay_counts` records. Padding is no token: the counts are over the tokens
    this forward ran, whichever layout ran them (a prefix computed once per sample counts once per sample)."""
    routed_N = (replay_NA >= 0).all(dim=-1)
    with torch.no_grad():
        real_N = replay_NA[:, 0] != REPLAY_PAD
        same_N = (own_NA.sort(dim=-1).values == replay_NA.sort(dim=-1).values).all(dim=-1)
        counts = torch.stack([real_N.sum(), routed_N.sum(), (same_N & routed_N).sum()])
    return routed_N, counts


class TopKRouter(nn.Module):
    """Softmax over float32 logits, top-A experts per token; optionally renormalise the A weights to sum to 1.
    `bias` adds a learned per-expert logit bias (GPT-OSS)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool, bias: bool = False):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.replay_counts: Tensor | None = None
        """(tokens, of those replayed, of those the ones whose own top-A set was inference's) of the last replayed
        forward (`replay_counts`)."""

    def forward(self, x_ND: Tensor, replay_NA: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(probs_NE float32, expert_ids_NA, weights_NA float32).

        Router replay: `replay_NA` holds the experts inference chose for each token (-1 on every slot of a token it
        did not route, such as prompt tokens it never forwarded or tool output): those tokens go to the replayed
        experts, the others to this router's own top-A. The gate weights always come from this router's
        probabilities, taken at the chosen experts: gradients still reach the router, and only the discrete choice
        (what flips between bf16 inference and the float32 trainer) is replayed. (The alternative, inference's own
        gate weights, is not returned by vLLM and would cut the router's gradient.)"""
        # Router logits stay float32 even under autocast: bf16 logits flip top-k choices (train/inference mismatch).
        with torch.autocast(x_ND.device.type, enabled=False):
            bias_E = None if self.bias is None else self.bias.float()
            logits_NE = F.linear(x_ND.float(), self.weight.float(), bias_E)
        probs_NE = logits_NE.softmax(dim=-1)
        weights_NA, expert_ids_NA = probs_NE.topk(self.top_k, dim=-1)
        if replay_NA is not None:
            replay_NA = replay_NA.to(expert_ids_NA.dtype)
            routed_N, self.replay_counts = replay_counts(expert_ids_NA, replay_NA)
            expert_ids_NA = torch.where(routed_N[:, None], replay_NA, expert_ids_NA)
            weights_NA = probs_NE.gather(-1, expert_ids_NA)
        if self.norm_topk_prob:
            weights_NA = weights_NA / weights_NA.sum(dim=-1, keepdim=True)
        return probs_NE, expert_ids_NA, weights_NA


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights in nn.Linear layout: gate_proj/up_proj [E, F, D], down_proj [E, D, F].

    `forward(x_MD, counts_E)` takes rows sorted by expert (`counts_E[e]` rows for expert e, in order). Under expert
    parallelism the weights are DTensors sharded on dim 0 and the rows are those of this rank's experts: the
    forward then runs on the local [E / ep, ...] weights. `use_grouped_mm` (default) runs all experts through
    `torch._grouped_mm`: one kernel per projection on GPU; on CPU as fast as the loop or faster (float32 and bf16).
    `use_grouped_mm = False` loops over the experts (the reference). Both give the same result. torch.compile traces
    `torch._grouped_mm` in bf16 only (its meta kernel): float32 grouped matmuls run eagerly (`grouped_mm`), a graph
    break there.

    Mixed precision: `torch._grouped_mm` has no autocast rule, so under autocast the grouped path casts the rows and
    the weights to the autocast dtype itself (as autocast does for the dense linears and for the loop's matmuls); the
    float32 masters stay and receive float32 gradients through the cast. Without autocast the rows are cast to the
    weights' dtype (bf16 under FSDP's bf16 all-gather: no second cast of the weights).
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts, self.use_grouped_mm = num_experts, use_grouped_mm
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    @property
    def exact_rows(self) -> bool:
        """Whether forward needs exactly sum(counts_E) rows: the per-expert loop splits them on the host. The grouped
        path also takes more (rows past the last expert's are left uncomputed: expert parallelism masks them)."""
        return not self.use_grouped_mm

    def forward(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        """y_MD: row m through the SwiGLU of the expert it is sorted under."""
        weights = tuple(_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if self.use_grouped_mm:
            return self._grouped_mm(x_MD, counts_E, *weights)
        return self._loop(x_MD, counts_E, *weights)

    @staticmethod
    def _loop(x_MD: Tensor, counts_E: Tensor, gate_EFD: Tensor, up_EFD: Tensor, down_EDF: Tensor) -> Tensor:
        outputs = []
        # Experts without rows still run (empty matmuls): every expert weight then gets a gradient, zero or not, which
        # FSDP's gradient reduction needs on every rank.
        for e, x_mD in enumerate(torch.split(x_MD, counts_E.tolist())):
            h_mF = F.silu(x_mD @ gate_EFD[e].T) * (x_mD @ up_EFD[e].T)
            outputs.append(h_mF @ down_EDF[e].T)
        return torch.cat(outputs)

    @staticmethod
    def _grouped_mm(x_MD: Tensor, counts_E: Tensor, gate_EFD: Tensor, up_EFD: Tensor, down_EDF: Tensor) -> Tensor:
        dtype = grouped_mm_dtype(x_MD.device.type, gate_EFD.dtype)
        x_MD, gate_EFD, up_EFD, down_EDF = (t.to(dtype) for t in (x_MD, gate_EFD, up_EFD, down_EDF))
        offsets_E = counts_E.cumsum(0).to(torch.int32)
        gate_MF = grouped_mm(x_MD, gate_EFD.transpose(-2, -1), offsets_E)
        up_MF = grouped_mm(x_MD, up_EFD.transpose(-2, -1), offsets_E)
        return grouped_mm(F.silu(gate_MF) * up_MF, down_EDF.transpose(-2, -1), offsets_E)

    def init_weights(self, std: float) -> None:
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)


def grouped_mm(a_MI: Tensor, b_EIO: Tensor, offsets_E: Tensor) -> Tensor:
    """torch._grouped_mm(a, b, offs=offsets). Its meta kernel (what torch.compile traces) takes bf16 only, and a
    float32 call raised inside the compiled graph (measured with FSDP x EP, torch 2.11 and 2.13): outside bf16,
    under torch.compile, it runs eagerly instead (a graph break; float32 is the reference dtype, not a fast path)."""
    if a_MI.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return _eager_grouped_mm(a_MI, b_EIO, offsets_E)
    return torch._grouped_mm(a_MI, b_EIO, offs=offsets_E)


@torch.compiler.disable
def _eager_grouped_mm(a_MI: Tensor, b_EIO: Tensor, offsets_E: Tensor) -> Tensor:
    return torch._grouped_mm(a_MI, b_EIO, offs=offsets_E)


def grouped_mm_dtype(device_type: str, weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype the grouped expert matmuls run in: autocast's when it is on for `device_type` (as for a dense linear),
    else the weights' own."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return weight_dtype


def _local(weight: Tensor) -> Tensor:
    """This rank's part of a weight sharded from outside (a DTensor); the weight itself otherwise. An isinstance
    check, not duck typing: under torch.compile `hasattr(parameter, "to_local")` is False for a DTensor parameter
    (measured, torch 2.13), and the DTensor would reach the grouped GEMM."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def sort_by_expert(expert_ids_NA: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(order_M, token_M, counts_E): the (token, expert) pairs sorted by expert (stable), each pair's token, and the
    pairs per expert. Pair m of the sorted order is flat pair `order_M[m]` of expert_ids_NA."""
    top_k = expert_ids_NA.shape[1]
    order_M = torch.argsort(expert_ids_NA.reshape(-1), stable=True)
    return order_M, order_M // top_k, count_per_expert(expert_ids_NA, num_experts)


def inverse_permutation(order_M: Tensor) -> Tensor:
    """inverse_M with order_M[inverse_M[p]] = p: where flat pair p sits in the sorted order."""
    positions_M = torch.arange(order_M.numel(), device=order_M.device, dtype=order_M.dtype)
    return torch.empty_like(order_M).scatter_(0, order_M, positions_M)


class _DispatchRows(torch.autograd.Function):
    """x_MD = x_ND[token_M] (each token once per active expert, sorted by expert). Backward gathers instead of
    autograd's scatter-add (atomic adds over [M, D], the slowest part of the MoE layer's backward on a GPU):
    grad_x_ND = grad_MD[inverse_M] viewed as [N, A, D], summed over the A slots; deterministic too."""

    @staticmethod
    def forward(ctx, x_ND: Tensor, token_M: Tensor, inverse_M: Tensor) -> Tensor:
        ctx.save_for_backward(inverse_M)
        ctx.num_tokens = x_ND.shape[0]
        return x_ND[token_M]

    @staticmethod
    def backward(ctx, grad_MD: Tensor):
        (inverse_M,) = ctx.saved_tensors
        grad_NAD = grad_MD[inverse_M].view(ctx.num_tokens, -1, grad_MD.shape[-1])
        return grad_NAD.sum(dim=1), None, None


class _PermuteRows(torch.autograd.Function):
    """y = x[perm] for a permutation `perm` of x's rows whose inverse is known; its backward is the gather
    grad_x = grad_y[inverse] (a permutation's inverse), not autograd's scatter-add of an indexing."""

    @staticmethod
    def forward(ctx, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x[perm]

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (inverse,) = ctx.saved_tensors
        return grad_y[inverse], None, None


def dispatch_rows(x_ND: Tensor, token_M: Tensor, inverse_M: Tensor) -> Tensor:
    """x_ND[token_M] with a gather for backward (see _DispatchRows)."""
    return _DispatchRows.apply(x_ND, token_M, inverse_M)


def permute_rows(x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
    """x[perm] with a gather for backward (see _PermuteRows); `inverse` is perm's inverse permutation."""
    return _PermuteRows.apply(x, perm, inverse)


def unsort_rows(y_MD: Tensor, inverse_M: Tensor, order_M: Tensor) -> Tensor:
    """y_PD = y_MD[inverse_M]: the expert-sorted rows back in (token, slot) pair order (backward: a gather by
    order_M)."""
    return permute_rows(y_MD, inverse_M, order_M)


def count_per_expert(expert_ids_NA: Tensor, num_experts: int) -> Tensor:
    """counts_E (int64): how many of the (token, expert) pairs go to each expert. A scatter-add rather than
    `torch.bincount`, whose output size depends on the data: torch.compile breaks the graph there."""
    ids_M = expert_ids_NA.reshape(-1)
    ones_M = torch.ones_like(ids_M, dtype=torch.int64)
    return ids_M.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, ids_M, ones_M)


def mix_experts(experts: nn.Module, x_ND: Tensor, expert_ids_NA: Tensor, weights_NA: Tensor, dtype=None) -> Tensor:
    """y_ND = sum over a token's A slots of weights_NA * expert_{expert_ids_NA}(x_n), in `dtype` (x's by default):
    each expert's rows gathered contiguous for `experts` (a GroupedExperts), brought back and weighted.

    Expert parallelism (parallel/ep.py) sets `experts.token_dispatch`, which then runs this across the ranks of the
    ep group instead (each token sent once to each rank holding one of its experts)."""
    dtype = x_ND.dtype if dtype is None else dtype
    token_dispatch = getattr(experts, "token_dispatch", None)
    if token_dispatch is not None:
        return token_dispatch(experts, x_ND, expert_ids_NA, weights_NA, dtype)
    order_M, token_M, counts_E = sort_by_expert(expert_ids_NA, experts.num_experts)
    inverse_M = inverse_permutation(order_M)
    y_MD = experts(dispatch_rows(x_ND, token_M, inverse_M), counts_E)
    # Back in (token, slot) order, weighted and summed over a token's A experts in `dtype` (under autocast the
    # expert matmuls return bf16 while x, from the float32 residual stream, stays float32).
    y_NAD = unsort_rows(y_MD, inverse_M, order_M).view(*expert_ids_NA.shape, -1)
    return (y_NAD.to(dtype) * weights_NA.unsqueeze(-1).to(dtype)).sum(dim=1)


def mix_local_experts(
    experts: nn.Module, x_RD: Tensor, local_ids_RA: Tensor, weights_RA: Tensor, num_local: int, dtype
) -> Tensor:
    """mix_experts over this rank's experts only, for rows sent by expert parallelism: `local_ids_RA` numbers
    `experts`' `num_local` experts from 0, and -1 marks a slot whose expert lives on another rank (it contributes
    nothing; its weight is 0). Returns the partial sums in float32 (float64 for float64 rows): the ranks' partial
    sums of a token add up to mix_experts' sum, rounded once to `dtype`.

    Shapes stay static (no device-to-host sync, so a compiled block holds it whole): all R x A slots are sorted by
    expert with the masked ones last, and the grouped GEMMs' offsets end where the masked slots begin; the rows past
    them are not computed and are zeroed here, values and gradients. Experts that loop on the host
    (`exact_rows`) get the valid rows only."""
    num_rows, top_k = local_ids_RA.shape
    key_K = torch.where(local_ids_RA >= 0, local_ids_RA, num_local).reshape(-1)  # K = R * A slots; masked last
    order_K = torch.argsort(key_K, stable=True)
    inverse_K = inverse_permutation(order_K)
    counts_E = count_per_expert(key_K, num_local + 1)[:num_local]
    x_KD = dispatch_rows(x_RD, order_K // top_k, inverse_K)
    if getattr(experts, "exact_rows", False):
        num_valid = int(counts_E.sum())  # a host sync, as the experts' own loop has
        y_vD = experts(x_KD[:num_valid], counts_E)
        y_KD = torch.cat([y_vD, y_vD.new_zeros(x_KD.shape[0] - num_valid, *y_vD.shape[1:])])
    else:
        valid_K1 = (torch.arange(key_K.numel(), device=key_K.device) < counts_E.sum()).unsqueeze(-1)
        y_KD = experts(torch.where(valid_K1, x_KD, 0), counts_E)
        y_KD = torch.where(valid_K1, y_KD, 0)
    y_RAD = unsort_rows(y_KD, inverse_K, order_K).view(num_rows, top_k, -1)
    sum_dtype = torch.promote_types(dtype, torch.float32)
    return (y_RAD.to(dtype) * weights_RA.unsqueeze(-1).to(dtype)).sum(dim=1, dtype=sum_dtype)


class MoE(nn.Module):
    """Routed SwiGLU experts (no shared expert). `forward` returns (y_BTD, aux_loss): the Switch-style load-balance
    loss of that call, differentiable through the router; adding it to a loss is the caller's choice. Detached
    statistics of the last call stay on the module for logging (`tokens_per_expert_E`, `router_prob_mean_E`,
    `aux_loss`): nothing kept on the module holds an autograd graph."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts = num_experts
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.num_tokens = 0
        """N of the last forward."""
        self.tokens_per_expert_E: Tensor | None = None
        """Routed (token, expert) pairs per expert in the last forward (int64); sums to N * A."""
        self.router_prob_mean_E: Tensor | None = None
        """Mean router probability per expert over the last forward's tokens (float32, detached)."""
        self.aux_loss: Tensor | None = None
        """Value of the last forward's load-balance loss (detached): E * sum_e f_e * P_e with
        f_e = tokens_per_expert_E / N and P_e = router_prob_mean_E; equals A when routing is perfectly balanced."""

    def forward(self, x_BTD: Tensor, replay_BTA: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """`replay_BTA`: experts inference routed each token to (router replay, see TopKRouter), -1 where none."""
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        replay_NA = None if replay_BTA is None else replay_BTA.reshape(x_ND.shape[0], -1)
        probs_NE, expert_ids_NA, weights_NA = self.router(x_ND, replay_NA)
        y_ND = mix_experts(self.experts, x_ND, expert_ids_NA, weights_NA)
        return y_ND.view_as(x_BTD), self._load_balance_loss(probs_NE, expert_ids_NA)

    def _load_balance_loss(self, probs_NE: Tensor, expert_ids_NA: Tensor) -> Tensor:
        """The differentiable aux loss; records the detached statistics on the module."""
        num_tokens = probs_NE.shape[0]
        tokens_per_expert_E = count_per_expert(expert_ids_NA, self.num_experts)
        router_prob_mean_E = probs_NE.mean(dim=0)
        fraction_E = tokens_per_expert_E.float() / num_tokens
        aux_loss = self.num_experts * (fraction_E * router_prob_mean_E).sum()
        self.num_tokens = num_tokens
        self.tokens_per_expert_E = tokens_per_expert_E.detach()
        self.router_prob_mean_E = router_prob_mean_E.detach()
        self.aux_loss = aux_loss.detach()
        return aux_loss

    def init_weights(self, std: float) -> None:
        nn.init.normal_(self.router.weight, mean=0.0, std=std)
        self.experts.init_weights(std)


@dataclass
class MoEStats:
    """Load-balance statistics of the MoE layers in the last forward (L = MoE layers, in depth order)."""

    num_tokens: int
    """N: tokens routed per layer."""
    tokens_per_expert_LE: Tensor
    router_prob_mean_LE: Tensor
    aux_loss_L: Tensor
    """Per-layer Switch aux loss values (detached; the differentiable ones come from the forward that made them,
    e.g. `DecoderLM.forward_hidden_with_aux_loss`)."""

    def global_aux_loss(self) -> Tensor:
        """transformers' `load_balancing_loss_func` value (`aux_loss` of `output_router_logits=True`): fractions
        and probabilities averaged over all layers and tokens first, then E * sum_e f_e * P_e (detached)."""
        num_experts = self.tokens_per_expert_LE.shape[1]
        fraction_E = (self.tokens_per_expert_LE.float() / self.num_tokens).mean(dim=0)
        return num_experts * (fraction_E * self.router_prob_mean_LE.mean(dim=0)).sum()


def collect_moe_stats(model: nn.Module) -> MoEStats:
    """Stack the last-forward statistics of every MoE layer of `model` (all detached)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or layers[0].aux_loss is None:
        raise RuntimeError("no MoE statistics yet: run a forward pass first")
    return MoEStats(
        num_tokens=layers[0].num_tokens,
        tokens_per_expert_LE=torch.stack([m.tokens_per_expert_E for m in layers]),
        router_prob_mean_LE=torch.stack([m.router_prob_mean_E for m in layers]),
        aux_loss_L=torch.stack([m.aux_loss for m in layers]),
    )


def find_grouped_experts(model: nn.Module) -> list[GroupedExperts]:
    """The stacked-experts modules of `model`, in depth order (what expert parallelism shards)."""
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]
