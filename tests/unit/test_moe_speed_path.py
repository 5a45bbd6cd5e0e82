"""The MoE trainer's speed path on CPU: grouped GEMMs by default and equal to the expert loop, expert matmuls in the
autocast dtype (float32 masters keep float32 gradients), no graph break in the routed-experts path under
torch.compile, the optimizer options (bf16 AdamW moments, CPU offload's errors) and the benchmark's MoE shapes."""

import re

import pytest
import torch
import torch._dynamo

from slipstream.config.trainer import OptimConfig, TrainerConfig
from slipstream.models.common.moe import GroupedExperts, MoE, count_per_expert, sort_by_expert
from slipstream.models.registry import load_pretrained
from slipstream.parallel.dist import RankInfo
from slipstream.trainer.ckpt import CheckpointMeta, load_checkpoint, save_checkpoint
from slipstream.trainer.optim import AdamWBf16Moments, stochastic_round_to_bf16_
from slipstream.trainer.policy import Policy
from slipstream.trainer.setup import build_optimizer
from tests.benchmark_scripts import load_benchmark

ONE_RANK = RankInfo(rank=0, world_size=1, local_rank=0)
NUM_EXPERTS, DIM, HIDDEN, TOP_K = 8, 32, 24, 2


def _experts(seed: int = 0) -> GroupedExperts:
    torch.manual_seed(seed)
    experts = GroupedExperts(DIM, HIDDEN, NUM_EXPERTS)
    experts.init_weights(0.1)
    return experts


def _routed(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x_ND and expert ids with experts 0 and 5 never chosen (empty groups)."""
    g = torch.Generator().manual_seed(seed)
    x_ND = torch.randn(num_tokens, DIM, generator=g)
    choices = torch.tensor([1, 2, 3, 4, 6, 7])
    ids_NA = torch.stack([torch.randperm(6, generator=g)[:TOP_K] for _ in range(num_tokens)])
    return x_ND, choices[ids_NA]


def _moe_like(experts: GroupedExperts, x_ND: torch.Tensor, ids_NA: torch.Tensor) -> torch.Tensor:
    """What MoE.forward does around the experts (sort, gather, experts, weight, scatter back), with fixed weights."""
    order_M, token_M, counts_E = sort_by_expert(ids_NA, NUM_EXPERTS)
    y_MD = experts(x_ND[token_M], counts_E)
    weights_M = torch.linspace(0.5, 1.5, y_MD.shape[0])[order_M, None]
    return torch.zeros_like(x_ND).index_add_(0, token_M, (y_MD * weights_M.to(y_MD.dtype)).to(x_ND.dtype))


def _run(use_grouped_mm: bool, autocast: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    experts = _experts()
    experts.use_grouped_mm = use_grouped_mm
    x_ND, ids_NA = _routed(40, seed=1)
    x_ND.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y_ND = _moe_like(experts, x_ND, ids_NA)
    (y_ND * torch.linspace(-1, 1, DIM)).sum().backward()
    return y_ND.detach(), {n: p.grad for n, p in experts.named_parameters()}, x_ND.grad


def test_grouped_mm_is_the_default():
    assert GroupedExperts(DIM, HIDDEN, NUM_EXPERTS).use_grouped_mm


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16_autocast"])
def test_grouped_mm_matches_expert_loop(autocast):
    """Same outputs and gradients (empty experts included); under bf16 autocast within bf16 rounding."""
    (y_loop, grads_loop, gx_loop), (y_gmm, grads_gmm, gx_gmm) = _run(False, autocast), _run(True, autocast)
    tol = dict(atol=2e-2, rtol=2e-2) if autocast else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_gmm, y_loop, **tol)
    torch.testing.assert_close(gx_gmm, gx_loop, **tol)
    for name, grad in grads_loop.items():
        assert grads_gmm[name].dtype == torch.float32
        torch.testing.assert_close(grads_gmm[name], grad, **tol)
        assert grads_gmm[name][[0, 5]].abs().sum() == 0  # empty experts: a zero gradient, present


def _record_grouped_mm_dtypes(monkeypatch) -> list[tuple[torch.dtype, torch.dtype]]:
    seen = []
    real = torch._grouped_mm

    def recording(mat_a, mat_b, *args, **kwargs):
        seen.append((mat_a.dtype, mat_b.dtype))
        return real(mat_a, mat_b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    return seen


def test_grouped_mm_runs_in_autocast_dtype_and_float32_masters_get_gradients(monkeypatch):
    seen = _record_grouped_mm_dtypes(monkeypatch)
    y_ND, grads, _ = _run(True, autocast=True)
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 3
    assert y_ND.dtype == torch.float32  # the residual stream keeps its dtype
    assert all(g.dtype == torch.float32 and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())
    seen.clear()
    _run(True, autocast=False)
    assert seen == [(torch.float32, torch.float32)] * 3


def test_bf16_weights_without_autocast_are_not_cast_again(monkeypatch):
    """FSDP with param_dtype bf16 hands the experts bf16 weights and bf16 rows, without autocast: used as they are."""
    seen = _record_grouped_mm_dtypes(monkeypatch)
    experts = _experts().to(torch.bfloat16)
    x_ND, ids_NA = _routed(16, seed=2)
    order_M, token_M, counts_E = sort_by_expert(ids_NA, NUM_EXPERTS)
    assert experts(x_ND[token_M].bfloat16(), counts_E).dtype == torch.bfloat16
    assert seen == [(torch.bfloat16, torch.bfloat16)] * 3


def test_count_per_expert_equals_bincount():
    ids_NA = torch.randint(0, NUM_EXPERTS, (50, TOP_K))
    counts_E = count_per_expert(ids_NA, NUM_EXPERTS)
    assert counts_E.dtype == torch.int64
    assert torch.equal(counts_E, torch.bincount(ids_NA.reshape(-1), minlength=NUM_EXPERTS))


def test_routed_experts_compile_without_graph_break():
    """sort_by_expert + the grouped experts under bf16 autocast (the trainer's mixed precision): no graph break, and
    one fullgraph compilation with dynamic shapes serves other token counts, backward included. torch.compile traces
    torch._grouped_mm only in bf16 (its meta kernel), which the autocast cast provides. aot_eager rather than
    Inductor: it traces forward and backward the same way in a second (Inductor on CPU passes too, in ~7 s)."""
    experts = _experts()

    def routed(x_ND, ids_NA):
        order_M, token_M, counts_E = sort_by_expert(ids_NA, NUM_EXPERTS)
        return experts(x_ND[token_M], counts_E)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        x_ND, ids_NA = _routed(40, seed=3)
        assert torch._dynamo.explain(routed)(x_ND, ids_NA).break_reasons == []
        compiled = torch.compile(routed, fullgraph=True, backend="aot_eager", dynamic=True)
        for num_tokens in (40, 29):
            x_ND, ids_NA = _routed(num_tokens, seed=num_tokens)
            x_ND.requires_grad_()
            y_MD = compiled(x_ND, ids_NA)
            torch.testing.assert_close(y_MD, routed(x_ND, ids_NA), atol=1e-2, rtol=1e-2)
            y_MD.float().backward(torch.randn(y_MD.shape))
    assert experts.gate_proj.grad.dtype == torch.float32 and x_ND.grad.shape == x_ND.shape


def test_moe_model_defaults_to_grouped_mm(tiny_model_factory):
    model = load_pretrained(tiny_model_factory("qwen3_moe"), impl="custom")
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.use_grouped_mm for m in experts)


# --- optimizer options -------------------------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    torch.manual_seed(0)
    x = torch.full((200_000,), 1.0 + 2**-9)  # a quarter of the way from bf16's 1.0 to the next, 1.0 + 2**-7
    out = stochastic_round_to_bf16_(torch.empty_like(x, dtype=torch.bfloat16), x)
    assert set(out.float().unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert out.float().mean().item() == pytest.approx(x[0].item(), abs=2e-5)
    y = -torch.rand(1000) * 1e3
    rounded = stochastic_round_to_bf16_(torch.empty_like(y, dtype=torch.bfloat16), y).float()
    assert ((rounded - y).abs() <= y.abs() * 2**-7).all() and (rounded <= 0).all()


def _tiny_policy(model_dir) -> Policy:
    torch.manual_seed(0)
    return Policy(load_pretrained(model_dir, impl="custom"))


def _steps(policy: Policy, optimizer: torch.optim.Optimizer, seeds) -> None:
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        ids_T, pos_T = torch.randint(3, 500, (12,), generator=g), torch.arange(12)
        logprobs_T, _ = policy(ids_T, pos_T, torch.ones(12))
        (logprobs_T * torch.randn(12, generator=g)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_bf16_moments_track_float32_adamw(tiny_qwen3_dir):
    """Over 6 steps of lr 1e-3 the bf16-moment updates stay within 1% (relative, whole model; 0.2% measured) of
    torch's AdamW's; the moments are stored in bf16 while the weights stay float32."""
    reference, bf16 = _tiny_policy(tiny_qwen3_dir), _tiny_policy(tiny_qwen3_dir)
    start = {k: v.clone() for k, v in reference.state_dict().items()}
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    optimizers = torch.optim.AdamW(reference.parameters(), **hyper), AdamWBf16Moments(bf16.parameters(), **hyper)
    torch.manual_seed(1)
    for policy, optimizer in zip((reference, bf16), optimizers, strict=True):
        _steps(policy, optimizer, seeds=range(6))
    ref_delta = torch.cat([(v - start[k]).flatten() for k, v in reference.state_dict().items()])
    bf16_delta = torch.cat([(v - start[k]).flatten() for k, v in bf16.state_dict().items()])
    assert (bf16_delta - ref_delta).norm() / ref_delta.norm() < 0.01
    states = list(optimizers[1].state.values())
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.bfloat16 for s in states)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())


def test_bf16_moments_survive_a_checkpoint_round_trip(tiny_qwen3_dir, tmp_path):
    policy = _tiny_policy(tiny_qwen3_dir)
    optimizer = AdamWBf16Moments(policy.parameters(), lr=1e-2)
    _steps(policy, optimizer, seeds=[0])
    meta = CheckpointMeta(step=1, model_type="qwen3", impl="custom")
    save_checkpoint(policy, optimizer, tmp_path, meta, ONE_RANK)
    fresh = _tiny_policy(tiny_qwen3_dir)
    fresh_optimizer = AdamWBf16Moments(fresh.parameters(), lr=1e-2)
    load_checkpoint(fresh, fresh_optimizer, tmp_path, meta, ONE_RANK)
    for state, loaded in zip(optimizer.state.values(), fresh_optimizer.state.values(), strict=True):
        assert loaded["exp_avg"].dtype == loaded["exp_avg_sq"].dtype == torch.bfloat16
        assert all(torch.equal(state[k], loaded[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    torch.manual_seed(5)  # the stochastic rounding draws from the default generator: same draws for both
    _steps(policy, optimizer, seeds=[1])
    torch.manual_seed(5)
    _steps(fresh, fresh_optimizer, seeds=[1])
    for (name, p), q in zip(policy.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def _trainer_config(tmp_path, **optim) -> TrainerConfig:
    return TrainerConfig(model={"name": "tiny"}, output_dir=tmp_path, max_steps=1, optim=OptimConfig(**optim))


def test_build_optimizer_picks_the_state_dtype(tmp_path):
    model = torch.nn.Linear(4, 4)
    cpu = torch.device("cpu")
    assert type(build_optimizer(model, _trainer_config(tmp_path), cpu)) is torch.optim.AdamW
    bf16 = build_optimizer(model, _trainer_config(tmp_path, state_dtype="bfloat16", lr=0.5, betas=(0.8, 0.9)), cpu)
    assert isinstance(bf16, AdamWBf16Moments) and bf16.defaults["lr"] == 0.5 and bf16.defaults["betas"] == (0.8, 0.9)


def test_cpu_offload_needs_fsdp_on_gpus(tmp_path):
    with pytest.raises(ValueError, match="cpu_offload .* needs trainer.device 'cuda' and several ranks"):
        build_optimizer(torch.nn.Linear(4, 4), _trainer_config(tmp_path, cpu_offload=True), torch.device("cpu"))


def test_optimizer_options_round_trip_in_config():
    config = OptimConfig(state_dtype="bfloat16", cpu_offload=True)
    assert OptimConfig.model_validate(config.to_toml_dict()) == config
    with pytest.raises(ValueError):
        OptimConfig(state_dtype="float16")


def test_moe_layer_compiles_without_graph_break():
    moe = MoE(DIM, HIDDEN, NUM_EXPERTS, TOP_K, norm_topk_prob=True)
    moe.init_weights(0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(moe)(torch.randn(2, 10, DIM))
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]


# --- benchmarks/trainer_throughput.py's MoE shapes ---------------------------------------------------------------


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("trainer_throughput")


@pytest.fixture(scope="module")
def shapes():
    return load_benchmark("throughput_shapes")


def test_benchmark_runs_tiny_moe_against_transformers(bench, capsys):
    """Same random weights in both (ours exported, stacked into transformers' fused experts): same loss."""
    argv = ["--model", "tiny-moe", "--device", "cpu", "--seq-len", "64", "--num-samples", "2", "--steps", "1"]
    bench.main([*argv, "--warmup", "0", "--compare-hf", "--state-dtype", "bfloat16"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert "experts grouped_mm | AdamW moments bfloat16" in lines[0]
    assert re.fullmatch(r"tokens_per_s: \d+\.\d mfu: n/a vs_hf: \d+\.\d{3}", lines[-1]), lines[-1]
    losses = {line.split(":")[0].strip(): line.split("loss ")[1] for line in lines if "| loss " in line}
    assert losses["custom"] == losses["hf"]


def test_benchmark_moe_flops_match_the_anchor(bench, shapes):
    """Active parameters of the Qwen3-30B-A3B cuts as the plain-transformers MoE anchor counts them."""
    h, q, kv, hd, inter, k = 2048, 32, 4, 128, 768, 8
    for name, layers in (("qwen3-30b-a3b-4l", 4), ("qwen3-30b-a3b-8l", 8)):
        anchor = layers * (h * q * hd + 2 * h * kv * hd + q * hd * h + k * 3 * h * inter + h * 128) + 151936 * h
        assert shapes.active_matmul_params(shapes.build_hf_config(name)) == anchor
    with pytest.raises(SystemExit):
        bench.parse_args(["--model", "qwen3-30b-a3b-4l", "--device", "cpu", "--compare-anchor", __file__])


def test_dispatch_and_unsort_rows_backward_gathers_what_indexing_scatters():
    """MoE's row movement (dispatch by token, unsort back to (token, slot) order) has hand-written backwards that
    gather instead of scatter-adding: the same gradients as plain indexing's autograd, and bit-identical from one
    run to the next."""
    from slipstream.models.common.moe import dispatch_rows, inverse_permutation, permute_rows, unsort_rows

    _, ids_NA = _routed(37, seed=5)
    order_M, token_M, _ = sort_by_expert(ids_NA, NUM_EXPERTS)
    inverse_M = inverse_permutation(order_M)
    assert torch.equal(order_M[inverse_M], torch.arange(order_M.numel()))
    g = torch.Generator().manual_seed(0)
    x_ND = torch.randn(37, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    upstream_MD = torch.randn(order_M.numel(), DIM, generator=g, dtype=torch.float64)

    def moved(fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x_ND.grad = None
        rows_MD = dispatch_rows(x_ND, token_M, inverse_M) if fast else x_ND[token_M]
        y_MD = rows_MD * upstream_MD
        y_PD = unsort_rows(y_MD, inverse_M, order_M) if fast else y_MD[inverse_M]
        y_PD.pow(2).sum().backward()
        return y_PD.detach(), x_ND.grad.clone()

    (y_fast, grad_fast), (y_plain, grad_plain) = moved(True), moved(False)
    assert torch.equal(y_fast, y_plain)
    torch.testing.assert_close(grad_fast, grad_plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(moved(True)[1], grad_fast)
    assert torch.autograd.gradcheck(lambda x: dispatch_rows(x, token_M, inverse_M), (x_ND,))
    # the general permutation (what expert parallelism's expert-major reorder uses), both ways round
    rows_MD = upstream_MD.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y: permute_rows(y, order_M, inverse_M), (rows_MD,))
    assert torch.autograd.gradcheck(lambda y: permute_rows(y, inverse_M, order_M), (rows_MD,))


def test_compiled_bf16_moment_update_matches_eager():
    """The GPU path compiles the chunk update (one fused kernel): on the CPU the compiled function gives the eager
    one's weights (the update reads the float32 moments before rounding) and moments within one bf16 step of them
    (the stochastic rounding draws different random bits), for two different step scalars without recompiling."""
    from slipstream.trainer.optim import _chunk_update

    compiled = torch.compile(_chunk_update, dynamic=True)
    g = torch.Generator().manual_seed(0)
    p, grad = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    m, v = torch.randn(1000, generator=g).bfloat16(), torch.rand(1000, generator=g).bfloat16()
    for step in (1, 2):
        scalars = torch.tensor([1 - 1e-3 * 0.01, 0.9, 0.999, 1 - 0.999**step, 1e-8, 1e-3 / (1 - 0.9**step)])
        eager_state = [t.clone() for t in (p, grad, m, v)]
        _chunk_update(*eager_state, scalars)
        compiled(p, grad, m, v, scalars)
        torch.testing.assert_close(p, eager_state[0], rtol=1e-6, atol=1e-7)
        for got, want in ((m, eager_state[2]), (v, eager_state[3])):
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
