"""Our Laguna (laguna, Poolside) against transformers (CPU, float32): logits and gradients on two configs (the tiny
fixture: sliding / full / sliding layers with 4 / 8 / 4 query heads, windows of 8 tokens (shorter than the
sequences), the checkpoints' per-layer-type RoPE (partial on the full layer), softplus gates per head, a dense first
layer, MoEs with a shared expert, router logits softcapped at 5, scaling 2.5; a wide one: an MoE first layer then
dense, sparse, sparse, heads 6 / 2 / 4 / 6, gates per head dim, q/k/v/o biases, YaRN on the full layers, no softcap,
16 experts top 4, a tied head, a padding id), packed rows (windows kept per sample), bit-exact weight round trips
(checkpoint names and layout, and transformers' in-memory ones), router replay per MoE block, the registry, and the
config features we reject."""

import pytest
import torch
from transformers import LagunaConfig

from slipstream.models.common.moe_routing import SharedExpertMoE
from slipstream.models.laguna.args import LagunaArgs
from slipstream.models.laguna.model import Laguna, SoftcappedSigmoidRouter
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, model_dir_fixture

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}


def wide_config(**overrides) -> LagunaConfig:
    fields = dict(vocab_size=700, hidden_size=96, intermediate_size=160, moe_intermediate_size=24,
                  shared_expert_intermediate_size=40, num_hidden_layers=4, num_attention_heads=6,
                  num_attention_heads_per_layer=[6, 2, 4, 6], num_key_value_heads=2, head_dim=32,
                  layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                  mlp_layer_types=["sparse", "dense", "sparse", "sparse"], sliding_window=6, gating="per-element",
                  attention_bias=True, num_experts=16, num_experts_per_tok=4, moe_routed_scaling_factor=1.5,
                  rope_parameters={"full_attention": {**YARN, "partial_rotary_factor": 0.25},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    return LagunaConfig(**{**fields, **overrides})


def randomize_biases_and_norms(hf) -> None:
    """transformers inits the selection bias (a parameter here) at 0 and the norms at 1: make them matter."""
    for name, param in hf.named_parameters():
        if name.endswith("e_score_correction_bias"):
            param.normal_(0.0, 0.1)
        elif name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)


model_dir = model_dir_fixture("laguna", lambda case: wide_config(), tweak=randomize_biases_and_norms)
case = case_fixture(["tiny", "wide"])


class TestLagunaFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case = "laguna", Laguna, SharedExpertMoE, "wide"
    unknown_key = "model.layers.0.mlp.foo"
    checkpoint_keys = (
        "mlp.experts.e_score_correction_bias",
        "mlp.experts.0.gate_proj.weight",
        "mlp.shared_expert.gate_proj.weight",
        "self_attn.g_proj.weight",
    )
    num_moe_blocks, hf_keeps_bias_in_fp32 = 3, False


def test_configs_read_as_intended(model_dir):
    tiny = load_pretrained(model_dir("tiny"))
    args = tiny.args
    assert args.num_heads_per_layer == (4, 8, 4) and args.gate_per_head and args.router_logit_softcapping == 5.0
    assert (args.rope.theta, args.rope.rotary_dim(64)) == (500000.0, 32)
    assert (args.sliding_rope.theta, args.sliding_rope.rotary_dim(64)) == (10000.0, 64)
    assert [layer.attn.sliding_window for layer in tiny.layers] == [8, None, 8]
    assert tiny.layers[0].attn.rope == args.sliding_rope and tiny.layers[1].attn.rope is None
    assert tiny.layers[1].attn.q_proj.weight.shape == (8 * 64, 128) and tiny.layers[1].attn.g_proj.weight.shape[0] == 8
    assert not hasattr(tiny.layers[0].mlp, "router") and tiny.layers[2].mlp.router.softcap == 5.0
    wide = load_pretrained(model_dir("wide"))
    assert wide.args.rope.rope_type == "yarn" and wide.args.tie_word_embeddings and wide.lm_head is None
    assert wide.layers[0].attn.g_proj.weight.shape == (6 * 32, 96) and wide.layers[0].attn.q_proj.bias is not None
    assert [getattr(layer, "routes_tokens", False) for layer in wide.layers] == [True, False, True, True]


def test_router_softcaps_logits_before_the_sigmoid():
    torch.manual_seed(0)
    router = SoftcappedSigmoidRouter(16, 8, 2, True, softcap=2.0)
    torch.nn.init.normal_(router.weight, std=1.0)
    x_ND = torch.randn(5, 16)
    raw_NE = x_ND @ router.weight.T
    assert raw_NE.abs().max() > 2.0  # the cap bites
    torch.testing.assert_close(router.logits(x_ND), 2.0 * torch.tanh(raw_NE / 2.0))
    router.softcap = 0.0
    torch.testing.assert_close(router.logits(x_ND), raw_NE)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(layer_types=["full_attention", "chunked_attention", "full_attention", "full_attention"]), "layer_types"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(gating=False), "gating"),
        (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), "mlp_layer_types"),
        (dict(num_attention_heads_per_layer=[6, 3, 4, 6]), "num_attention_heads_per_layer"),
        (dict(moe_apply_router_weight_on_input=True), "moe_apply_router_weight_on_input"),
        (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_parameters"),
        (dict(rope_parameters={"full_attention": {"rope_type": "longrope", "rope_theta": 1e4},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "rope_type"),
    ],
)  # fmt: skip
def test_unsupported_features_are_rejected_at_load(override, match):
    config = wide_config()
    for key, value in override.items():  # past the config's own checks, as an edited config.json could be
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=match):
        LagunaArgs.from_hf_config(config)
