"""benchmarks/trainer_throughput.py runs on CPU with the tiny models and ends with its summary line; the FLOPs
accounting matches the published figure for Qwen3-0.6B and counts Qwen3.5-MoE's layer types; the GPU cut shapes (glm5-cut,
qwen3.5-moe-cut) build for both implementations on the meta device."""

import json
import re

import pytest

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("trainer_throughput")


@pytest.fixture(scope="module")
def shapes():
    return load_benchmark("throughput_shapes")


def test_runs_tiny_on_cpu_and_compares_with_hf(bench, capsys):
    argv = ["--model", "tiny", "--device", "cpu", "--seq-len", "64", "--num-samples", "2"]
    bench.main([*argv, "--steps", "1", "--warmup", "0", "--compare-hf"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"tokens_per_s: \d+\.\d mfu: n/a vs_hf: \d+\.\d{3}", lines[-1]), lines[-1]
    custom, hf = (line for line in lines if "tokens/s" in line)
    assert custom.lstrip().startswith("custom:") and hf.lstrip().startswith("hf:")
    loss = [re.search(r"loss (-?\d+\.\d+)", line).group(1) for line in (custom, hf)]
    assert loss[0] == loss[1]  # same random weights in both implementations


def test_qwen3_0_6b_flops_per_token(bench, shapes):
    cfg = bench.build_hf_config("qwen3-0.6b")
    # 28 layers x (attention 1024 x (2 x 2048 + 2 x 1024) + MLP 3 x 1024 x 3072) + LM head 151936 x 1024
    assert shapes.active_matmul_params(cfg) == 28 * (1024 * 6144 + 3 * 1024 * 3072) + 151936 * 1024
    attention = 12 * 28 * 16 * 128 * 16384
    assert shapes.flops_per_token(cfg, 16384) == 6 * shapes.active_matmul_params(cfg) + attention
    batch, context = bench.fake_batch(1000, 3, vocab_size=512)
    assert context == pytest.approx((333**2 + 333**2 + 334**2) / 1000)
    assert len(batch.micro_batches[0].input_ids) == 1000 and batch.num_loss_tokens == 1000 - 3 * 66


def test_runs_tiny_qwen35_moe_on_cpu_for_both_impls(bench, capsys):
    """Qwen3.5-MoE's pattern (3 Gated DeltaNet layers, then gated full attention) at tiny dims, both impls in this
    process (no --compare-hf subprocess: a few seconds); transformers falls back to its torch delta rule and conv."""
    assert bench.build_hf_config("tiny-qwen3.5-moe").layer_types == ["linear_attention"] * 3 + ["full_attention"]
    argv = ["--model", "tiny-qwen3.5-moe", "--device", "cpu", "--seq-len", "128", "--steps", "1", "--warmup", "0"]
    losses = {}
    for impl in ("custom", "hf"):
        bench.main([*argv, "--impl", impl])
        lines = capsys.readouterr().out.strip().splitlines()
        assert re.fullmatch(r"tokens_per_s: \d+\.\d mfu: n/a", lines[-1]), lines[-1]
        (report,) = (line for line in lines if "tokens/s" in line)
        assert report.lstrip().startswith(f"{impl}:")
        losses[impl] = float(re.search(r"loss (-?\d+\.\d+)", report).group(1))
    assert losses["custom"] == pytest.approx(losses["hf"], abs=2e-4)  # same random weights in both implementations


def _meta_params(model) -> dict[str, tuple[int, ...]]:
    assert all(p.is_meta for p in model.parameters())
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["glm5-cut", "qwen3.5-moe-cut"])
def test_cut_shapes_build_for_both_impls_on_meta(bench, name):
    """The GPU shapes build as transformers' model (the --impl hf path) and ours on the meta device, and our weights
    map onto transformers' one to one, as build_random_model loads them: no config error waits on the GPU."""
    import torch

    from slipstream.models.registry import build_model, export_hf_state_dict

    cfg = bench.build_hf_config(name)
    with torch.device("meta"):
        hf = bench.build_hf_model(cfg)
        ours = build_model(cfg, "custom")
    hf_shapes = _meta_params(hf)
    _meta_params(ours)
    exported = {k: tuple(v.shape) for k, v in bench.fuse_experts(export_hf_state_dict(ours), hf).items()}
    assert exported == hf_shapes
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters())


def test_qwen35_moe_cut_shape_memory_and_flops(bench, shapes):
    """qwen3.5-moe-cut: Qwen3.5-35B-A3B's dims, 4 layers in its 3:1 pattern, 64 experts; 16 bytes a parameter
    (float32 master, gradient, two AdamW moments) well under an 80 GB GPU; FLOPs counted layer type by layer type."""
    import torch

    from slipstream.models.registry import build_model

    cfg = bench.build_hf_config("qwen3.5-moe-cut")
    assert cfg.model_type == "qwen3_5_moe_text"
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        2048, 248320, 16, 2, 256,
    )  # fmt: skip
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 32, 128)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (64, 8, 512)
    assert cfg.shared_expert_intermediate_size == 512 and cfg.rope_parameters["partial_rotary_factor"] == 0.25
    with torch.device("meta"):
        num_params = sum(p.numel() for p in build_model(cfg, "custom").parameters())
    assert num_params == 1_963_977_792
    assert num_params * 16 < 35e9  # 31.4 GB of masters, gradients and moments: room for 16384 tokens' activations

    D = 2048
    deltanet = D * (2 * 16 * 128 + 32 * 128) + D * 32 * 128 + 2 * D * 32 + 32 * 128 * D  # qkv, z, b + a, out
    gated_attention = D * 2 * 16 * 256 + 2 * D * 2 * 256 + 16 * 256 * D  # q (+ gate), k, v, o
    moe = 3 * D * (8 * 512 + 512) + D * 64 + D  # top-8 + shared experts, router, shared expert gate
    active = 3 * deltanet + gated_attention + 4 * moe + 248320 * D
    assert shapes.active_matmul_params(cfg) == active == 750_657_536
    delta_rule = 3 * 2 * 32 * (64 * 4 * 128 + 3 * 128 * 128)  # chunks of 64: C (2.5 K + 1.5 V) + 3 K V MACs
    assert shapes.gated_delta_rule_flops(cfg) == delta_rule
    full_attention = 12 * 1 * 16 * 256 * 16384
    assert shapes.flops_per_token(cfg, 16384) == 6 * active + full_attention + 3 * delta_rule


def test_trace_gaps_finds_the_gpu_idle_time_and_what_the_host_ran(tmp_path, capsys, monkeypatch):
    """benchmarks/trace_gaps.py on a hand-made trace: overlapping kernels count once, the gap between them is
    reported with the host frame that ran across it."""
    gaps = load_benchmark("trace_gaps")
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 50, "dur": 100},  # overlaps a: busy 0..150
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 1150, "dur": 50},  # a 1000 us gap before it
        {
            "ph": "X",
            "cat": "python_function",
            "name": "slipstream/trainer/data.py(1): to_packed",
            "ts": 140,
            "dur": 990,
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::index", "ts": 600, "dur": 20},  # too short to explain the gap
    ]
    span, busy, found = gaps.busy_and_gaps([e for e in events if e["cat"] != "python_function"][:3])
    assert (span, busy, found) == (1200, 200, [(1000, 150, 1150)])
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    monkeypatch.setattr("sys.argv", ["trace_gaps.py", str(path)])
    gaps.main()
    out = capsys.readouterr().out
    assert "busy 0.2 ms, idle 1.0 ms in 1 gaps" in out
    assert "gap   1.00 ms at +    0.1 ms" in out and "to_packed (0.99 ms)" in out and "aten::index" not in out


def test_varied_lengths_pack_a_new_rl_like_micro_batch_every_step(bench, capsys):
    """--vary-lengths: each step's micro-batch packs --num-samples samples of other lengths, filling 3/4 to all of
    --seq-len, and tokens/s counts the tokens of the measured steps."""
    packings = [bench.varied_lengths(2048, 8, seed) for seed in range(6)]
    assert len({tuple(p) for p in packings}) == 6  # a new packing every step
    for lengths in packings:
        assert len(lengths) == 8 and min(lengths) >= 2048 * 0.75 / 8 * 0.25 / 1.25 - 1
        assert 0.75 * 2048 - 1 <= sum(lengths) <= 2048
        batch, context = bench.fake_batch(0, 0, 512, lengths=lengths)
        (mb,) = batch.micro_batches
        assert len(mb.input_ids) == sum(lengths) and context == pytest.approx(
            sum(n * n for n in lengths) / sum(lengths)
        )
        starts = [i for i, p in enumerate(mb.position_ids) if p == 0]
        assert [b - a for a, b in zip(starts, [*starts[1:], len(mb.position_ids)], strict=True)] == lengths
    argv = ["--model", "tiny", "--device", "cpu", "--seq-len", "96", "--num-samples", "3", "--steps", "2"]
    bench.main([*argv, "--warmup", "1", "--vary-lengths"])
    assert re.fullmatch(r"tokens_per_s: \d+\.\d mfu: n/a", capsys.readouterr().out.strip().splitlines()[-1])
    with pytest.raises(SystemExit):
        bench.main([*argv, "--vary-lengths", "--compare-hf"])


def test_packed_moe_anchor_takes_one_row_per_sample(bench, monkeypatch, tmp_path):
    """With --num-samples > 1 the shared anchor (one sequence) is refused; benchmarks/moe_anchor_rows.py gets the
    sample count as its ROWS argument and its tokens/s is parsed from its report line."""
    import subprocess
    from pathlib import Path

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    shared = tmp_path / "hf_moe_baseline.py"
    shared.write_text("")
    argv = ["--model", "qwen3-30b-a3b-4l", "--seq-len", "16384", "--num-samples", "8"]
    with pytest.raises(SystemExit):
        bench.parse_args([*argv, "--compare-anchor", str(shared)])
    rows_script = Path(bench.__file__).parent / "moe_anchor_rows.py"
    args = bench.parse_args([*argv, "--compare-anchor", str(rows_script)])
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, stdout="H100 moe rows=8 step=0.3s tokens_per_s=55864 mfu=20%\n")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    tokens_per_s, line = bench.run_anchor_in_subprocess(args)
    assert seen["cmd"][1:] == [str(rows_script), "16384", "4", "grouped_mm", "8"]
    assert tokens_per_s == 55864.0 and "rows=8" in line
