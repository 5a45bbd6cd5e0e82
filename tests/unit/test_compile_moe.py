"""MoE blocks under activation checkpointing AND torch.compile (the trainer's GPU defaults) compile whole: the
statistics the MoE layers record on themselves (tokens per expert, router replay counts) once made Dynamo give up on
the checkpointed block and run it eagerly, which no test saw because the compile tests ran without checkpointing.
Here: no graph break, and the same statistics, log-probs and gradients as the eager model."""

import copy

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from slipstream.config.trainer import ParallelConfig
from slipstream.models.common.moe import TopKRouter, collect_moe_stats
from slipstream.models.registry import load_pretrained
from slipstream.parallel.fsdp import parallelize_model
from slipstream.trainer.policy import Policy
from tests.compile_backend import compile_backend

T = 48


def _inputs(num_moe_layers: int, top_k: int, num_experts: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    input_ids_T = torch.randint(0, vocab, (T,), generator=g)
    position_ids_T = torch.cat([torch.arange(30), torch.arange(T - 30)])
    replay_TRA = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(T * num_moe_layers)])
    replay_TRA = replay_TRA.view(T, num_moe_layers, top_k)
    return input_ids_T, position_ids_T, torch.ones(T), torch.ones(T, dtype=torch.bool), replay_TRA


def _plain(name: str) -> str:
    """A parameter's name without the wrappers' parts (checkpointing, compile)."""
    return name.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "")


def _run(policy, inputs, replay: bool):
    input_ids_T, position_ids_T, temperatures_T, loss_mask_T, replay_TRA = inputs
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs_T, _ = policy(
            input_ids_T, position_ids_T, temperatures_T, loss_mask_T, replay_TRA=replay_TRA if replay else None
        )
    logprobs_T.sum().backward()
    routers = [m for m in policy.modules() if isinstance(m, TopKRouter)]
    replay_counts = [r.replay_counts.clone() for r in routers] if replay else []
    stats = collect_moe_stats(policy)
    grads = {_plain(n): p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    policy.zero_grad(set_to_none=True)
    return logprobs_T.detach(), stats, replay_counts, grads


INDUCTOR_FAMILIES = ("qwen3_moe",)
"""Compiled to kernels by Inductor (the trainer's backend): the suite's one test that builds them for an MoE block. The
other families compile with `aot_eager` (as the other compile tests do, tests/compile_backend.py): the same Dynamo
capture (a graph break shows the same way) and AOTAutograd's forward/backward graphs with the checkpointed region,
without generating kernels: 3-10 s per family instead of 15-135 s (cold Inductor cache) on 2 CPU cores."""


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "glm4_moe",
        "minimax_m2",
        "glm_moe_dsa",
        "qwen3_5_moe_text",
        "afmoe",
        "gpt_oss",
        "laguna",
        "nemotron_h",
    ],
)
def test_checkpointed_moe_blocks_compile_whole_and_match_eager(tiny_model_factory, family):
    """bf16 autocast (compiling the grouped experts needs it) flips a few tokens' expert choice between compiled
    and eager kernels, so outputs and gradients are compared under full router replay (the same experts for every
    token in both); the router's own routing is compared by its statistics."""
    model = load_pretrained(tiny_model_factory(family), impl="custom").float()
    eager = Policy(copy.deepcopy(model))
    with compile_backend("inductor" if family in INDUCTOR_FAMILIES else "aot_eager"):
        compiled = parallelize_model(Policy(model), None, ParallelConfig(activation_checkpointing=True), compile=True)
    cfg = model.args
    moe_layers = sum(getattr(layer, "routes_tokens", False) for layer in model.layers)
    inputs = _inputs(moe_layers, cfg.num_experts_per_tok, cfg.num_experts, cfg.vocab_size)
    torch._dynamo.reset()
    counters.clear()

    got, want = _run(compiled, inputs, replay=False), _run(eager, inputs, replay=False)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert (got[1].tokens_per_expert_LE.sum(-1) == T * cfg.num_experts_per_tok).all()
    flipped = (got[1].tokens_per_expert_LE - want[1].tokens_per_expert_LE).abs().sum()
    assert flipped <= 0.05 * T * cfg.num_experts_per_tok * moe_layers, (got[1], want[1])
    torch.testing.assert_close(got[1].router_prob_mean_LE, want[1].router_prob_mean_LE, atol=1e-2, rtol=1e-2)

    got, want = _run(compiled, inputs, replay=True), _run(eager, inputs, replay=True)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    assert torch.equal(got[1].tokens_per_expert_LE, want[1].tokens_per_expert_LE)  # replayed: the same choice
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    for (seen, routed, agreeing), (want_seen, want_routed, want_agreeing) in zip(got[2], want[2], strict=True):
        assert seen == want_seen == routed == want_routed == T and abs(int(agreeing) - int(want_agreeing)) <= 2
    assert got[3].keys() == want[3].keys()
    for name, grad in want[3].items():  # bf16 noise: relative norm of the difference, per parameter
        error = (got[3][name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < 5e-2, (name, float(error))


def test_float32_grouped_experts_compile_and_match_eager():
    """torch._grouped_mm's meta kernel traces bf16 only: a float32 grouped GEMM raised inside a compiled graph
    (found with FSDP x EP in float32 on 4 GPUs, where the MoE blocks now compile whole). It runs eagerly there now
    (`grouped_mm`), with the same values and gradients as eager."""
    from slipstream.models.common.moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(dim=16, hidden_dim=32, num_experts=4)
    experts.init_weights(0.1)
    x = torch.randn(12, 16)
    counts = torch.tensor([3, 0, 5, 4])
    torch._dynamo.reset()
    compiled = torch.compile(experts.forward, fullgraph=False)
    outputs, grads = [], []
    for fn in (experts.forward, compiled):
        experts.zero_grad()
        x_in = x.clone().requires_grad_()
        y = fn(x_in, counts)
        y.square().sum().backward()
        outputs.append(y.detach())
        grads.append([x_in.grad, experts.gate_proj.grad.clone(), experts.down_proj.grad.clone()])
    torch.testing.assert_close(outputs[1], outputs[0])
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want)
