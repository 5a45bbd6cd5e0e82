"""On a CUDA GPU: the fused LM head (torch.compile'd kernels) against its eager reference and against the unfused
head, its memory at 65,536 tokens x 151,936 vocab, and a policy with activation checkpointing + torch.compile
against eager.

Not run in CI (marked gpu). Tolerances: both heads compute logits in bf16 and the softmax in float32, so log-probs
agree to float32 rounding (1e-4 relative) and gradients to bf16 rounding (~1e-2); compiled blocks reorder bf16
arithmetic, so a policy's log-probs and gradients agree to ~1e-2 relative.
"""

import pytest
import torch

from slipstream.config.trainer import ParallelConfig
from slipstream.models.registry import build_model
from slipstream.models.tiny import build_config
from slipstream.parallel.fsdp import parallelize_model
from slipstream.trainer.logprobs import chunked_lm_head_logprobs
from slipstream.trainer.policy import Policy
from tests.benchmark_scripts import load_benchmark

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("trainer_throughput")


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def test_fused_lm_head_matches_unfused(bench):
    g = torch.Generator(CUDA).manual_seed(0)
    num_tokens, vocab, dim = 3000, 50000, 256
    weight = (torch.randn(vocab, dim, device=CUDA, generator=g) * 0.05).requires_grad_()
    hidden = torch.randn(num_tokens, dim, device=CUDA, generator=g).requires_grad_()
    token_ids = torch.randint(0, vocab, (num_tokens,), device=CUDA, generator=g)
    temperatures = torch.rand(num_tokens, device=CUDA, generator=g) + 0.5
    grad_out = torch.randn(num_tokens, device=CUDA, generator=g)
    results = []
    for head in ("fused", "unfused"):
        weight.grad = hidden.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if head == "fused":
                logprobs, entropy = chunked_lm_head_logprobs(weight, hidden, token_ids, temperatures, chunk_size=1024)
            else:
                logprobs, entropy = bench.unfused_lm_head_logprobs(weight, hidden, token_ids, temperatures)
        (logprobs * grad_out).sum().backward()
        results.append((logprobs.detach(), entropy, weight.grad.clone(), hidden.grad.clone()))
    (lp, ent, gw, gh), (lp_ref, ent_ref, gw_ref, gh_ref) = results
    assert lp.dtype == ent.dtype == torch.float32
    assert rel(lp, lp_ref) < 1e-4 and rel(ent, ent_ref) < 1e-4
    assert rel(gw, gw_ref) < 1e-2 and rel(gh, gh_ref) < 1e-2


def test_fused_lm_head_memory_under_a_tenth_of_unfused(bench):
    figures = bench.measure_lm_head_memory(CUDA, 65536)
    print(figures)
    assert figures["fused_over_unfused"] < 0.1


def test_compiled_checkpointed_policy_matches_eager():
    torch.manual_seed(0)
    cfg = build_config("qwen3", vocab_size=512, eos_token_id=2, pad_token_id=0)
    state = build_model(cfg, "custom").state_dict()
    lengths = [100, 1, 411, 512]
    input_ids_T = torch.randint(0, 512, (sum(lengths),), device=CUDA)
    position_ids_T = torch.cat([torch.arange(n) for n in lengths]).to(CUDA)
    temperatures_T = torch.full((sum(lengths),), 0.9, device=CUDA)
    results = []
    for compile in (False, True):
        model = build_model(cfg, "custom")
        model.load_state_dict(state)
        config = ParallelConfig(activation_checkpointing=True)
        policy = parallelize_model(Policy(model.to(CUDA)), None, config, compile=compile)
        for _ in range(2):  # the second call runs the compiled code without tracing
            policy.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logprobs_T, _ = policy(input_ids_T, position_ids_T, temperatures_T)
            logprobs_T.sum().backward()
        results.append((logprobs_T.detach(), {n: p.grad for n, p in policy.named_parameters()}))
    (lp, grads), (lp_c, grads_c) = results
    assert rel(lp_c, lp) < 1e-2
    for name, grad in grads.items():
        assert rel(grads_c[name], grad) < 3e-2, name
