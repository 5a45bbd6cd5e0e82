"""The CPU LM head that keeps its probabilities for backward (trainer/lm_head.py `_CpuLMHead`): the same log-probs,
entropies and gradients as the head that recomputes its logits in backward, over several cache blocks, with a
temperature per token, a bias and a float32 head under bfloat16 autocast; `chunked_lm_head_logprobs` takes it only
within CPU_SAVED_PROBS_BYTES."""

import pytest
import torch

from slipstream.trainer import lm_head, logprobs
from slipstream.trainer.lm_head import CPU_BLOCK_ROWS, lm_head_logprobs
from slipstream.trainer.logprobs import chunked_lm_head_logprobs, mixed_precision
from tests.benchmark_scripts import load_benchmark

CPU = torch.device("cpu")
C, D, V = 2 * CPU_BLOCK_ROWS + 5, 48, 300  # three blocks, the last one short


def _operands(seed: int, num_tokens: int = C):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, D, generator=g)
    weight = torch.randn(V, D, generator=g) * 0.5
    bias = torch.randn(V, generator=g)
    tokens = torch.randint(0, V, (num_tokens,), generator=g)
    temperatures = torch.rand(num_tokens, generator=g) + 0.5
    weights = torch.randn(num_tokens, generator=g)  # the loss's per-token factors (advantages)
    return hidden, weight, bias, tokens, temperatures, weights


def _run(keep_probs: bool, operands, head_dtype=None, autocast=torch.float32):
    hidden, weight, bias, tokens, temperatures, weights = operands
    h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
    with mixed_precision(CPU, autocast):
        lp, ent = lm_head_logprobs(h, w, b, tokens, temperatures, head_dtype, keep_probs)
    (lp * weights).sum().backward()
    return lp.detach(), ent, h.grad, w.grad, b.grad


@pytest.mark.parametrize(
    ("head_dtype", "autocast"), [(None, torch.float32), (torch.float32, torch.bfloat16)], ids=["fp32", "bf16-fp32-head"]
)
def test_keeping_the_probabilities_gives_the_recomputing_heads_results(head_dtype, autocast):
    operands = _operands(0)
    kept = _run(True, operands, head_dtype, autocast)
    recomputed = _run(False, operands, head_dtype, autocast)
    for name, a, b in zip(
        ("logprobs", "entropy", "hidden grad", "weight grad", "bias grad"), kept, recomputed, strict=True
    ):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    # and both are the definition: log_softmax of the tempered logits
    hidden, weight, bias, tokens, temperatures, _ = operands
    if autocast == torch.float32:
        z = (hidden @ weight.T + bias) / temperatures[:, None]
        expected = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
        torch.testing.assert_close(kept[0], expected, rtol=1e-5, atol=1e-5)


def test_the_kept_probabilities_serve_one_backward_only():
    hidden, weight, bias, tokens, temperatures, _ = _operands(1)
    h = hidden.clone().requires_grad_()
    lp, _ = lm_head_logprobs(h, weight, bias, tokens, temperatures, None, True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="used up"):
        lp.sum().backward()


def test_an_empty_chunk_gives_zero_gradients():
    hidden, weight, bias, tokens, temperatures, weights = _operands(2, num_tokens=0)
    lp, ent, h_grad, w_grad, b_grad = _run(True, (hidden, weight, bias, tokens, temperatures, weights))
    assert lp.shape == ent.shape == (0,)
    assert not w_grad.any() and not b_grad.any() and h_grad.shape == (0, D)


@pytest.mark.parametrize(("budget", "kept"), [(C * V * 4, True), (C * V * 4 - 1, False)])
def test_the_chunked_head_keeps_probabilities_only_within_the_budget(monkeypatch, budget, kept):
    calls = []
    real = lm_head._CpuLMHead.apply
    monkeypatch.setattr(lm_head._CpuLMHead, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(logprobs, "CPU_SAVED_PROBS_BYTES", budget)
    hidden, weight, _, tokens, temperatures, _ = _operands(3)
    chunked_lm_head_logprobs(weight, hidden, tokens, temperatures, chunk_size=C)
    assert bool(calls) == kept


def test_the_benchmark_compares_both_paths(monkeypatch, capsys):
    bench = load_benchmark("cpu_lm_head")
    argv = ["cpu_lm_head.py", "--tokens", "40", "--hidden", "16", "--vocab", "300", "--repeats", "2"]
    monkeypatch.setattr("sys.argv", argv)
    bench.main()
    last = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert last[0::2] == ["recompute_s:", "keep_s:", "speedup:"]
    assert all(float(x) > 0 for x in last[1::2])
