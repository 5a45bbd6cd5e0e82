"""Our Llama / Qwen3 / Qwen3-MoE modules against transformers: logits, packed rows, weight round trips, gradients,
MoE statistics and the registry (CPU, float32)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from slipstream.models.common.attention import build_packed_causal_mask
from slipstream.models.common.moe import TopKRouter
from slipstream.models.llama.model import Llama
from slipstream.models.qwen3.args import Qwen3Args
from slipstream.models.qwen3.model import Qwen3
from slipstream.models.qwen3_moe.model import Qwen3Moe
from slipstream.models.registry import (
    MODEL_SPECS,
    build_model,
    export_hf_state_dict,
    load_pretrained,
    read_safetensors,
)
from tests.unit.moe_family_helpers import check_grouped_mm_matches_loop

ATOL = 1e-4
TINY = ["llama", "qwen3", "qwen3_moe"]
BIG = ["llama-big", "qwen3-big", "qwen3_moe-big"]
COMMON = dict(max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None, eos_token_id=2)


def big_config(case: str):
    """Bigger random configs covering what the tiny fixtures do not: biases, llama3/linear RoPE scaling, tied Qwen3,
    top-k without renormalisation, mixed dense/MoE layers, head_dim != hidden / heads."""
    shape = dict(hidden_size=192, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=48)
    if case == "llama-big":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
        return LlamaConfig(**COMMON, **shape, vocab_size=700, intermediate_size=320, attention_bias=True,
                           mlp_bias=True, tie_word_embeddings=False, pad_token_id=3, rope_parameters=rope)  # fmt: skip
    if case == "qwen3-big":
        rope = {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}
        return Qwen3Config(**COMMON, **shape, vocab_size=700, intermediate_size=320, attention_bias=True,
                           tie_word_embeddings=True, pad_token_id=0, rope_parameters=rope)  # fmt: skip
    return Qwen3MoeConfig(**COMMON, **shape, vocab_size=700, intermediate_size=320, tie_word_embeddings=False,
                          pad_token_id=0, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96,
                          norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1])  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            if case in TINY:
                built[case] = tiny_model_factory(case)
            else:
                torch.manual_seed(1)
                hf = AutoModelForCausalLM.from_config(big_config(case), dtype=torch.float32)
                built[case] = tmp_path_factory.mktemp(case)
                hf.save_pretrained(built[case])
        return built[case]

    return get


@pytest.fixture(scope="module", params=TINY + BIG)
def case(request, model_dir):
    """(name, folder, ours, transformers) for one model; ours loaded through the registry and adapter."""
    path = model_dir(request.param)
    ours = load_pretrained(path, impl="custom").eval()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, ours, hf


def random_ids(vocab_size: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_logits_match_transformers(case):
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 40)
    position_ids_BT = torch.arange(40).expand(2, 40)
    with torch.no_grad():
        logits = ours(input_ids_BT, position_ids_BT)
        expected = hf(input_ids=input_ids_BT).logits
        hidden = ours.forward_hidden(input_ids_BT, position_ids_BT)
    assert max_diff(logits, expected) <= ATOL, name
    assert torch.equal(ours.logits(hidden), logits)


def test_packed_row_matches_samples_run_alone(case):
    name, _, ours, hf = case
    lengths = [9, 17, 12]
    samples = [random_ids(ours.args.vocab_size, 1, n, seed=i + 10) for i, n in enumerate(lengths)]
    input_ids_BT = torch.cat(samples, dim=1)
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(input_ids_BT, position_ids_BT)
        alone = torch.cat([hf(input_ids=s).logits for s in samples], dim=1)
        unpacked = ours(input_ids_BT, torch.arange(sum(lengths))[None])
    assert max_diff(packed, alone) <= ATOL, name
    assert max_diff(unpacked[:, lengths[0] :], alone[:, lengths[0] :]) > 1e-2  # the sample boundaries do matter


def test_state_dict_round_trip_is_bit_exact(case):
    name, path, ours, hf = case
    spec = MODEL_SPECS[hf.config.model_type]
    hf_sd = read_safetensors(path)
    back = spec.to_hf(spec.from_hf(hf_sd, ours.args), ours.args)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) and back[k].dtype == hf_sd[k].dtype for k in hf_sd), name
    exported = export_hf_state_dict(ours)  # through the loaded model's parameters
    assert sorted(exported) == sorted(hf_sd) and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
    # transformers' in-memory layout (tied head listed twice; 5.x MoE experts fused) converts to the same weights
    from_memory, from_file = spec.from_hf(hf.state_dict(), ours.args), spec.from_hf(hf_sd, ours.args)
    assert sorted(from_memory) == sorted(from_file) and all(
        torch.equal(from_memory[k], from_file[k]) for k in from_file
    )


def test_gradients_reach_every_parameter_and_match_transformers(case):
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 48, seed=3)
    targets = random_ids(ours.args.vocab_size, 2 * 48, seed=4)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    F.cross_entropy(ours(input_ids_BT, torch.arange(48).expand(2, 48)).flatten(0, 1), targets).backward()
    F.cross_entropy(hf(input_ids=input_ids_BT).logits.flatten(0, 1), targets).backward()
    spec = MODEL_SPECS[hf.config.model_type]
    hf_grads = spec.from_hf({k: p.grad for k, p in hf.named_parameters()}, ours.args)
    for key, param in ours.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"{name}: no gradient for {key}"
        assert max_diff(param.grad, hf_grads[key]) <= ATOL, f"{name}: gradient of {key}"
        if ".experts." in key:  # every expert got tokens, so every expert slice gets a gradient
            assert (param.grad.flatten(1).abs().sum(1) > 0).all(), f"{name}: an expert of {key} has no gradient"
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_moe-big"])
def test_moe_stats_match_transformers_aux_loss(name, model_dir):
    path = model_dir(name)
    ours = load_pretrained(path, impl="custom")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 30, seed=5)
    logits, aux_loss_L = ours.forward_with_aux_loss(input_ids_BT, torch.arange(30).expand(2, 30))
    stats = ours.moe_stats()
    num_moe_layers = sum(ours.args.is_moe_layer(i) for i in range(ours.args.num_layers))
    assert stats.tokens_per_expert_LE.shape == (num_moe_layers, ours.args.num_experts)
    assert (stats.tokens_per_expert_LE.sum(1) == 60 * ours.args.num_experts_per_tok).all()
    assert aux_loss_L.requires_grad and aux_loss_L.shape == (num_moe_layers,)
    assert torch.equal(stats.aux_loss_L, aux_loss_L.detach())
    # nothing left on the modules holds an autograd graph
    kept = [t for m in ours.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]
    assert kept and not any(t.requires_grad for t in kept)
    aux_loss_L.sum().backward()
    assert all(m.router.weight.grad.abs().sum() > 0 for m in ours.modules() if hasattr(m, "router"))
    hf_aux = hf(input_ids=input_ids_BT, output_router_logits=True).aux_loss
    assert abs(stats.global_aux_loss().item() - hf_aux.item()) <= 1e-5


def test_grouped_mm_path_matches_expert_loop(model_dir):
    ours = load_pretrained(model_dir("qwen3_moe-big"), impl="custom")
    input_ids_BT, position_ids_BT = random_ids(700, 2, 32, seed=6), torch.arange(32).expand(2, 32)
    check_grouped_mm_matches_loop(ours, input_ids_BT, position_ids_BT)


@pytest.mark.parametrize("family", TINY)
def test_forward_backward_under_bf16_autocast(family, model_dir):
    """The trainer's mixed precision is torch.autocast over float32 parameters (trainer/logprobs.py)."""
    ours = load_pretrained(model_dir(family), impl="custom")
    input_ids_BT, position_ids_BT = random_ids(ours.args.vocab_size, 1, 24, seed=7), torch.arange(24)[None]
    with torch.no_grad():
        reference = ours(input_ids_BT, position_ids_BT)
    for grouped in (False, True) if family == "qwen3_moe" else (False,):
        if family == "qwen3_moe":
            ours.set_grouped_mm(grouped)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ours(input_ids_BT, position_ids_BT)
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
        per_token_T = (logits.float() - reference).abs().amax(-1)[0]
        close_T = per_token_T <= 0.1 * reference.abs().max().item()
        # bf16 rounding can flip a near-tie token's top-k experts in a later MoE layer: that token's logits then
        # differ by more; a MoE family may have one such token of 24 here, a dense one none.
        assert int((~close_T).sum()) <= (1 if "moe" in family else 0), per_token_T
        logits.float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None for p in ours.parameters())


def test_router_logits_stay_float32_under_autocast():
    router = TopKRouter(dim=16, num_experts=4, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        probs_NE, expert_ids_NA, weights_NA = router(torch.randn(5, 16))
    assert probs_NE.dtype == weights_NA.dtype == torch.float32
    assert expert_ids_NA.shape == (5, 2) and torch.allclose(weights_NA.sum(-1), torch.ones(5))


def test_packed_causal_mask_is_block_diagonal():
    mask = build_packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))[0, 0].int()
    expected = torch.tensor(
        [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
         [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    )  # fmt: skip
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    ("family", "cls"), [("llama", Llama), ("qwen3", Qwen3), ("qwen3_moe", Qwen3Moe)]
)  # fmt: skip
def test_registry_selects_custom_or_transformers(family, cls, model_dir):
    from transformers import AutoConfig, PreTrainedModel

    path = model_dir(family)
    config = AutoConfig.from_pretrained(path)
    for impl in ("auto", "custom"):
        model = build_model(config, impl)
        assert type(model) is cls
        assert all(torch.isfinite(p).all() for p in model.parameters())  # fresh init, nothing left uninitialised
    assert isinstance(build_model(config, "hf"), PreTrainedModel)
    assert type(load_pretrained(path)) is cls
    hf = load_pretrained(path, impl="hf")
    assert isinstance(hf, PreTrainedModel)
    with pytest.raises(ValueError, match="not a custom Slipstream model"):
        export_hf_state_dict(hf)


def test_registry_unregistered_type_and_bad_impl():
    from transformers import GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    assert isinstance(build_model(config, "auto"), GPT2LMHeadModel)
    assert isinstance(build_model(config, "hf"), GPT2LMHeadModel)
    supported = (
        "afmoe, glm4_moe, glm_moe_dsa, gpt_oss, laguna, llama, minimax_m2, "
        "nemotron_h, qwen3, qwen3_5_moe_text, qwen3_moe"
    )
    with pytest.raises(ValueError, match=rf"model_type 'gpt2' \(supported: {supported}\)"):
        build_model(config, "custom")
    with pytest.raises(ValueError, match="unknown model impl 'fast'"):
        build_model(config, "fast")


def test_unsupported_configs_and_mismatched_tied_head_are_rejected():
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16)  # fmt: skip
    with pytest.raises(ValueError, match="sliding-window"):
        Qwen3Args.from_hf_config(Qwen3Config(**base, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        Qwen3Args.from_hf_config(
            Qwen3Config(**base, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
        )
    args = Qwen3Args.from_hf_config(Qwen3Config(**base, tie_word_embeddings=True))
    hf_sd = export_hf_state_dict(Qwen3(args))
    hf_sd["lm_head.weight"] = hf_sd["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings=True but lm_head.weight differs"):
        MODEL_SPECS["qwen3"].from_hf(hf_sd, args)
