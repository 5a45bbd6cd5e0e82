"""On an SM90 GPU: the FP8 block-scaled GEMM (cuBLASLt through torch._scaled_mm) against the float32 reference of
the same quantized operands, over the shapes cuBLASLt is picky about. Measured on an H100 (torch 2.11, CUDA 13)
before the padding: row counts not a multiple of 16 were refused, empty operands too, and a 768-wide reduction
(6 blocks: the Qwen3-30B-A3B experts' down projection and the dgrad of their gate/up projections) gave wrong
numbers without an error. Not run in CI (marked gpu)."""

import pytest
import torch

from slipstream.models.common import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rows", [0, 8, 17, 137, 256])
@pytest.mark.parametrize(("num_in", "num_out"), [(768, 2048), (2048, 768), (640, 1024), (1152, 256), (400, 272)])
def test_block_scaled_gemm_matches_the_reference(rows, num_in, num_out):
    fp8.check_fp8_support(torch.device("cuda"))
    g = torch.Generator("cuda").manual_seed(rows + num_in)
    x = torch.randn(rows, num_in, device="cuda", generator=g)
    w = torch.randn(num_out, num_in, device="cuda", generator=g)
    (qx, sx), (qw, sw) = fp8.quantize_activation_tiles(x), fp8.quantize_weight_blocks(w)
    y = fp8.scaled_block_matmul(qx, sx, qw, sw, torch.float32)
    ref = fp8.block_matmul_reference(qx, sx, qw, sw)
    assert y.shape == (rows, num_out)
    if rows:
        # cuBLASLt accumulates FP8 products at reduced precision (measured ~1.3e-4); wrong layouts gave >= 0.5
        assert ((y - ref).norm() / ref.norm()).item() < 1e-3


def test_fp8_experts_forward_backward_with_uneven_and_empty_experts():
    """Rows per expert of every kind (none, fewer than 16, not a multiple of 16) through the differentiable
    expert GEMMs, against the same computation by the reference on the same GPU."""
    g = torch.Generator("cuda").manual_seed(0)
    counts = torch.tensor([0, 5, 17, 32, 0, 130], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", generator=g, requires_grad=True)
    w = torch.randn(len(counts), 768, 256, device="cuda", generator=g, requires_grad=True)
    grad_y = torch.randn(int(counts.sum()), 768, device="cuda", generator=g)
    (fp8.fp8_expert_linear(x, w, counts) * grad_y).sum().backward()
    y_ref, grad_x_ref, start = [], [], 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        qw, sw = fp8.quantize_weight_blocks(w.detach()[e])
        y_ref.append(fp8.block_matmul_reference(*fp8.quantize_activation_tiles(x.detach()[rows]), qw, sw))
        # dgrad: grad_y tiles along the 768-wide output dim times the weight's blocks transposed
        q_gy, s_gy = fp8.quantize_activation_tiles(grad_y[rows])
        grad_x_ref.append(fp8.block_matmul_reference(q_gy, s_gy, qw.t().contiguous(), sw.t()))
        start += n
    y = fp8.fp8_expert_linear(x.detach(), w.detach(), counts)
    for got, ref in ((y, torch.cat(y_ref)), (x.grad, torch.cat(grad_x_ref))):
        assert ((got - ref).norm() / ref.norm()).item() < 1e-3
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
    assert (w.grad[0] == 0).all() and (w.grad[4] == 0).all() and x.grad.abs().sum() > 0


def test_bf16_expert_weight_grads_on_cuda_match_the_loop():
    """bf16 (the autocast path): the experts' weight gradients by one grouped GEMM on the GPU, against per-expert
    matmuls, uneven and empty experts included."""
    from slipstream.models.common.fp8 import _expert_weight_grads

    g = torch.Generator("cuda").manual_seed(1)
    counts = [0, 5, 17, 32, 0, 130]
    x = torch.randn(sum(counts), 768, device="cuda", generator=g).bfloat16()
    grad_y = torch.randn(sum(counts), 2048, device="cuda", generator=g).bfloat16()
    got = _expert_weight_grads(x, grad_y, counts).float()
    pairs = zip(grad_y.split(counts), x.split(counts), strict=True)
    want = torch.stack([gy.float().t() @ xe.float() for gy, xe in pairs])
    assert ((got - want).norm() / want.norm()).item() < 1e-2 and (got[0] == 0).all() and (got[4] == 0).all()
