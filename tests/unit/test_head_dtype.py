"""model.head_dtype = "float32": the trainer's LM head keeps its bfloat16 product in float32 (what vLLM computes with
`--hf-overrides '{"head_dtype": "float32"}'`), forward and backward, through Policy and the weight probe."""

import pytest
import torch

from slipstream.config.shared import ModelConfig
from slipstream.trainer.data import to_packed
from slipstream.trainer.lm_head import lm_head_logprobs
from slipstream.trainer.logprobs import compute_logprobs, mixed_precision
from slipstream.trainer.policy import Policy
from slipstream.trainer.setup import head_dtype_of
from slipstream.weights.send.folder import compute_probe_logprobs
from tests.unit.test_trainer_loop import _micro_batch, _sample

CPU = torch.device("cpu")
C, D, V = 64, 96, 512


def _operands(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(C, D, generator=g) * 2  # logits of a few units, as a trained model's
    weight = torch.randn(V, D, generator=g) * 0.5
    tokens = torch.randint(0, V, (C,), generator=g)
    return hidden, weight, tokens


def _reference(hidden, weight, tokens):
    """float32 log-probs of bfloat16-rounded operands: the float32 head's definition."""
    logits = hidden.bfloat16().float() @ weight.bfloat16().float().T
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)


def test_a_float32_head_keeps_the_bf16_product_unrounded():
    hidden, weight, tokens = _operands()
    ones = torch.ones(C)
    fp32_head, _ = lm_head_logprobs(hidden.bfloat16(), weight.bfloat16(), None, tokens, ones, torch.float32)
    bf16_head, _ = lm_head_logprobs(hidden.bfloat16(), weight.bfloat16(), None, tokens, ones)
    reference = _reference(hidden, weight, tokens)
    assert (fp32_head - reference).abs().max() < 1e-4
    assert (bf16_head - reference).abs().max() > 1e-2  # rounding the logits to bfloat16 is what the option removes


def test_gradients_of_a_float32_head_match_the_float32_reference():
    hidden, weight, tokens = _operands(3)
    advantages = torch.randn(C, generator=torch.Generator().manual_seed(4))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with mixed_precision(CPU, torch.bfloat16):
        logprobs, _ = lm_head_logprobs(h, w, None, tokens, torch.ones(C), torch.float32)
    (logprobs * advantages).sum().backward()
    h_ref = hidden.bfloat16().float().requires_grad_()
    w_ref = weight.bfloat16().float().requires_grad_()
    logits = h_ref @ w_ref.T
    (torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1) * advantages).sum().backward()
    assert logprobs.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    torch.testing.assert_close(logprobs.detach(), _reference(hidden, weight, tokens), rtol=0, atol=1e-4)
    # the backward matmuls run in bfloat16 (as without the option): gradients to bfloat16's precision
    for grad, reference in ((h.grad, h_ref.grad), (w.grad, w_ref.grad)):
        assert (grad - reference).abs().max() <= 1e-2 * reference.abs().max()


@pytest.fixture(scope="module")
def model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def test_policy_and_probe_take_the_head_dtype_from_the_config(model):
    head_dtype = head_dtype_of(ModelConfig(name="m", dtype="bfloat16", head_dtype="float32"))
    assert head_dtype == torch.float32
    assert head_dtype_of(ModelConfig(name="m", dtype="bfloat16", head_dtype="model")) is None
    assert head_dtype_of(ModelConfig(name="m", dtype="bfloat16")) == torch.float32  # the default
    mb = to_packed(_micro_batch([_sample(3, 9, seed=5), _sample(4, 7, seed=6)], [1.0, -1.0]), CPU)
    results = {}
    with torch.no_grad(), mixed_precision(CPU, torch.bfloat16):
        for name, dtype in (("bf16", None), ("fp32", head_dtype)):
            results[name], _ = Policy(model, head_dtype=dtype)(mb.input_ids_T, mb.position_ids_T, mb.temperatures_T)
        results["direct"], _ = compute_logprobs(model, mb, head_dtype=torch.float32)
    assert torch.equal(results["fp32"], results["direct"])
    assert not torch.equal(results["fp32"], results["bf16"])  # the option reaches the head
    bf16_model = model.to(torch.bfloat16)
    try:
        ids = mb.input_ids_T[:12].tolist()
        probe = torch.tensor(compute_probe_logprobs(bf16_model, ids, torch.float32))
        plain = torch.tensor(compute_probe_logprobs(bf16_model, ids))
        with torch.no_grad():
            hidden = bf16_model.model(torch.tensor([ids])).last_hidden_state[0, :-1]
            logits = hidden.float() @ bf16_model.lm_head.weight.float().T
        reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    finally:
        model.float()
    assert (probe - reference).abs().max() < 1e-4
    assert (plain - reference).abs().max() > (probe - reference).abs().max()
