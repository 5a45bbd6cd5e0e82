"""Our GLM-5 (glm_moe_dsa: MLA + DeepSeek sparse attention + GLM-4.5's MoE) against transformers (CPU, float32), on
three configs: the tiny fixture (top 4 keys per query), a feature-rich one (top 6 keys, attention biases, dense and
MoE layers interleaved, 2 shared experts, 4 expert groups of which 2 are kept, random selection bias), and a simple one
(top-k larger than any row: dense MLA, tied head, one group, no renormalised top-k). The shared MoE-family checks
(moe_family_helpers.py), plus: the top-k is active and never crosses a sample, the indexer gets no gradient (as in
transformers), and the variants we do not model are refused at load. Every config sets `indexer_rope_interleave`, as
GLM-5's checkpoints do (transformers always interleaves the indexer's RoPE; without the flag we follow vLLM's half-split:
test_glm_moe_dsa_sparse.py, with the tie rule; test_long_regime_parity.py: rows 2-8x the top-k)."""

import dataclasses

import pytest
import torch
from transformers import GlmMoeDsaConfig

from slipstream.models.common.attention import build_packed_causal_mask
from slipstream.models.common.moe_routing import SharedExpertMoE
from slipstream.models.glm_moe_dsa import attention as dsa_attention
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs
from slipstream.models.glm_moe_dsa.attention import DsaIndexer
from slipstream.models.glm_moe_dsa.model import GlmMoeDsa
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, max_diff, model_dir_fixture, random_ids

COMMON = dict(vocab_size=700, hidden_size=96, intermediate_size=160, max_position_embeddings=512, rms_norm_eps=1e-6,
              initializer_range=0.1, bos_token_id=None, eos_token_id=2, kv_lora_rank=24, q_lora_rank=40,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, index_n_heads=32, index_head_dim=32,
              indexer_rope_interleave=True)  # fmt: skip


def dsa_config(case: str = "sparse", **overrides) -> GlmMoeDsaConfig:
    if case == "sparse":
        fields = dict(num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=6, index_topk=6,
                      mlp_layer_types=["dense", "sparse", "dense", "sparse"], n_routed_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2,
                      routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, tie_word_embeddings=False,
                      pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 5e4})  # fmt: skip
    else:
        fields = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, index_topk=4096,
                      first_k_dense_replace=0, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                      n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
                      attention_bias=False, tie_word_embeddings=True, pad_token_id=None)  # fmt: skip
    return GlmMoeDsaConfig(**{**COMMON, **fields, **overrides})


model_dir = model_dir_fixture("glm_moe_dsa", dsa_config)
case = case_fixture(["tiny", "sparse", "simple"])


class TestGlmMoeDsaFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case, num_moe_blocks = "glm_moe_dsa", GlmMoeDsa, SharedExpertMoE, "sparse", 2
    unknown_key = "model.layers.0.self_attn.indexer.foo"
    checkpoint_keys = ("mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight", "indexer.wq_b.weight")
    no_grad_params = (".indexer.",)
    # Past the tokenizer's specials: the padding id's embedding row is zero, and a zero query ties every key of the
    # indexer, a tie transformers breaks its own way (attention.py). bf16 flips a few tokens' top-k too.
    low_token_id, bf16_mean_tolerance = 3, 0.1


def test_configs_read_as_intended(model_dir):
    sparse = load_pretrained(model_dir("sparse")).args
    assert (sparse.head_dim, sparse.qk_head_dim, sparse.index_topk) == (8, 24, 6) and sparse.attention_bias
    assert [sparse.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    tiny = load_pretrained(model_dir("tiny")).args
    assert tiny.index_topk == 4 and [tiny.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert sparse.indexer_rope_interleave and tiny.indexer_rope_interleave  # as GLM-5's config.json says
    simple = load_pretrained(model_dir("simple"))
    assert simple.lm_head is None and all(simple.args.is_moe_layer(i) for i in range(2))


def test_sparse_top_k_changes_the_logits(model_dir):
    """The same weights with a top-k larger than the row (dense MLA) give other logits from token index_topk on,
    and the same ones before it (where every key is in the top-k)."""
    sparse = load_pretrained(model_dir("sparse")).eval()
    dense = GlmMoeDsa(dataclasses.replace(sparse.args, index_topk=10_000)).eval()
    dense.load_state_dict(sparse.state_dict())
    input_ids_BT, position_ids_BT = random_ids(700, 1, 30, seed=2, low=3), torch.arange(30)[None]
    with torch.no_grad():
        got, want = sparse(input_ids_BT, position_ids_BT), dense(input_ids_BT, position_ids_BT)
    assert max_diff(got[:, :6], want[:, :6]) <= 1e-5 and max_diff(got[:, 6:], want[:, 6:]) > 1e-2


def test_indexer_keeps_the_top_k_of_its_own_sample_only(monkeypatch):
    args = GlmMoeDsaArgs.from_hf_config(dsa_config())
    indexer = DsaIndexer(args)
    indexer.init_weights(0.5)
    lengths = [3, 10, 7]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    mask_BTT = build_packed_causal_mask(position_ids_BT)[:, 0]
    T = sum(lengths)
    x_BTD, q_resid_BTQ = torch.randn(1, T, 96), torch.randn(1, T, 40)
    cos_BTR, sin_BTR = torch.randn(1, T, 8), torch.randn(1, T, 8)
    keep_BTT = indexer.select(x_BTD, q_resid_BTQ, indexer.keys(x_BTD, cos_BTR, sin_BTR), cos_BTR, sin_BTR, mask_BTT)
    assert not (keep_BTT & ~mask_BTT).any()  # never another sample's key, never a later one
    assert torch.equal(keep_BTT.sum(-1), mask_BTT.sum(-1).clamp(max=6))  # min(top-k, keys of the sample so far)
    monkeypatch.setattr(dsa_attention, "INDEX_SCORES_BUDGET", 3 * 32 * T)  # queries ranked 3 at a time
    keys_BTI = indexer.keys(x_BTD, cos_BTR, sin_BTR)
    assert torch.equal(indexer.select(x_BTD, q_resid_BTQ, keys_BTI, cos_BTR, sin_BTR, mask_BTT), keep_BTT)


def test_packed_rows_with_long_samples_match_samples_run_alone(model_dir):
    """Samples several times longer than the top-k, packed with a short one: each query ranks its own sample only."""
    ours = load_pretrained(model_dir("sparse")).eval()
    lengths = [25, 4, 31]
    samples = [random_ids(700, 1, n, seed=i + 20, low=3) for i, n in enumerate(lengths)]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(torch.cat(samples, dim=1), position_ids_BT)
        alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
    assert max_diff(packed, alone) <= 1e-5


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(indexer_types=["full", "shared", "full", "shared"]), "indexer_types"),
        (dict(index_topk_pattern="FSFS"), "indexer_types"),
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(index_head_dim=4), "index_head_dim"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn'"),
    ],
)
def test_unsupported_variants_are_rejected_at_load(override, match):
    config = dsa_config()
    for key, value in override.items():  # past the config's own checks, as an edited config.json could be
        object.__setattr__(config, key, value)
    if "index_topk_pattern" in override:
        config = dsa_config(index_topk_pattern="FSFS")
    with pytest.raises(ValueError, match=match):
        GlmMoeDsaArgs.from_hf_config(config)
