"""FP8 block-scaled training (models/common/fp8.py) on the CPU reference path: quantization bounds, the block matmul
and its gradients against float32, the scaled_mm operand layouts, apply_fp8 on tiny models, config and device checks.

Bounds (e4m3 has 3 mantissa bits: rounding to nearest is off by at most half an ulp, 2^-4 of the value; below
e4m3's smallest normal, 2^-6 in scaled units, the ulp is 2^-9, so the error is at most 2^-10 x the block scale):
- per element: |dequant(quant(x)) - x| <= 2^-4 |x| + 2^-10 scale, hence <= 2^-4 x the block's amax;
- per output of y = x w^T: |y_fp8 - y| <= sum_i e_x |w_hat| + |x| e_w (the two bounds above, summed over i), which
  for normal-range values is (2^-3 + 2^-8) (|x| |w|^T).
"""

import copy

import pytest
import torch
from torch import nn

from slipstream.config import TrainerConfig
from slipstream.models.common import fp8
from slipstream.models.common.fp8 import (
    BLOCK,
    FP8_MAX,
    Fp8GroupedExperts,
    Fp8Linear,
    apply_fp8,
    block_matmul_reference,
    check_fp8_support,
    cublas_padded_operands,
    dequantize_activation_tiles,
    dequantize_weight_blocks,
    fp8_block_matmul,
    fp8_expert_linear,
    fp8_linear,
    quantize_activation_tiles,
    quantize_weight_blocks,
    scaled_mm_operands,
)
from slipstream.models.registry import build_model
from slipstream.models.tiny import build_config

HALF_ULP = 2.0**-4
SUBNORMAL_HALF_ULP = 2.0**-10


def element_bound(x: torch.Tensor, scale_per_element: torch.Tensor) -> torch.Tensor:
    """The per-element error bound of the module docstring (plus float32 rounding of the scale arithmetic)."""
    return HALF_ULP * x.abs() * (1 + 1e-6) + SUBNORMAL_HALF_ULP * scale_per_element


def weight_scale_per_element(scale_BB: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return dequantize_weight_blocks(torch.ones(shape, dtype=torch.float8_e4m3fn), scale_BB)


def activation_scale_per_element(scale_NB: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return dequantize_activation_tiles(torch.ones(shape, dtype=torch.float8_e4m3fn), scale_NB)


def randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (7, 130), (3, 257, 129)])
def test_weight_round_trip_within_half_ulp(shape):
    w = randn(*shape, scale=0.05)
    q, scale = quantize_weight_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))
    error = (dequantize_weight_blocks(q, scale) - w).abs()
    assert (error <= element_bound(w, weight_scale_per_element(scale, w.shape))).all()
    # Each block's largest element maps onto 448 (the scale is amax / 448), so the whole e4m3 range is used.
    assert q.float().abs().max() == FP8_MAX
    # Quantization really happens: the mean relative error is far above float32's, near e4m3's.
    assert 2.0**-8 < (error / w.abs()).mean() < HALF_ULP


@pytest.mark.parametrize("shape", [(64, 384), (5, 200), (2, 3, 129)])
def test_activation_round_trip_within_half_ulp(shape):
    x = randn(*shape, seed=1)
    q, scale = quantize_activation_tiles(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.shape == (*shape[:-1], -(-shape[-1] // BLOCK))
    error = (dequantize_activation_tiles(q, scale) - x).abs()
    assert (error <= element_bound(x, activation_scale_per_element(scale, x.shape))).all()
    assert 2.0**-8 < (error / x.abs()).mean() < HALF_ULP


def test_blocks_scale_independently():
    """A block of huge values changes neither the scale nor the error of any other block; likewise for tiles."""
    w = randn(256, 256, scale=0.02)
    q, scale = quantize_weight_blocks(w)
    w_outlier = w.clone()
    w_outlier[:128, :128] *= 1e4
    q_outlier, scale_outlier = quantize_weight_blocks(w_outlier)
    assert scale_outlier[0, 0] == pytest.approx(scale[0, 0].item() * 1e4, rel=1e-5)
    others = torch.ones(256, 256, dtype=torch.bool)
    others[:128, :128] = False
    assert torch.equal(scale_outlier.flatten()[1:], scale.flatten()[1:])
    assert torch.equal(q_outlier.float()[others], q.float()[others])

    x = randn(4, 256, seed=2)
    x_outlier = x.clone()
    x_outlier[0, :128] *= 1e4
    (qx, sx), (qx_out, sx_out) = quantize_activation_tiles(x), quantize_activation_tiles(x_outlier)
    assert torch.equal(sx_out[1:], sx[1:]) and sx_out[0, 1] == sx[0, 1]
    assert torch.equal(qx_out.float()[1:], qx.float()[1:]) and torch.equal(qx_out.float()[0, 128:], qx.float()[0, 128:])


def test_zero_blocks_are_exact_and_finite():
    w = randn(256, 300)
    w[128:, :128] = 0.0
    q, scale = quantize_weight_blocks(w)
    assert scale[1, 0] == 1.0 and torch.isfinite(scale).all()
    assert (q.float()[128:, :128] == 0).all()
    x = torch.zeros(3, 300)
    qx, sx = quantize_activation_tiles(x)
    assert (sx == 1.0).all() and (dequantize_activation_tiles(qx, sx) == 0).all()
    assert (fp8_block_matmul(x, w) == 0).all()


def test_transposed_weight_blocks_are_the_transposed_quantization():
    """The backward's dgrad reuses the forward's weight blocks transposed: that must equal quantizing w^T."""
    w = randn(300, 200)
    q, scale = quantize_weight_blocks(w)
    q_t, scale_t = quantize_weight_blocks(w.t())
    assert torch.equal(q_t.float(), q.t().float()) and torch.equal(scale_t, scale.t())


def matmul_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-output bound of |fp8(x w^T) - x w^T|: sum_i e_x |w_hat| + |x| e_w, with float32 summation slack."""
    sx, (qw, sw) = quantize_activation_tiles(x)[1], quantize_weight_blocks(w)
    e_x = element_bound(x, activation_scale_per_element(sx, x.shape))
    e_w = element_bound(w, weight_scale_per_element(sw, w.shape))
    w_hat = dequantize_weight_blocks(qw, sw).abs()
    return e_x @ w_hat.T + x.abs() @ e_w.T + 1e-5 * (x.abs() @ w.abs().T)


@pytest.mark.parametrize(("n", "i", "o"), [(64, 384, 256), (33, 200, 300), (1, 128, 16)])
def test_fp8_matmul_against_float32_within_bound(n, i, o):
    x, w = randn(n, i, seed=3), randn(o, i, seed=4, scale=0.05)
    y, y_ref = fp8_block_matmul(x, w), x @ w.T
    assert y.dtype == torch.float32 and y.shape == (n, o)
    assert ((y - y_ref).abs() <= matmul_bound(x, w)).all()
    # Normal-range inputs: the bound is (2^-3 + 2^-8) |x| |w|^T; the typical error is far below it.
    assert ((y - y_ref).abs() <= (2.0**-3 + 2.0**-8) * (x.abs() @ w.abs().T) * 1.001 + 1e-6).all()
    relative = ((y - y_ref).norm() / y_ref.norm()).item()
    assert 2.0**-8 < relative < HALF_ULP
    # The matmul is exactly the float32 product of the dequantized operands (the reference path on CPU).
    torch.testing.assert_close(y, block_matmul_reference(*quantize_activation_tiles(x), *quantize_weight_blocks(w)))


def test_fp8_linear_gradients_against_float32():
    """grad_x comes from the FP8 dgrad (grad_y in tiles times the weight's blocks): bounded like the forward;
    grad_w is computed in the compute dtype (float32 here) from the saved input: equal to float32's."""
    x, w, grad_y = randn(40, 256, seed=5), randn(192, 256, seed=6, scale=0.05), randn(40, 192, seed=7)
    x_fp8, w_fp8 = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_linear(x_fp8, w_fp8).backward(grad_y)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    (x_ref @ w_ref.T).backward(grad_y)
    assert ((x_fp8.grad - x_ref.grad).abs() <= matmul_bound(grad_y, w.t())).all()
    torch.testing.assert_close(x_fp8.grad, fp8_block_matmul(grad_y, w.t()))  # exactly the FP8 dgrad recipe
    assert 2.0**-8 < ((x_fp8.grad - x_ref.grad).norm() / x_ref.grad.norm()).item() < HALF_ULP
    torch.testing.assert_close(w_fp8.grad, w_ref.grad, rtol=1e-5, atol=1e-6)


def test_fp8_linear_under_bf16_autocast_returns_bf16_and_float32_weight_grads():
    x, w = randn(2, 8, 256, seed=8), randn(128, 256, seed=9, scale=0.05).requires_grad_()
    bias = torch.zeros(128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8_linear(x, w, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 128)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32
    # The FP8 bound, plus the rounding of the float32 accumulation to bf16 (half an ulp of 8 bits: 2^-9).
    y_ref = (x @ w.T).detach().reshape(16, 128)
    bound = matmul_bound(x.reshape(16, 256), w.detach()) + 2.0**-9 * y_ref.abs()
    assert ((y.float().reshape(16, 128) - y_ref).abs() <= bound).all()


def test_expert_linear_matches_per_expert_matmuls_and_gradients():
    """Rows sorted by expert, one expert with no rows: forward equals fp8_block_matmul per expert; the weight
    gradient is exact per expert (zero for the empty one); the input gradient within the matmul bound."""
    counts = torch.tensor([5, 0, 9, 2])
    x, w = randn(16, 192, seed=10), randn(4, 144, 192, seed=11, scale=0.05)
    grad_y = randn(16, 144, seed=12)
    x_fp8, w_fp8 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_expert_linear(x_fp8, w_fp8, counts)
    expected = [fp8_block_matmul(x_e, w[e]) for e, x_e in enumerate(torch.split(x, counts.tolist()))]
    torch.testing.assert_close(y, torch.cat(expected))
    y.backward(grad_y)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    # float32 reference: the loop of GroupedExperts._loop
    torch.cat([x_e @ w_ref[e].T for e, x_e in enumerate(torch.split(x_ref, counts.tolist()))]).backward(grad_y)
    torch.testing.assert_close(w_fp8.grad, w_ref.grad, rtol=1e-5, atol=1e-6)
    assert (w_fp8.grad[1] == 0).all()
    start = 0
    for e, n in enumerate(counts.tolist()):
        rows = slice(start, start + n)
        bound = matmul_bound(grad_y[rows], w[e].t())
        assert ((x_fp8.grad[rows] - x_ref.grad[rows]).abs() <= bound).all()
        torch.testing.assert_close(x_fp8.grad[rows], fp8_block_matmul(grad_y[rows], w[e].t()))
        start += n


def test_scaled_mm_operands_have_the_layouts_torch_checks():
    """The CUDA path's operands, checked as torch's C++ `get_joint_scaling` does (row-major A, column-major B,
    1x128 scales outer-dim-major, 128x128 scales near-inner-dim-major) and through torch's own meta check of
    `_scaled_mm` on fake CUDA tensors (shapes only: it runs without a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    n, i, o = 48, 384, 272  # o is not a multiple of 128: ragged weight blocks
    (qx, sx), (qw, sw) = quantize_activation_tiles(randn(n, i)), quantize_weight_blocks(randn(o, i))
    mat_a, mat_b, scale_a, scale_b = scaled_mm_operands(qx, sx, qw, sw)
    assert mat_a.stride() == (i, 1) and mat_b.shape == (i, o) and mat_b.stride() == (1, i)
    assert scale_a.shape == (n, 3) and scale_a.stride() == (1, n)
    # torch checks scale_b.t() as the 128x128 scales of mat_b.t() = W: [ceil(O/128), ceil(I/128)], row-major.
    assert scale_b.t().shape == (3, 3) and scale_b.t().stride() == (3, 1)
    torch.testing.assert_close(scale_b.t(), sw)
    mode = FakeTensorMode()
    fakes = [FakeTensor(mode, t.to("meta"), torch.device("cuda", 0)) for t in (mat_a, mat_b, scale_a, scale_b)]
    with mode:
        y = torch._scaled_mm(fakes[0], fakes[1], scale_a=fakes[2], scale_b=fakes[3], out_dtype=torch.bfloat16)
    assert y.shape == (n, o) and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiples of 16"):
        scaled_mm_operands(*quantize_activation_tiles(randn(4, 200)), *quantize_weight_blocks(randn(32, 200)))


@pytest.mark.parametrize(
    ("n", "i", "padded_shape"), [(17, 768, (32, 1024)), (32, 2048, (32, 2048)), (5, 200, (16, 512))]
)
def test_cublas_padding_leaves_the_product_unchanged(n, i, padded_shape):
    """Rows padded to a multiple of 16 and the reduction dim to a multiple of 4 blocks (what cuBLASLt computes
    right, measured on an H100): the reference product of the padded operands, cut to n rows, is the same up to
    float32 summation order."""
    (qx, sx), (qw, sw) = quantize_activation_tiles(randn(n, i)), quantize_weight_blocks(randn(272, i))
    pqx, psx, pqw, psw = cublas_padded_operands(qx, sx, qw, sw)
    assert pqx.shape == padded_shape and pqx.dtype == qx.dtype and pqw.shape == (272, padded_shape[1])
    assert psx.shape == (padded_shape[0], padded_shape[1] // 128) and psw.shape == (3, padded_shape[1] // 128)
    padded, plain = block_matmul_reference(pqx, psx, pqw, psw)[:n], block_matmul_reference(qx, sx, qw, sw)
    # float32 summation order moves a sum by a few ulps of its largest terms, not of each (possibly tiny) result
    torch.testing.assert_close(padded, plain, rtol=0, atol=4e-6 * plain.abs().max().item())


def tiny_model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return build_model(build_config(family, vocab_size=512, eos_token_id=2, pad_token_id=0), "custom").float()


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(40).repeat(2, 1)
    position_ids[1, 20:] = torch.arange(20)  # two samples packed in row 1
    return input_ids, position_ids


@pytest.mark.parametrize(("family", "num_linear", "num_experts"), [("qwen3", 14, 0), ("qwen3_moe", 8, 2)])
def test_apply_fp8_keeps_keys_and_stays_close_to_float32(family, num_linear, num_experts):
    """Measured on these seeds: logits relative error ~0.12 and mean KL ~0.009 nats (2 random layers, std 0.1
    init); the bounds leave ~2x margin and the lower bound shows the FP8 layers really run."""
    model = tiny_model(family)
    fp8_model = copy.deepcopy(model)
    assert apply_fp8(fp8_model, "cpu") == {"linear": num_linear, "experts": num_experts}
    state, fp8_state = model.state_dict(), fp8_model.state_dict()
    assert list(fp8_state) == list(state) and all(torch.equal(state[k], fp8_state[k]) for k in state)
    assert type(fp8_model.lm_head) is nn.Linear and type(fp8_model.layers[0].attn.q_proj) is Fp8Linear
    if num_experts:
        assert type(fp8_model.layers[0].mlp.experts) is Fp8GroupedExperts
        assert type(fp8_model.layers[0].mlp.router) is type(model.layers[0].mlp.router)
    else:
        assert type(fp8_model.layers[0].mlp.down_proj) is Fp8Linear
    input_ids, position_ids = packed_batch()
    logits, fp8_logits = model(input_ids, position_ids), fp8_model(input_ids, position_ids)
    relative = ((fp8_logits - logits).norm() / logits.norm()).item()
    logp, fp8_logp = logits.log_softmax(-1), fp8_logits.log_softmax(-1)
    kl = (logp.exp() * (logp - fp8_logp)).sum(-1).mean().item()
    assert 0.01 < relative < 0.25 and kl < 0.02
    fp8_logits.logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp8_model.parameters())


def test_apply_fp8_rejects_transformers_models_and_unsupported_devices():
    hf_model = build_model(build_config("qwen3", vocab_size=512, eos_token_id=2, pad_token_id=0), "hf")
    with pytest.raises(ValueError, match="model_impl = 'custom'"):
        apply_fp8(hf_model, "cpu")
    with pytest.raises(RuntimeError, match="not on meta"):
        apply_fp8(tiny_model("qwen3"), "meta")


@pytest.mark.parametrize(
    ("capability", "cuda", "error"),
    [((8, 0), "12.9", "needs an SM90 GPU"), ((10, 0), "13.0", "needs an SM90 GPU"), ((9, 0), "12.8", "CUDA >= 12.9")],
)
def test_unsupported_gpus_raise_instead_of_falling_back(monkeypatch, capability, cuda, error):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "some GPU")
    monkeypatch.setattr(torch.version, "cuda", cuda)
    fp8._cuda_support_error.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=error):
            check_fp8_support(torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
        monkeypatch.setattr(torch.version, "cuda", "12.9")
        fp8._cuda_support_error.cache_clear()
        check_fp8_support(torch.device("cuda", 0))  # an H100 with a cu129 build passes
    finally:
        fp8._cuda_support_error.cache_clear()


def test_config_fp8_needs_our_model_implementation():
    base = dict(model={"name": "m"}, output_dir="out", max_steps=1)
    assert TrainerConfig(**base, fp8=True).fp8
    assert TrainerConfig(**base, fp8=True, model_impl="custom").fp8
    with pytest.raises(ValueError, match=r"trainer\.fp8 = true needs trainer\.model_impl 'custom'"):
        TrainerConfig(**base, fp8=True, model_impl="hf")


def test_trainer_setup_applies_fp8_and_steps_on_cpu(tiny_model_factory, tmp_path):
    """trainer.fp8 on CPU: setup swaps the FP8 layers in (reference path) and a train step updates every weight."""
    from slipstream.config.shared import ModelConfig
    from slipstream.trainer.setup import setup_trainer
    from slipstream.trainer.step import train_step
    from slipstream.transport.rollouts import MicroBatch, TrainingBatch

    config = TrainerConfig(
        model=ModelConfig(name=str(tiny_model_factory("qwen3_moe"))),
        output_dir=tmp_path,
        max_steps=1,
        device="cpu",
        fp8=True,
    )
    trainer = setup_trainer(config)
    assert type(trainer.model.layers[1].attn.o_proj) is Fp8Linear
    assert type(trainer.model.layers[1].mlp.experts) is Fp8GroupedExperts
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    num_tokens = 24
    micro_batch = MicroBatch(
        input_ids=torch.randint(3, 512, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist(),
        position_ids=list(range(12)) * 2,
        loss_mask=([False] * 4 + [True] * 8) * 2,
        advantages=([0.0] * 4 + [1.0] * 8) + ([0.0] * 4 + [-1.0] * 8),
        inference_logprobs=([0.0] * 4 + [-6.0] * 8) * 2,
        temperatures=[1.0] * num_tokens,
    )
    batch = TrainingBatch(step=1, rank=0, num_loss_tokens=16, micro_batches=[micro_batch])
    metrics = train_step(trainer.policy, trainer.optimizer, batch, config.loss, 1.0, trainer.device)
    assert metrics["grad_norm"] > 0
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "layers.0.attn.q_proj.weight" in changed and "layers.0.mlp.experts.gate_proj" in changed


def test_expert_weight_grads_in_bf16_are_one_grouped_gemm_equal_to_the_loop():
    """The FP8 experts' weight gradients in bf16 (the autocast path) come from one grouped GEMM; they equal the
    per-expert matmuls up to bf16 rounding, and an expert without rows gets exact zeros."""
    from slipstream.models.common.fp8 import _expert_weight_grads

    x, grad_y, counts = randn(40, 256, seed=20).bfloat16(), randn(40, 128, seed=21).bfloat16(), [7, 0, 21, 12]
    got = _expert_weight_grads(x, grad_y, counts)
    assert got.shape == (4, 128, 256) and got.dtype == torch.bfloat16 and (got[1] == 0).all()
    want = [g.float().t() @ xe.float() for g, xe in zip(grad_y.split(counts), x.split(counts), strict=True)]
    torch.testing.assert_close(got.float(), torch.stack(want), rtol=2e-2, atol=2e-2)


def test_expert_gemms_on_padded_layout_equal_the_unpadded_ones():
    """The experts' operands are laid out once for cuBLASLt (rows of each expert padded to 16 by one scatter, a
    768-wide reduction padded to 4 blocks); each expert's rows come back equal to its GEMM on the unpadded
    operands (float32 reference, up to the order of its sums), empty experts included."""
    from slipstream.models.common.fp8 import _per_expert

    counts = [0, 5, 17, 32, 0, 3]
    (qx, sx), (qw, sw) = (
        quantize_activation_tiles(randn(57, 768, seed=30)),
        quantize_weight_blocks(randn(6, 256, 768, scale=0.05)),
    )
    y = _per_expert(qx, sx, counts, qw, sw, torch.float32)
    pieces = zip(qx.split(counts), sx.split(counts), strict=True)
    want = torch.cat([block_matmul_reference(q, s, qw[e], sw[e]) for e, (q, s) in enumerate(pieces)])
    torch.testing.assert_close(y, want)
