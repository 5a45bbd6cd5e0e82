"""FP8 block-scaled training (DeepSeek-V3's recipe), applied from outside by `apply_fp8`: weights quantized in
128x128 blocks and activations in 1x128 tiles along the reduction dim, float8 e4m3 with one float32 scale per
block (scale = block amax / 448), float32 master weights kept as the parameters and quantized in every forward.

Two paths compute a block-scaled matmul from the same quantized operands:
- reference (CPU): dequantize both operands to float32, then a float32 matmul. Defines the result; tests use it.
- CUDA (SM90 only): `torch._scaled_mm` with 1x128 (activation) x 128x128 (weight) blockwise float32 scales, which
  dispatches to cuBLASLt's VEC128_32F / BLK128x128_32F scale modes (CUDA >= 12.9 builds; fast accumulation is not
  allowed there). The scale layouts it takes are those of its `get_joint_scaling` check: A [N, I] row-major with
  scale_a [N, ceil(I/128)] "outer-dim-major" (strides (1, N)); B = W^T [I, O] column-major with scale_b
  [ceil(I/128), ceil(O/128)] = the transpose of W's contiguous [ceil(O/128), ceil(I/128)] block scales; I and O
  multiples of 16. Any other device, GPU generation or CUDA build raises (`check_fp8_support`): never a silent
  fallback to bf16. Measured on an H100: cuBLASLt also wants the row count a multiple of 16 (else it refuses) and
  the reduction dim a multiple of 4 blocks (else, e.g. 768-wide Qwen3-30B-A3B experts, it returns wrong numbers
  silently); `cublas_padded_operands` zero-pads both (tests/gpu/test_fp8_gpu.py checks the shapes against the
  reference).

Error bounds (tested in tests/unit/test_fp8.py): e4m3 keeps 3 mantissa bits, so a quantized element is off by at
most half an ulp, 2^-4 of its value, or 2^-10 x its block's scale in e4m3's subnormal range (scaled values below
2^-6); hence at most 2^-4 x the block's amax, and blocks never affect each other. A matmul output is off by at most
(2^-3 + 2^-8) x (|x| @ |w|^T) (plus the subnormal terms); on Gaussian data the relative Frobenius error is ~0.04.

Backward (a choice, with its cost): grad_input runs in FP8 too (grad_output in 1x128 tiles along the output dim,
times the weight's 128x128 blocks transposed: the dgrad recipe of DeepSeek-V3); grad_weight = grad_output^T @ x
runs in the compute dtype (bf16 under autocast, float32 on CPU) from x saved in that dtype. DeepSeek-V3 also
quantizes this wgrad GEMM (tiles along the token dim); keeping it in bf16 leaves one of the three GEMMs of a
linear layer at bf16 speed and saves x in bf16 (as plain autocast does), in exchange for exact-to-bf16 weight
gradients. The weight is re-quantized in backward rather than saved in FP8, so FSDP can free the gathered weight
after the forward (as it does for nn.Linear).

Legend: N = rows (tokens), I = input features (the reduction dim), O = output features, E = experts,
M = routed (token, expert) rows sorted by expert, B = 128-wide blocks along a dim (ceil(dim / 128)).
"""

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.models.common.attention import Attention
from slipstream.models.common.mlp import SwiGLU
from slipstream.models.common.moe import GroupedExperts, _local, grouped_mm
from slipstream.models.common.transformer import DecoderLM

BLOCK = 128
"""Side of a weight block and length of an activation tile."""
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
"""448: the largest e4m3 value; a block's amax maps onto it."""
MIN_CUDA = (12, 9)
"""cuBLASLt's blockwise FP8 scale modes (VEC128_32F, BLK128x128_32F) arrived in CUDA 12.9."""


def _blocks(size: int) -> int:
    return -(-size // BLOCK)


def _to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    # Clamp: x / (amax / 448) can land a rounding step above 448, and e4m3fn has no infinity (it would become NaN).
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scale_from_amax(amax: Tensor) -> Tensor:
    """float32 scale per block; an all-zero block gets scale 1 (its values quantize to 0 either way)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_weight_blocks(w_OI: Tensor) -> tuple[Tensor, Tensor]:
    """(q_OI float8_e4m3fn, scale_BB float32 [..., ceil(O/128), ceil(I/128)]): one scale per 128x128 block of the
    last two dims (leading dims, e.g. experts, are batch dims). Edge blocks of shapes not divisible by 128 are
    ragged: their scale comes from the elements they have (zero padding never raises an amax)."""
    *lead, num_out, num_in = w_OI.shape
    pad = (0, _blocks(num_in) * BLOCK - num_in, 0, _blocks(num_out) * BLOCK - num_out)
    padded = F.pad(w_OI.detach().float(), pad)
    blocks = padded.view(*lead, _blocks(num_out), BLOCK, _blocks(num_in), BLOCK)
    scale_BB = _scale_from_amax(blocks.abs().amax(dim=(-3, -1)))
    q = _to_fp8(blocks, scale_BB[..., :, None, :, None]).view(padded.shape)
    return q[..., :num_out, :num_in].contiguous(), scale_BB


def dequantize_weight_blocks(q_OI: Tensor, scale_BB: Tensor) -> Tensor:
    """float32 w_OI = q * its block's scale."""
    num_out, num_in = q_OI.shape[-2:]
    scale_OI = scale_BB.repeat_interleave(BLOCK, dim=-2)[..., :num_out, :]
    scale_OI = scale_OI.repeat_interleave(BLOCK, dim=-1)[..., :num_in]
    return q_OI.float() * scale_OI


def quantize_activation_tiles(x_NI: Tensor) -> tuple[Tensor, Tensor]:
    """(q_NI float8_e4m3fn, scale_NB float32 [..., ceil(I/128)]): one scale per 1x128 tile of the last dim (the
    reduction dim of the matmul); the last tile of a row is ragged when I is not a multiple of 128."""
    *lead, num_in = x_NI.shape
    padded = F.pad(x_NI.detach().float(), (0, _blocks(num_in) * BLOCK - num_in))
    tiles = padded.view(*lead, _blocks(num_in), BLOCK)
    scale_NB = _scale_from_amax(tiles.abs().amax(dim=-1))
    q = _to_fp8(tiles, scale_NB[..., None]).view(padded.shape)
    return q[..., :num_in].contiguous(), scale_NB


def dequantize_activation_tiles(q_NI: Tensor, scale_NB: Tensor) -> Tensor:
    """float32 x_NI = q * its tile's scale."""
    return q_NI.float() * scale_NB.repeat_interleave(BLOCK, dim=-1)[..., : q_NI.shape[-1]]


def block_matmul_reference(q_NI: Tensor, scale_NB: Tensor, q_OI: Tensor, scale_BB: Tensor) -> Tensor:
    """float32 y_NO = dequant(x) @ dequant(w)^T: what a block-scaled FP8 GEMM with float32 accumulation computes,
    up to the order of the float32 sums."""
    with torch.autocast(q_NI.device.type, enabled=False):
        return dequantize_activation_tiles(q_NI, scale_NB) @ dequantize_weight_blocks(q_OI, scale_BB).T


def scaled_mm_operands(q_NI: Tensor, scale_NB: Tensor, q_OI: Tensor, scale_BB: Tensor) -> tuple[Tensor, ...]:
    """(mat_a, mat_b, scale_a, scale_b) of torch._scaled_mm for y_NO, in the layouts of the module docstring:
    mat_b = W^T column-major, scale_a outer-dim-major (strides (1, N)), scale_b = W's contiguous scales, transposed."""
    num_in, num_out = q_NI.shape[1], q_OI.shape[0]
    if num_in % 16 or num_out % 16:
        raise ValueError(
            f"the FP8 GEMM on CUDA needs in/out features that are multiples of 16, got in {num_in}, out {num_out}"
        )
    return q_NI.contiguous(), q_OI.contiguous().t(), scale_NB.t().contiguous().t(), scale_BB.contiguous().t()


ROW_MULTIPLE = 16
"""cuBLASLt's blockwise FP8 GEMM (CUDA 13, H100) refuses row counts that are not a multiple of 16
(CUBLAS_STATUS_NOT_SUPPORTED) and an empty operand: rows are zero-padded up to it."""
REDUCTION_BLOCKS_MULTIPLE = 4
"""Measured on an H100 (torch 2.11, CUDA 13): with a reduction dim of 6 blocks (768, Qwen3-30B-A3B's expert width)
cuBLASLt returns WRONG results without an error (relative error 0.5 to inf against the reference); 8, 16 and 24
blocks are right. Its scale rows must be 16-byte aligned (a multiple of 4 float32 blocks), so the reduction dim is
zero-padded to a multiple of 4 x 128. Padding only the scales' storage is rejected ("Invalid scaling configuration")."""


def cublas_padded_operands(q_NI: Tensor, scale_NB: Tensor, q_OI: Tensor, scale_BB: Tensor) -> tuple[Tensor, ...]:
    """(q_NI, scale_NB, q_OI, scale_BB) zero-padded to what cuBLASLt computes right: rows to a multiple of
    ROW_MULTIPLE, the reduction dim to a multiple of REDUCTION_BLOCKS_MULTIPLE blocks (zeros in the values, scale 1
    in the new blocks: the padded products add exact zeros, so the first N rows of the result are unchanged)."""
    pad_in = _reduction_pad(q_NI.shape[1])
    if pad_in:
        q_NI, scale_NB = _pad_reduction(q_NI, scale_NB, pad_in)
        q_OI, scale_BB = _pad_reduction(q_OI, scale_BB, pad_in)
    pad_rows = -q_NI.shape[0] % ROW_MULTIPLE
    if pad_rows:
        q_NI = F.pad(q_NI.view(torch.uint8), (0, 0, 0, pad_rows)).view(FP8_DTYPE)
        scale_NB = F.pad(scale_NB, (0, 0, 0, pad_rows), value=1.0)
    return q_NI, scale_NB, q_OI, scale_BB


def _round_up(n: int, multiple: int) -> int:
    return n + (-n % multiple)


def _reduction_pad(num_in: int) -> int:
    """Zeros to append to a reduction dim of `num_in` so that its blocks are a multiple of REDUCTION_BLOCKS_MULTIPLE."""
    if _blocks(num_in) % REDUCTION_BLOCKS_MULTIPLE == 0:
        return 0
    return _round_up(num_in, REDUCTION_BLOCKS_MULTIPLE * BLOCK) - num_in


def _pad_reduction(q_xI: Tensor, scale_xB: Tensor, pad_in: int) -> tuple[Tensor, Tensor]:
    """The last (reduction) dim of a quantized operand and of its block scales extended by `pad_in` zeros (scale 1
    for the new blocks); any leading dims (experts). F.pad has no float8 kernels: the raw bytes are padded (0x00 is
    +0.0 in e4m3)."""
    pad_blocks = _blocks(q_xI.shape[-1] + pad_in) - scale_xB.shape[-1]
    q_xI = F.pad(q_xI.view(torch.uint8), (0, pad_in)).view(FP8_DTYPE)
    return q_xI, F.pad(scale_xB, (0, pad_blocks), value=1.0)


def _scatter_rows(t_NX: Tensor, index_N: Tensor, rows: int) -> Tensor:
    """[rows, X] with row index_N[n] = t_NX[n] and the others zero (quantized values) or one (scales)."""
    if t_NX.dtype == FP8_DTYPE:
        out = torch.zeros(rows, t_NX.shape[1], dtype=torch.uint8, device=t_NX.device)
        return out.index_copy_(0, index_N, t_NX.view(torch.uint8)).view(FP8_DTYPE)
    return torch.ones(rows, t_NX.shape[1], dtype=t_NX.dtype, device=t_NX.device).index_copy_(0, index_N, t_NX)


def _cuda_block_matmul(q_NI: Tensor, scale_NB: Tensor, q_OI: Tensor, scale_BB: Tensor, out_dtype) -> Tensor:
    """y_NO on an SM90 GPU: cuBLASLt accumulates in float32 and applies the block scales as it goes."""
    check_fp8_support(q_NI.device)
    num_rows = q_NI.shape[0]
    if num_rows == 0:  # an expert without tokens; cuBLASLt rejects empty operands
        return torch.zeros(0, q_OI.shape[0], dtype=out_dtype, device=q_NI.device)
    padded = cublas_padded_operands(q_NI, scale_NB, q_OI, scale_BB)
    mat_a, mat_b, scale_a, scale_b = scaled_mm_operands(*padded)
    y_NO = torch._scaled_mm(mat_a, mat_b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, use_fast_accum=False)
    return y_NO[:num_rows]


def scaled_block_matmul(q_NI: Tensor, scale_NB: Tensor, q_OI: Tensor, scale_BB: Tensor, out_dtype) -> Tensor:
    """y_NO (out_dtype) from quantized operands: the CUDA GEMM on GPUs, the reference on CPU."""
    if q_NI.device.type == "cpu":
        return block_matmul_reference(q_NI, scale_NB, q_OI, scale_BB).to(out_dtype)
    if q_NI.device.type == "cuda":
        return _cuda_block_matmul(q_NI, scale_NB, q_OI, scale_BB, out_dtype)
    raise RuntimeError(f"FP8 block-scaled matmul runs on CPU (reference) or SM90 CUDA GPUs, not {q_NI.device}")


def fp8_block_matmul(x_NI: Tensor, w_OI: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """y_NO = x @ w^T computed from x in 1x128 tiles and w in 128x128 blocks (no autograd: see `fp8_linear`)."""
    return scaled_block_matmul(*quantize_activation_tiles(x_NI), *quantize_weight_blocks(w_OI), out_dtype or x_NI.dtype)


@functools.cache
def _cuda_support_error(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        return (
            f"FP8 block-scaled training (trainer.fp8) needs an SM90 GPU (H100/H200): torch._scaled_mm's 1x128 / "
            f"128x128 blockwise scaling is cuBLASLt's Hopper path; {torch.cuda.get_device_name(index)} is "
            f"sm_{major}{minor}. Set trainer.fp8 = false"
        )
    version = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    if version < MIN_CUDA:
        return (
            f"FP8 block-scaled training (trainer.fp8) needs torch built with CUDA >= 12.9 (blockwise scales in "
            f"cuBLASLt); this torch has CUDA {torch.version.cuda}. Install a cu129+ build or set trainer.fp8 = false"
        )
    return None


def check_fp8_support(device: torch.device) -> None:
    """Raise unless FP8 block-scaled matmuls can run on `device`: CPU (the reference path) or an SM90 GPU with a
    CUDA >= 12.9 build of torch."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise RuntimeError(f"trainer.fp8 runs on CPU (reference) or SM90 CUDA GPUs, not on {device.type}")
    error = _cuda_support_error(device.index if device.index is not None else torch.cuda.current_device())
    if error is not None:
        raise RuntimeError(error)


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a plain linear layer would return here: the autocast dtype when autocast is on."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


class _Fp8LinearFunction(torch.autograd.Function):
    """y_NO = x_NI @ w_OI^T: FP8 forward and dgrad, compute-dtype wgrad (module docstring)."""

    @staticmethod
    def forward(ctx, x_NI: Tensor, w_OI: Tensor, out_dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x_NI.to(out_dtype), w_OI)
        ctx.x_dtype = x_NI.dtype
        return fp8_block_matmul(x_NI, w_OI, out_dtype)

    @staticmethod
    def backward(ctx, grad_y_NO: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x_NI, w_OI = ctx.saved_tensors
        grad_x_NI = grad_w_OI = None
        if ctx.needs_input_grad[0]:
            q_OI, scale_BB = quantize_weight_blocks(w_OI)
            # The 128x128 blocks of w^T are the transposed blocks of w, with the same scales.
            grad_x_NI = scaled_block_matmul(
                *quantize_activation_tiles(grad_y_NO), q_OI.t().contiguous(), scale_BB.t(), ctx.x_dtype
            )
        if ctx.needs_input_grad[1]:
            grad_w_OI = (grad_y_NO.to(x_NI.dtype).t() @ x_NI).to(w_OI.dtype)
        return grad_x_NI, grad_w_OI, None


def fp8_linear(x: Tensor, weight_OI: Tensor, bias_O: Tensor | None = None) -> Tensor:
    """F.linear through the FP8 block-scaled GEMM, differentiable; any leading dims; returns the dtype F.linear
    would (the autocast dtype under autocast)."""
    out_dtype = _compute_dtype(x)
    y_NO = _Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight_OI, out_dtype)
    y = y_NO.view(*x.shape[:-1], weight_OI.shape[0])
    return y if bias_O is None else y + bias_O.to(out_dtype)


class Fp8Linear(nn.Linear):
    """nn.Linear whose forward runs `fp8_linear`: same parameters and state-dict keys (swapped in by class)."""

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias)


class _Fp8ExpertLinearFunction(torch.autograd.Function):
    """y_MO = x_mI @ w_EOI[e]^T for the rows m of each expert e (rows sorted by expert, `counts` per expert): one
    FP8 GEMM per expert (no blockwise grouped GEMM on SM90 in torch), activations quantized once for all rows."""

    @staticmethod
    def forward(ctx, x_MI: Tensor, w_EOI: Tensor, counts: list[int], out_dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x_MI.to(out_dtype), w_EOI)
        ctx.counts, ctx.x_dtype = counts, x_MI.dtype
        q_MI, scale_MB = quantize_activation_tiles(x_MI)
        q_EOI, scale_EBB = quantize_weight_blocks(w_EOI)
        return _per_expert(q_MI, scale_MB, counts, q_EOI, scale_EBB, out_dtype)

    @staticmethod
    def backward(ctx, grad_y_MO: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x_MI, w_EOI = ctx.saved_tensors
        grad_x_MI = grad_w_EOI = None
        if ctx.needs_input_grad[0]:
            q_EOI, scale_EBB = quantize_weight_blocks(w_EOI)
            # every expert's weight transposed in one copy (the GEMM wants W^T row-major), not one per expert
            q_EIO, scale_EBB_t = q_EOI.transpose(-2, -1).contiguous(), scale_EBB.transpose(-2, -1)
            q_MO, scale_MB = quantize_activation_tiles(grad_y_MO)
            grad_x_MI = _per_expert(q_MO, scale_MB, ctx.counts, q_EIO, scale_EBB_t, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            grad_w_EOI = _expert_weight_grads(x_MI, grad_y_MO.to(x_MI.dtype), ctx.counts).to(w_EOI.dtype)
        return grad_x_MI, grad_w_EOI, None, None


def _expert_weight_grads(x_MI: Tensor, grad_y_MO: Tensor, counts: list[int]) -> Tensor:
    """grad_w_EOI[e] = grad_y[rows of e]^T @ x[rows of e] (zero for an expert without rows), in the compute dtype:
    one grouped GEMM (what torch's own backward of `torch._grouped_mm` runs for bf16 experts) in bf16 and on CPU,
    else one matmul per expert."""
    if x_MI.dtype == torch.bfloat16 or x_MI.device.type == "cpu":
        offsets_E = torch.tensor(counts, device=x_MI.device).cumsum(0).to(torch.int32)
        return grouped_mm(x_MI.t(), grad_y_MO, offsets_E).transpose(-2, -1)
    grad_w_EOI = x_MI.new_empty(len(counts), grad_y_MO.shape[1], x_MI.shape[1])
    rows = zip(torch.split(grad_y_MO, counts), torch.split(x_MI, counts), strict=True)
    for e, (grad_y_mO, x_mI) in enumerate(rows):
        grad_w_EOI[e] = grad_y_mO.t() @ x_mI
    return grad_w_EOI


def _per_expert(
    q_MI: Tensor, scale_MB: Tensor, counts: list[int], q_EOI: Tensor, scale_EBB: Tensor, out_dtype
) -> Tensor:
    """y_MO: the rows of expert e (`counts[e]` of them, in order) times expert e's quantized weight, one GEMM per
    expert. The operands are laid out once for all experts as cuBLASLt wants them (every expert's rows padded to a
    multiple of ROW_MULTIPLE by one scatter, the reduction dim padded once), so no GEMM copies its operands."""
    pad_in = _reduction_pad(q_MI.shape[1])
    if pad_in:
        q_MI, scale_MB = _pad_reduction(q_MI, scale_MB, pad_in)
        q_EOI, scale_EBB = _pad_reduction(q_EOI, scale_EBB, pad_in)
    rows = [_round_up(n, ROW_MULTIPLE) for n in counts]
    index_M = None
    if rows != counts:
        index_M = _padded_row_index(counts, rows).to(q_MI.device, non_blocking=True)
        q_MI, scale_MB = _scatter_rows(q_MI, index_M, sum(rows)), _scatter_rows(scale_MB, index_M, sum(rows))
    outputs = []
    for e, (q_mI, scale_mB) in enumerate(zip(torch.split(q_MI, rows), torch.split(scale_MB, rows), strict=True)):
        outputs.append(scaled_block_matmul(q_mI, scale_mB, q_EOI[e], scale_EBB[e], out_dtype))
    y_MO = torch.cat(outputs)
    return y_MO if index_M is None else y_MO.index_select(0, index_M)


def _padded_row_index(counts: list[int], rows: list[int]) -> Tensor:
    """Where each of the sum(counts) rows sits once every expert's block of rows starts at its padded offset."""
    shift_E = np.cumsum([0, *rows[:-1]]) - np.cumsum([0, *counts[:-1]])
    return torch.from_numpy(np.arange(sum(counts)) + np.repeat(shift_E, counts))


def fp8_expert_linear(x_MI: Tensor, w_EOI: Tensor, counts_E: Tensor | list[int]) -> Tensor:
    """y_MO: each expert's rows through its own projection, by FP8 block-scaled GEMMs (differentiable). The rows per
    expert as a list spare a host sync (the GEMMs are split on the host)."""
    counts = counts_E.tolist() if isinstance(counts_E, Tensor) else counts_E
    return _Fp8ExpertLinearFunction.apply(x_MI, w_EOI, counts, _compute_dtype(x_MI))


class Fp8GroupedExperts(GroupedExperts):
    """GroupedExperts whose three projections run `fp8_expert_linear` (swapped in by class: same parameters, keys
    and expert-parallel dispatch); `use_grouped_mm` is ignored, the FP8 path always loops over the experts."""

    exact_rows = True

    def forward(self, x_MD: Tensor, counts_E: Tensor) -> Tensor:
        gate_EFD, up_EFD, down_EDF = (_local(w) for w in (self.gate_proj, self.up_proj, self.down_proj))
        counts = counts_E.tolist()  # one host sync for the three projections
        h_MF = F.silu(fp8_expert_linear(x_MD, gate_EFD, counts)) * fp8_expert_linear(x_MD, up_EFD, counts)
        return fp8_expert_linear(h_MF, down_EDF, counts)


def apply_fp8(model: nn.Module, device: torch.device | str) -> dict[str, int]:
    """Swap the dense projections of one of our models (attention q/k/v/o, dense SwiGLU gate/up/down) to Fp8Linear
    and its MoE experts to Fp8GroupedExperts, in place, before any parallelism wraps them. The LM head, router,
    embeddings and norms stay in the compute dtype. Checks that `device` can run it (`check_fp8_support`).
    Returns how many modules of each kind were swapped."""
    if not isinstance(model, DecoderLM):
        raise ValueError(
            f"trainer.fp8 needs Slipstream's own model implementation (trainer.model_impl = 'custom'); "
            f"{type(model).__name__} is not one: set trainer.fp8 = false or use a supported model type"
        )
    check_fp8_support(torch.device(device))
    swapped = {"linear": 0, "experts": 0}
    for module in model.modules():
        if isinstance(module, (Attention, SwiGLU)):
            for child in module.children():
                if type(child) is nn.Linear:
                    child.__class__ = Fp8Linear
                    swapped["linear"] += 1
        elif type(module) is GroupedExperts:
            module.__class__ = Fp8GroupedExperts
            swapped["experts"] += 1
    return swapped
