"""Our AFMoE (afmoe, Arcee Trinity) against transformers (CPU, float32): logits and gradients on two configs (the tiny
fixture: a dense first layer, sliding windows of 8 tokens (shorter than the sequences), a NoPE full-attention layer,
a shared expert, route_scale 2.5; a wider one: 2 dense layers, 16 experts top 4, 2 shared experts, muP input
scaling, a tied head, a padding id), packed rows (windows kept per sample), bit-exact weight round trips (checkpoint
and in-memory layouts), router replay per MoE block, the registry, the sliding-window mask (alone and as a context-parallel
shard) and the config features we reject."""

import pytest
import torch
from transformers import AfmoeConfig

from slipstream.models.afmoe.args import AfmoeArgs
from slipstream.models.afmoe.model import Afmoe, AfmoeRMSNorm
from slipstream.models.common.attention import (
    AttentionLayout,
    ContextShard,
    build_attention_layout,
    sliding_window_attention,
)
from slipstream.models.common.moe_routing import SharedExpertMoE
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, model_dir_fixture


def wide_config(**overrides) -> AfmoeConfig:
    fields = dict(vocab_size=700, hidden_size=96, intermediate_size=160, moe_intermediate_size=24,
                  num_hidden_layers=4, num_dense_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                  num_experts=16, num_experts_per_tok=4, num_shared_experts=2, route_scale=1.5,
                  global_attn_every_n_layers=2, sliding_window=6, mup_enabled=True, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=True)  # fmt: skip
    return AfmoeConfig(**{**fields, **overrides})


def randomize_routers_and_norms(hf) -> None:
    """transformers inits the router at 0 (every score 0.5) and `expert_bias` at 0, norms at 1: make them matter."""
    for name, param in hf.named_parameters():
        if name.endswith(("router.gate.weight", "mlp.expert_bias")):
            param.normal_(0.0, 0.1)
        elif name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5)


model_dir = model_dir_fixture("afmoe", lambda case: wide_config(), tweak=randomize_routers_and_norms)
case = case_fixture(["tiny", "wide"])


class TestAfmoeFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case = "afmoe", Afmoe, SharedExpertMoE, "wide"
    unknown_key = "model.layers.0.mlp.foo"
    checkpoint_keys = ("mlp.expert_bias", "mlp.experts.0.gate_proj.weight", "self_attn.gate_proj.weight")
    num_moe_blocks, hf_keeps_bias_in_fp32 = 2, False


def test_configs_read_as_intended(model_dir):
    tiny = load_pretrained(model_dir("tiny")).args
    assert tiny.layer_types == ("sliding_attention", "sliding_attention", "full_attention")
    assert (tiny.num_dense_layers, tiny.sliding_window, tiny.num_shared_experts, tiny.route_scale) == (1, 8, 1, 2.5)
    wide = load_pretrained(model_dir("wide"))
    assert wide.args.mup_enabled and wide.args.tie_word_embeddings and wide.lm_head is None
    assert wide.layers[1].attn.sliding_window is None and wide.layers[0].attn.sliding_window == 6
    assert wide.layers[3].mlp.shared_experts.gate_proj.weight.shape == (2 * 24, 96)


def _window(q, k, v, positions, window):
    return sliding_window_attention(q, k, v, AttentionLayout("reference", positions), window)


def test_sliding_window_attention_keeps_each_sample_window():
    """Keys at distance >= window are masked, within each packed sample; a context-parallel shard's queries over the
    all-gathered keys get the same rows as the whole row."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8), torch.randn(1, 10, 2, 8)
    positions = torch.cat([torch.arange(6), torch.arange(4)])[None]
    packed = _window(q, k, v, positions, 3)
    alone = [_window(q[:, s], k[:, s], v[:, s], positions[:, s], 3) for s in (slice(0, 6), slice(6, 10))]
    assert torch.allclose(packed, torch.cat(alone, dim=1), atol=1e-6)
    # the last query of the first sample sees keys 3..5 only: changing key 2 changes nothing there
    k2 = k.clone()
    k2[:, 2] += 5.0
    assert torch.allclose(_window(q, k2, v, positions, 3)[:, 5], packed[:, 5], atol=1e-6)
    assert not torch.allclose(_window(q, k2, v, positions, 4)[:, 5], packed[:, 5], atol=1e-3)
    full_kv = {}
    shard = ContextShard(positions, offset=4, gather_kv=lambda kv_BtX: full_kv["kv"])
    full_kv["kv"] = torch.stack((k, v), dim=2)
    layout = build_attention_layout(positions[:, 4:8], torch.float32, shard)
    got = sliding_window_attention(q[:, 4:8], k[:, 4:8], v[:, 4:8], layout, 3)
    assert torch.allclose(got, packed[:, 4:8], atol=1e-6)


def test_norm_matches_transformers_in_bf16():
    """transformers' AfmoeRMSNorm multiplies by the weight before casting back: bit-equal in bf16 too."""
    from transformers.models.afmoe.modeling_afmoe import AfmoeRMSNorm as HFNorm

    torch.manual_seed(0)
    ours, theirs = AfmoeRMSNorm(64, 1e-6), HFNorm(64, eps=1e-6)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert ours(x).dtype == torch.bfloat16 and torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (
            dict(layer_types=["sliding_attention", "chunked_attention", "full_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(sliding_window=0), "sliding_window"),
    ],
)
def test_unsupported_features_are_rejected_at_load(override, match):
    config = wide_config()
    for key, value in override.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        AfmoeArgs.from_hf_config(config)
