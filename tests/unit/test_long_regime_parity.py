"""Every family against transformers (CPU, float32) in the regime where its special attention acts, at rows at least
4x its window, chunk or top-k: GLM-5's DSA with the top-k at 1/8 and 1/2 of the row; sliding windows at 1/5 of the row
(AFMoE, GPT-OSS, Laguna), GPT-OSS's and Laguna's YaRN (partial on Laguna's full layers) past an original context of 8
tokens; chunked linear attention (Qwen3.5's gated delta rule, chunks of 64; Nemotron-H's SSD, chunks of 16) over rows
that are no multiple of the chunk, with packed samples straddling chunk edges; partial RoPE (GLM-4.5, MiniMax-M2) and
Llama 3 scaling (past an original context of 16) over long rows. Each case checks whole rows (logits <= 1e-4,
gradients <= 1e-4 of each tensor's largest) and a packed row (= its samples alone, ours and transformers', values and
gradients). The configs are the families' own test configs (their modules), with the regime's sizes."""

import pytest
from transformers import LlamaConfig

from slipstream.models.qwen3_5_moe.delta_rule import CHUNK_SIZE
from slipstream.models.registry import MODEL_SPECS
from tests.unit import (
    test_afmoe,
    test_glm4_moe,
    test_glm_moe_dsa,
    test_gpt_oss,
    test_laguna,
    test_minimax_m2,
    test_nemotron_h,
    test_qwen3_5_moe,
)
from tests.unit.long_regime_helpers import build_pair, check_packed_rows, check_rows, random_ids


def _yarn(theta: float, original: int, **extra) -> dict:
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": 4.0,
        "original_max_position_embeddings": original,
        **extra,
    }


def _gpt_oss():
    cfg = test_gpt_oss.config("sliding")  # alternating sliding / full layers, sinks
    cfg.sliding_window = 8
    cfg.rope_parameters = _yarn(150000.0, 8, beta_fast=32.0, beta_slow=1.0, truncate=False)
    return cfg


def _laguna():
    ropes = {"full_attention": {**_yarn(10000.0, 8), "partial_rotary_factor": 0.25},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}  # fmt: skip
    return test_laguna.wide_config(sliding_window=8, rope_parameters=ropes)


def _llama():
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}  # fmt: skip
    return LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                       initializer_range=0.1, rope_parameters=llama3, bos_token_id=None, eos_token_id=2)  # fmt: skip


def _glm4_moe():
    return test_glm4_moe.glm_config("full")  # partial RoPE 0.5, q/k norm


CASES = {
    # name: (family, config factory, tweak, whole-row length, packed sample lengths)
    "glm_moe_dsa-top8of64": ("glm_moe_dsa", lambda: test_glm_moe_dsa.dsa_config(index_topk=8), None, 64, [44, 12, 52]),
    "glm_moe_dsa-top32of64": ("glm_moe_dsa", lambda: test_glm_moe_dsa.dsa_config(index_topk=32), None, 64, [44, 12, 52]),
    "afmoe-window8of40": (
        "afmoe", lambda: test_afmoe.wide_config(sliding_window=8), test_afmoe.randomize_routers_and_norms, 40,
        [33, 7, 40],
    ),
    "gpt_oss-window8of40-yarn8": ("gpt_oss", _gpt_oss, test_gpt_oss._tweak, 40, [33, 7, 40]),
    "laguna-window8of40-yarn8": ("laguna", _laguna, test_laguna.randomize_biases_and_norms, 40, [33, 7, 40]),
    "qwen3_5_moe_text-chunk64of300": (
        "qwen3_5_moe_text", test_qwen3_5_moe.qwen35_config, None, 300, [100, 37, 90, 73],
    ),
    "nemotron_h-chunk16of75": ("nemotron_h", test_nemotron_h.nemotron_h_config, test_nemotron_h._randomise, 75,
                               [29, 18, 28]),
    "glm4_moe-partial-rope-128": ("glm4_moe", _glm4_moe, None, 128, [70, 58]),
    "minimax_m2-partial-rope-128": (
        "minimax_m2", test_minimax_m2.wide_config, test_minimax_m2._non_trivial_qk_norms, 128, [70, 58],
    ),
    "llama-llama3-rope16of64": ("llama", _llama, None, 64, [40, 24]),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    family, make_config, tweak, T, lengths = CASES[request.param]
    ours, hf = build_pair(make_config(), tmp_path_factory.mktemp(request.param), tweak=tweak)
    return request.param, family, ours, hf, T, lengths


def test_whole_rows_match_transformers(pair):
    name, family, ours, hf, T, _ = pair
    errors = check_rows(family, ours, hf, random_ids(ours.args.vocab_size, 2, T, seed=3))
    print(f"{name}: {errors}")


def test_packed_row_matches_its_samples_alone(pair):
    name, family, ours, hf, _, lengths = pair
    chunked = family in ("qwen3_5_moe_text", "nemotron_h")
    errors = check_packed_rows(family, ours, hf, lengths, alone_atol=1e-4 if chunked else 1e-5)
    print(f"{name}: {errors}")


def test_the_cases_are_in_their_regime():
    """What the docstring says, read from our args of each case's config: top-k at 1/8 and 1/2 of the row, windows at
    1/5, YaRN / Llama 3 original contexts at most 1/4 of the row, partial RoPE, rows of at least 4 chunks that are no
    multiple of the chunk, packed samples starting inside a chunk."""

    def args(name: str):
        family, make_config = CASES[name][:2]
        return MODEL_SPECS[family].args_from_hf(make_config())

    assert [args(f"glm_moe_dsa-top{k}of64").index_topk * (64 // k) for k in (8, 32)] == [64, 64]
    for name in ("afmoe-window8of40", "gpt_oss-window8of40-yarn8", "laguna-window8of40-yarn8"):
        assert args(name).sliding_window * 5 == CASES[name][3], name
    for name in ("gpt_oss-window8of40-yarn8", "laguna-window8of40-yarn8", "llama-llama3-rope16of64"):
        rope = args(name).rope
        assert rope.rope_type in ("yarn", "llama3") and 4 * rope.original_max_position_embeddings <= CASES[name][3]
    for name in ("laguna-window8of40-yarn8", "glm4_moe-partial-rope-128", "minimax_m2-partial-rope-128"):
        head_dim = args(name).head_dim
        assert args(name).rope.rotary_dim(head_dim) < head_dim, name
    for name, chunk in (("qwen3_5_moe_text-chunk64of300", CHUNK_SIZE), ("nemotron_h-chunk16of75", 16)):
        T, lengths = CASES[name][3], CASES[name][4]
        starts = [sum(lengths[:i]) for i in range(1, len(lengths))]
        assert T >= 4 * chunk and T % chunk and sum(lengths) % chunk and all(s % chunk for s in starts), name
    assert args("nemotron_h-chunk16of75").chunk_size == 16
