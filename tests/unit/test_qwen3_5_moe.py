"""Our Qwen3.5-MoE (qwen3_5_moe_text: Gated DeltaNet + gated full attention, MoE with a gated shared expert) against
transformers (CPU, float32), on three configs: the tiny fixture ([linear, full]), a hybrid one (3 linear layers of 4
value heads over 2 key heads and a full one, attention biases, random norms and decays, 10 experts top 3) and a simple
one (tied head, value heads = key heads, key and value dims unlike, a conv of 2 taps). The shared MoE-family checks
(moe_family_helpers.py), plus: rows several chunks long (samples crossing chunk edges) equal each sample alone and
transformers, the chunked delta rule equals the token-by-token recurrence with state resets, the conv never reaches
across a sample, and context parallelism, prefix trees and unsupported configs are refused."""

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig

from slipstream.models.common.attention import ContextShard
from slipstream.models.qwen3_5_moe.args import Qwen35MoeArgs
from slipstream.models.qwen3_5_moe.delta_rule import (
    chunk_gated_delta_rule,
    packed_causal_conv1d,
    recurrent_gated_delta_rule,
)
from slipstream.models.qwen3_5_moe.layers import GatedSharedExpertMoE
from slipstream.models.qwen3_5_moe.model import Qwen35Moe
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, max_diff, model_dir_fixture, random_ids

COMMON = dict(vocab_size=700, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
              bos_token_id=None, eos_token_id=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip


def qwen35_config(case: str = "hybrid", **overrides) -> Qwen3_5MoeTextConfig:
    if case == "hybrid":
        fields = dict(num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                      "linear_attention"], linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=10, num_experts_per_tok=3,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48, attention_bias=True,
                      tie_word_embeddings=False, pad_token_id=0)  # fmt: skip
    else:
        fields = dict(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"], linear_num_key_heads=3,
                      linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=24,
                      linear_conv_kernel_dim=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
                      shared_expert_intermediate_size=24, tie_word_embeddings=True, pad_token_id=None)  # fmt: skip
    return Qwen3_5MoeTextConfig(**{**COMMON, **fields, **overrides})


def _randomise_norms_and_decays(hf) -> None:
    """transformers inits every zero-centred norm at 0 and A_log/dt_bias alike per head: vary them so a mix-up
    between norms or heads shows."""
    for name, param in hf.named_parameters():
        if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")):
            param.normal_(0.0, 0.3)
        elif name.endswith(("linear_attn.norm.weight", "dt_bias")):
            param.normal_(1.0, 0.3)
        elif name.endswith("A_log"):
            param.uniform_(-2.0, 1.0)


model_dir = model_dir_fixture("qwen3_5_moe_text", qwen35_config, tweak=_randomise_norms_and_decays)
case = case_fixture(["tiny", "hybrid", "simple"])


class TestQwen35MoeFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case, num_moe_blocks = (
        "qwen3_5_moe_text",
        Qwen35Moe,
        GatedSharedExpertMoE,
        "hybrid",
        4,
    )
    unknown_key = "model.layers.0.linear_attn.foo"
    checkpoint_keys = ("mlp.experts.0.gate_proj.weight", "linear_attn.A_log", "mlp.shared_expert_gate.weight")
    hf_keeps_bias_in_fp32 = False  # no selection bias in this family
    # bf16 autocast moves the hybrid model's logits by 0.077 on average; transformers' own bf16 model by 0.083.
    bf16_mean_tolerance = 0.1


def test_configs_read_as_intended(model_dir):
    hybrid = load_pretrained(model_dir("hybrid")).args
    assert [hybrid.is_linear_layer(i) for i in range(4)] == [True, True, False, True]
    assert hybrid.rope.rotary_dim(hybrid.head_dim) == 8 and hybrid.attention_bias  # Qwen3.5 rotates 1/4 of a head
    tiny = load_pretrained(model_dir("tiny")).args
    assert tiny.layer_types == ("linear_attention", "full_attention")
    assert load_pretrained(model_dir("simple")).lm_head is None


@pytest.mark.parametrize("name", ["hybrid", "simple"])
def test_rows_of_several_chunks_match_samples_alone_and_transformers(model_dir, name):
    """150 tokens (3 chunks of 64): samples that start mid-chunk, cross a chunk edge, and start exactly on one. Against
    transformers sample by sample, the bound is float32's own error here: random norms and strong decays make a few
    tokens ill-conditioned (both models err by ~1e-4 there against a float64 run of ours), so ours must stay within
    twice transformers' distance to float64 (and within 1e-4 of transformers past that token)."""
    import copy

    from transformers import AutoModelForCausalLM

    ours = load_pretrained(model_dir(name)).eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dir(name), dtype=torch.float32).eval()
    exact = copy.deepcopy(ours).double()
    exact.set_grouped_mm(False)  # torch._grouped_mm has no float64 kernel
    lengths = [50, 14, 70, 16]  # the third sample starts at token 64, a chunk's first
    samples = [random_ids(700, 1, n, seed=i + 30, low=3) for i, n in enumerate(lengths)]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(torch.cat(samples, dim=1), position_ids_BT)
        alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
        hf_alone = torch.cat([hf(input_ids=s).logits for s in samples], dim=1)
        exact_alone = torch.cat([exact(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
        whole = torch.cat(samples, dim=1)
        one_row, hf_one_row = ours(whole, torch.arange(150)[None]), hf(input_ids=whole).logits
        exact_one_row = exact(whole, torch.arange(150)[None])
    assert max_diff(packed, alone) <= 1e-5
    assert max_diff(packed.double(), exact_alone) <= 2 * max_diff(hf_alone.double(), exact_alone)
    # one sample: the state carried across chunks
    assert max_diff(one_row.double(), exact_one_row) <= 2 * max_diff(hf_one_row.double(), exact_one_row)
    assert max_diff(one_row[:, 64:], hf_one_row[:, 64:]) <= 1e-4  # past the ill-conditioned token (index 31)
    assert max_diff(one_row[:, 50:], hf_alone[:, 50:]) > 1e-2


def _delta_inputs(T: int, H: int = 3, K: int = 8, V: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, T, H, K, generator=g), torch.randn(2, T, H, K, generator=g)
    v = torch.randn(2, T, H, V, generator=g)
    decay = -torch.rand(2, T, H, generator=g) * 0.5
    beta = torch.rand(2, T, H, generator=g)
    return q, k, v, decay, beta


def test_chunked_delta_rule_equals_the_recurrence_with_resets():
    """Rows of different packings (samples ending mid-chunk, on a chunk edge, one-token samples), chunk sizes that do
    and do not divide the row; the chunked form matches the token loop, and a packed sample its run alone."""
    T = 40
    q, k, v, decay, beta = _delta_inputs(T)
    lengths = [[7, 1, 16, 9, 7], [40]]
    position_ids_BT = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    want = recurrent_gated_delta_rule(q, k, v, decay, beta, position_ids_BT)
    for chunk_size in (8, 16, 64):
        got = chunk_gated_delta_rule(q, k, v, decay, beta, position_ids_BT, chunk_size=chunk_size)
        assert max_diff(got, want) <= 1e-5, chunk_size
    start, n = 24, 9  # row 0's fourth sample, alone
    alone = chunk_gated_delta_rule(
        *(x[:1, start : start + n] for x in (q, k, v, decay, beta)), torch.arange(n)[None], chunk_size=8
    )
    assert max_diff(alone, want[:1, start : start + n]) <= 1e-5
    assert max_diff(want[0, 24:], want[1, 24:]) > 1e-2  # the resets matter


def test_delta_rule_gradients_equal_the_recurrence():
    q, k, v, decay, beta = (x.requires_grad_() for x in _delta_inputs(20, seed=1))
    position_ids_BT = torch.cat([torch.arange(6), torch.arange(14)]).expand(2, 20)
    weights = torch.randn(2, 20, 3, 5)
    grads = []
    for fn in (recurrent_gated_delta_rule, lambda *a: chunk_gated_delta_rule(*a, chunk_size=8)):
        (fn(q, k, v, decay, beta, position_ids_BT) * weights).sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v, decay, beta)])
        for x in (q, k, v, decay, beta):
            x.grad = None
    assert all(max_diff(a, b) <= 1e-5 for a, b in zip(*grads, strict=True))


def test_delta_rule_op_passes_torch_opcheck():
    """The custom op's fake kernel, schema and autograd registration agree with its implementation."""
    from slipstream.models.qwen3_5_moe.delta_rule import _delta_rule_op, sample_starts

    q, k, v, decay, beta = (x.transpose(1, 2).contiguous().requires_grad_() for x in _delta_inputs(12, seed=2))
    starts_BT = sample_starts(torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12))
    # Not test_aot_dispatch_dynamic (16 s of compiling): test_compile_moe.py compiles the op inside the model.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(_delta_rule_op, (q, k, v, decay, beta, starts_BT, 8), test_utils=checks)


def test_conv_never_reaches_across_a_sample():
    x_BTX, weight_XW = torch.randn(1, 12, 6), torch.randn(6, 4)
    position_ids_BT = torch.cat([torch.arange(5), torch.arange(2), torch.arange(5)])[None]
    packed = packed_causal_conv1d(x_BTX, weight_XW, position_ids_BT)
    pieces = [(0, 5), (5, 7), (7, 12)]
    alone = torch.cat([packed_causal_conv1d(x_BTX[:, a:b], weight_XW, torch.arange(b - a)[None]) for a, b in pieces], 1)
    reference = torch.nn.functional.conv1d(x_BTX[:, :5].transpose(1, 2), weight_XW[:, None], padding=3, groups=6)
    assert max_diff(packed, alone) <= 1e-6
    assert max_diff(packed[:, :5], torch.nn.functional.silu(reference[..., :5]).transpose(1, 2)) <= 1e-6


def test_context_parallelism_and_prefix_trees_are_refused(model_dir):
    ours = load_pretrained(model_dir("tiny"))
    assert ours.supports_context_parallel is False and ours.supports_prefix_trees is False
    input_ids_BT, position_ids_BT = random_ids(512, 1, 8, low=3), torch.arange(8)[None]
    shard = ContextShard(torch.arange(16)[None], 0, lambda x: torch.cat([x, x], dim=1))
    with pytest.raises(ValueError, match="context parallelism.*trainer.parallel.cp = 1"):
        ours.forward_hidden(input_ids_BT, position_ids_BT, shard)
    tree_BT = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4]])  # a branch forked at position 2
    with pytest.raises(ValueError, match="prefix-tree.*shared_prefix = false"):
        ours.forward_hidden(input_ids_BT, tree_BT)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(layer_types=["linear_attention", "sliding_attention"]), "sliding-window"),
        (dict(layer_types=["linear_attention", "mamba"]), "layer_types"),
        (dict(linear_num_value_heads=4), "multiple of linear_num_key_heads"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type 'yarn'"),
    ],
)
def test_unsupported_variants_are_rejected_at_load(override, match):
    config = qwen35_config("simple")
    for key, value in override.items():  # past the config's own checks, as an edited config.json could be
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=match):
        Qwen35MoeArgs.from_hf_config(config)


def test_lora_adapts_attention_and_experts_and_starts_as_the_base_model(model_dir):
    """The default LoRA targets reach the full-attention projections, the shared expert and the routed experts (the
    linear-attention projections only when named); B = 0 is the base model and only adapters get gradients. (tests/
    unit/test_lora.py's peft comparison does not apply: peft 0.21 converts no expert adapters for this model type.)"""
    from slipstream.config.shared import LoRAConfig
    from slipstream.models.common.lora import LoRAGroupedExperts, apply_lora, is_lora_name

    model = load_pretrained(model_dir("tiny"))
    input_ids_BT, position_ids_BT = random_ids(512, 1, 20, low=3), torch.arange(20)[None]
    with torch.no_grad():
        base = model(input_ids_BT, position_ids_BT)
    lora = LoRAConfig()
    adapted = apply_lora(model, 4, 8.0, 0.0, [*lora.target_modules, "in_proj_qkv", "out_proj"])
    assert {"layers.1.attn.q_proj", "layers.0.mlp.shared_expert.up_proj", "layers.0.attn.in_proj_qkv"} <= set(adapted)
    assert sum(isinstance(m, LoRAGroupedExperts) for m in model.modules()) == 2
    with torch.no_grad():
        assert torch.equal(model(input_ids_BT, position_ids_BT), base)
    model(input_ids_BT, position_ids_BT).logsumexp(-1).mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(n) for n in trainable)
    assert all((p.grad is not None) == (n in trainable) for n, p in model.named_parameters())


def test_the_vlm_type_runs_in_transformers_and_its_text_part_reads_as_ours():
    """`qwen3_5_moe` (the Hub checkpoints' type: a vision encoder + this text model) is not registered: "auto" picks
    transformers for it, "custom" says which type is ours; its text config reads into the same arguments."""
    from transformers import Qwen3_5MoeConfig

    from slipstream.models.registry import resolve_impl

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    vlm = Qwen3_5MoeConfig(text_config=qwen35_config("simple").to_dict(), vision_config=vision)
    assert Qwen35MoeArgs.from_hf_config(vlm) == Qwen35MoeArgs.from_hf_config(qwen35_config("simple"))
    assert resolve_impl("qwen3_5_moe", "auto") == "hf" and resolve_impl("qwen3_5_moe_text", "auto") == "custom"
    with pytest.raises(ValueError, match="qwen3_5_moe_text"):
        resolve_impl("qwen3_5_moe", "custom")
