"""Our GLM-4.5 MoE (glm4_moe) against transformers (CPU, float32): logits on three configs (the tiny fixture, a
feature-rich one: dense first layer, 2 shared experts, 4 expert groups of which 2 are kept, partial RoPE, q/k norm,
q/k/v biases, a random selection bias; a simple one: full RoPE, one group, no norm of the top-k, tied head), packed
rows, bit-exact weight round trips, gradients, the sigmoid group-limited router, router replay, the registry, and
weight publishing against save_pretrained."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Glm4MoeConfig, Qwen3Config
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from slipstream.models.common.moe_routing import GroupLimitedSigmoidRouter, SharedExpertMoE
from slipstream.models.glm4_moe.model import Glm4Moe
from slipstream.models.qwen3.args import Qwen3Args
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, max_diff, model_dir_fixture

COMMON = dict(max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None, eos_token_id=2)
SHAPE = dict(vocab_size=700, hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2)


def glm_config(case: str) -> Glm4MoeConfig:
    if case == "full":
        return Glm4MoeConfig(**COMMON, **SHAPE, num_hidden_layers=4, head_dim=32, first_k_dense_replace=1,
                             n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=2,
                             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                             attention_bias=True, use_qk_norm=True, partial_rotary_factor=0.5,
                             tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    return Glm4MoeConfig(**COMMON, **SHAPE, num_hidden_layers=2, head_dim=16, first_k_dense_replace=0,
                         n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=40, n_shared_experts=1,
                         n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                         attention_bias=False, use_qk_norm=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0},
                         tie_word_embeddings=True, pad_token_id=None)  # fmt: skip


model_dir = model_dir_fixture("glm4_moe", glm_config)
case = case_fixture(["tiny", "full", "simple"])


class TestGlm4MoeFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case = "glm4_moe", Glm4Moe, SharedExpertMoE, "full"
    unknown_key = "model.layers.0.mlp.gate.weight"
    checkpoint_keys = ("mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight")
    num_moe_blocks = 3


def test_configs_read_as_intended(model_dir):
    full = load_pretrained(model_dir("full")).args
    assert full.rope.partial_rotary_factor == 0.5 and full.rope.rotary_dim(full.head_dim) == 16
    assert full.qk_norm and full.attention_bias and (full.n_group, full.topk_group) == (4, 2)
    assert [full.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    simple = load_pretrained(model_dir("simple")).args
    assert simple.rope.partial_rotary_factor == 1.0 and not simple.qk_norm and simple.tie_word_embeddings
    assert all(simple.is_moe_layer(i) for i in range(2))
    # partial RoPE stays rejected by the families that do not model it
    qwen3 = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})  # fmt: skip
    with pytest.raises(ValueError, match="partial_rotary_factor != 1"):
        Qwen3Args.from_hf_config(qwen3)


def _router_pair(num_experts=16, top_k=4, groups=4, topk_groups=2, norm=True, scale=2.5, seed=0):
    torch.manual_seed(seed)
    config = glm_config("full")
    config.n_routed_experts, config.num_experts_per_tok, config.hidden_size = num_experts, top_k, 24
    config.n_group, config.topk_group, config.norm_topk_prob, config.routed_scaling_factor = (
        groups, topk_groups, norm, scale
    )  # fmt: skip
    theirs = Glm4MoeTopkRouter(config)
    ours = GroupLimitedSigmoidRouter(
        24, num_experts, top_k, norm, num_groups=groups, topk_groups=topk_groups, routed_scaling_factor=scale
    )
    with torch.no_grad():
        theirs.weight.normal_()
        theirs.e_score_correction_bias.normal_(0.0, 0.3)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    return ours, theirs


@pytest.mark.parametrize(("groups", "topk_groups", "norm"), [(4, 2, True), (4, 1, False), (1, 1, True), (8, 3, True)])
def test_router_matches_transformers_and_uses_the_bias_for_selection_only(groups, topk_groups, norm):
    ours, theirs = _router_pair(groups=groups, topk_groups=topk_groups, norm=norm)
    x_ND = torch.randn(64, 24)
    probs_NE, ids_NA, w_NA = ours(x_ND)
    _, their_w_NA, their_ids_NA = theirs(x_ND)
    order, their_order = ids_NA.argsort(-1), their_ids_NA.argsort(-1)
    assert torch.equal(ids_NA.gather(-1, order), their_ids_NA.gather(-1, their_order))
    assert max_diff(w_NA.gather(-1, order), their_w_NA.gather(-1, their_order)) <= 1e-6
    assert torch.allclose(probs_NE.sum(-1), torch.ones(64))
    # The selection bias moves the choice, never the weights: with it zeroed some choices change, and wherever the
    # same experts are chosen the weights are identical.
    bias = ours.e_score_correction_bias.clone()
    ours.e_score_correction_bias.zero_()
    _, ids0_NA, w0_NA = ours(x_ND)
    ours.e_score_correction_bias.copy_(bias)
    same_N = (ids0_NA.sort(-1).values == ids_NA.sort(-1).values).all(-1)
    assert 0 < same_N.sum() < 64
    order0 = ids0_NA.argsort(-1)
    assert max_diff(w0_NA.gather(-1, order0)[same_N], w_NA.gather(-1, order)[same_N]) <= 1e-6
    if groups > 1:  # every token's experts lie in at most topk_groups groups
        assert ((ids_NA // (16 // groups)).sort(-1).values.diff(dim=-1) != 0).sum(-1).max() < topk_groups


def test_router_replay_replaces_the_selection_and_takes_gate_weights_from_the_scores():
    ours, _ = _router_pair()
    x_ND = torch.randn(5, 24)
    _, own_NA, own_w_NA = ours(x_ND)
    replay_NA = torch.tensor([[0, 5, 10, 15], [1, 2, 3, 4], [-1, -1, -1, -1], [8, 9, 12, 13], [-1, -1, -1, -1]])
    _, ids_NA, w_NA = ours(x_ND, replay_NA)
    routed = [0, 1, 3]
    assert torch.equal(ids_NA[routed], replay_NA[routed])  # even outside the groups the router would keep
    assert torch.equal(ids_NA[[2, 4]], own_NA[[2, 4]]) and torch.equal(w_NA[[2, 4]], own_w_NA[[2, 4]])
    scores_NE = F.linear(x_ND, ours.weight).sigmoid()  # without the selection bias
    picked = scores_NE[routed].gather(-1, replay_NA[routed])
    assert torch.allclose(w_NA[routed], 2.5 * picked / picked.sum(-1, keepdim=True), atol=1e-6)
    assert ours.replay_counts.tolist()[:2] == [5, 3]
    # gradients reach the router through the replayed experts' scores
    ours.weight.grad = None
    ours(x_ND, replay_NA)[2][:, 0].sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0


def test_shared_expert_moe_layer_compiles_without_graph_break():
    moe = SharedExpertMoE(
        32, 16, 8, 2, True, shared_hidden_dim=16, num_groups=4, topk_groups=2, routed_scaling_factor=2.5
    )
    moe.init_weights(0.1)
    moe.router.e_score_correction_bias.normal_(0.0, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(moe)(torch.randn(2, 10, 32))
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
