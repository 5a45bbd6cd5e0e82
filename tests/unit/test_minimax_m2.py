"""Our MiniMax-M2 (minimax_m2) against transformers (CPU, float32): logits and gradients on two configs (the tiny
fixture: partial RoPE 0.5, 8 experts top 2; a wider one: 16 experts top 4, partial RoPE 0.25, tied head, a padding
id), packed rows, bit-exact weight round trips (checkpoint and in-memory layouts), the full-width q/k norm, router
replay per MoE block, the registry and the config features we reject."""

import pytest
from transformers import MiniMaxM2Config

from slipstream.models.minimax_m2.args import MiniMaxM2Args
from slipstream.models.minimax_m2.model import MiniMaxM2, SigmoidMoE
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, model_dir_fixture


def wide_config(**overrides) -> MiniMaxM2Config:
    fields = dict(vocab_size=700, hidden_size=96, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, rotary_dim=8, num_local_experts=16, num_experts_per_tok=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    return MiniMaxM2Config(**{**fields, **overrides})


def _non_trivial_qk_norms(hf) -> None:
    for name, param in hf.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.uniform_(0.5, 1.5)


model_dir = model_dir_fixture("minimax_m2", lambda case: wide_config(), tweak=_non_trivial_qk_norms)
case = case_fixture(["tiny", "wide"])


class TestMiniMaxM2Family(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case = "minimax_m2", MiniMaxM2, SigmoidMoE, "wide"
    unknown_key = "model.layers.0.block_sparse_moe.foo"
    checkpoint_keys = ("block_sparse_moe.e_score_correction_bias", "block_sparse_moe.experts.0.w1.weight")
    num_moe_blocks, hf_keeps_bias_in_fp32 = 3, False


def test_configs_read_as_intended(model_dir):
    tiny = load_pretrained(model_dir("tiny")).args
    assert tiny.rope.rotary_dim(tiny.head_dim) == 32 and tiny.qk_norm and not tiny.attention_bias
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.moe_intermediate_size) == (8, 2, 64)
    wide = load_pretrained(model_dir("wide"))
    assert wide.args.rope.rotary_dim(32) == 8 and wide.args.tie_word_embeddings and wide.lm_head is None
    attn = wide.layers[0].attn  # one norm over all heads, not one per head
    assert attn.q_norm.weight.shape == (6 * 32,) and attn.k_norm.weight.shape == (2 * 32,)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
        (dict(shared_intermediate_size=64), "shared experts"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(attn_type_list=[0, 1, 1]), "linear-attention"),
        (dict(qk_norm_type="per_head"), "qk_norm_type"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_features_are_rejected_at_load(override, match):
    config = wide_config()
    for key, value in override.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        MiniMaxM2Args.from_hf_config(config)
