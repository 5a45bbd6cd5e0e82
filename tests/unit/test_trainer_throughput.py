"""benchmarks/trainer_throughput.py runs on CPU with the tiny model and ends with its summary line; the FLOPs
accounting matches REFERENCE.md for Qwen3-0.6B."""

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trainer_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_tiny_on_cpu_and_compares_with_hf(bench, capsys):
    argv = ["--model", "tiny", "--device", "cpu", "--seq-len", "64", "--num-samples", "2"]
    bench.main([*argv, "--steps", "1", "--warmup", "0", "--compare-hf"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"tokens_per_s: \d+\.\d mfu: n/a vs_hf: \d+\.\d{3}", lines[-1]), lines[-1]
    custom, hf = (line for line in lines if "tokens/s" in line)
    assert custom.lstrip().startswith("custom:") and hf.lstrip().startswith("hf:")
    loss = [re.search(r"loss (-?\d+\.\d+)", line).group(1) for line in (custom, hf)]
    assert loss[0] == loss[1]  # same random weights in both implementations


def test_qwen3_0_6b_flops_per_token(bench):
    cfg = bench.build_hf_config("qwen3-0.6b")
    # 28 layers x (attention 1024 x (2 x 2048 + 2 x 1024) + MLP 3 x 1024 x 3072) + LM head 151936 x 1024
    assert bench.active_matmul_params(cfg) == 28 * (1024 * 6144 + 3 * 1024 * 3072) + 151936 * 1024
    attention = 12 * 28 * 16 * 128 * 16384
    assert bench.flops_per_token(cfg, 16384) == 6 * bench.active_matmul_params(cfg) + attention
    batch, context = bench.fake_batch(1000, 3, vocab_size=512)
    assert context == pytest.approx((333**2 + 333**2 + 334**2) / 1000)
    assert len(batch.micro_batches[0].input_ids) == 1000 and batch.num_loss_tokens == 1000 - 3 * 66
