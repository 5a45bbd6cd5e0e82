"""Our MiniMax-M2 (minimax_m2) against transformers (CPU, float32): logits and gradients on two configs (the tiny
fixture: partial RoPE 0.5, 8 experts top 2; a wider one: 16 experts top 4, partial RoPE 0.25, tied head, a padding
id), packed rows, bit-exact weight round trips (checkpoint and in-memory layouts), the full-width q/k norm, router
replay per MoE block, the registry and the config features we reject."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, MiniMaxM2Config, PreTrainedModel

from slipstream.models.minimax_m2.args import MiniMaxM2Args
from slipstream.models.minimax_m2.model import MiniMaxM2, SigmoidMoE
from slipstream.models.registry import (
    MODEL_SPECS,
    build_model,
    export_hf_state_dict,
    load_pretrained,
    read_safetensors,
    resolve_impl,
)

ATOL = 1e-4


def wide_config(**overrides) -> MiniMaxM2Config:
    fields = dict(vocab_size=700, hidden_size=96, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=32, rotary_dim=8, num_local_experts=16, num_experts_per_tok=4,
                  max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1, bos_token_id=None,
                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)  # fmt: skip
    return MiniMaxM2Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            if case == "tiny":
                built[case] = tiny_model_factory("minimax_m2")
            else:
                torch.manual_seed(1)
                hf = AutoModelForCausalLM.from_config(wide_config(), dtype=torch.float32)
                with torch.no_grad():  # transformers inits the selection bias at 0: make it matter
                    for name, buffer in hf.named_buffers():
                        if name.endswith("e_score_correction_bias"):
                            buffer.normal_(0.0, 0.1)
                    for name, param in hf.named_parameters():  # non-trivial q/k norm weights
                        if name.endswith(("q_norm.weight", "k_norm.weight")):
                            param.uniform_(0.5, 1.5)
                built[case] = tmp_path_factory.mktemp(case)
                hf.save_pretrained(built[case])
        return built[case]

    return get


@pytest.fixture(scope="module", params=["tiny", "wide"])
def case(request, model_dir):
    path = model_dir(request.param)
    ours = load_pretrained(path, impl="custom").eval()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, path, ours, hf


def random_ids(vocab_size: int, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


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


def test_logits_match_transformers(case):
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 40)
    with torch.no_grad():
        logits = ours(input_ids_BT, torch.arange(40).expand(2, 40))
        expected = hf(input_ids=input_ids_BT).logits
    diff = max_diff(logits, expected)
    print(f"minimax_m2 {name}: max |logits diff| {diff:.2e} (max |logit| {expected.abs().max().item():.2f})")
    assert diff <= ATOL, name


def test_packed_row_matches_samples_run_alone(case):
    name, _, ours, hf = case
    lengths = [9, 17, 12]
    samples = [random_ids(ours.args.vocab_size, 1, n, seed=i + 10) for i, n in enumerate(lengths)]
    input_ids_BT = torch.cat(samples, dim=1)
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = ours(input_ids_BT, position_ids_BT)
        ours_alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
        hf_alone = torch.cat([hf(input_ids=s).logits for s in samples], dim=1)
        unpacked = ours(input_ids_BT, torch.arange(sum(lengths))[None])
    assert max_diff(packed, ours_alone) <= 1e-5, name
    assert max_diff(packed, hf_alone) <= ATOL, name
    assert max_diff(unpacked[:, lengths[0] :], hf_alone[:, lengths[0] :]) > 1e-2  # the sample boundaries do matter


def test_state_dict_round_trip_is_bit_exact(case):
    name, path, ours, hf = case
    spec = MODEL_SPECS["minimax_m2"]
    hf_sd = read_safetensors(path)
    assert any(k.endswith("block_sparse_moe.e_score_correction_bias") for k in hf_sd)
    assert any(k.endswith("block_sparse_moe.experts.0.w1.weight") for k in hf_sd)  # per expert in the checkpoint
    back = spec.to_hf(spec.from_hf(hf_sd, ours.args), ours.args)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) and back[k].dtype == hf_sd[k].dtype for k in hf_sd), name
    exported = export_hf_state_dict(ours)  # through the loaded model's parameters and buffers
    assert sorted(exported) == sorted(hf_sd) and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
    # transformers' in-memory layout (`mlp`, experts fused into gate_up_proj; tied head listed twice) converts the same
    in_memory = hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in in_memory)
    from_memory, from_file = spec.from_hf(in_memory, ours.args), spec.from_hf(hf_sd, ours.args)
    assert sorted(from_memory) == sorted(from_file)
    assert all(torch.equal(from_memory[k], from_file[k]) for k in from_file)


def test_multi_token_prediction_modules_are_dropped_on_import(model_dir):
    path = model_dir("tiny")
    args = load_pretrained(path).args
    hf_sd = read_safetensors(path)
    mtp = {f"model.layers.{args.num_layers}.self_attn.q_proj.weight": torch.zeros(4, 4)}
    spec = MODEL_SPECS["minimax_m2"]
    assert spec.from_hf({**hf_sd, **mtp}, args).keys() == spec.from_hf(hf_sd, args).keys()
    with pytest.raises(ValueError, match="unexpected"):  # anything else unknown is still an error
        spec.from_hf({**hf_sd, "model.layers.0.block_sparse_moe.foo": torch.zeros(1)}, args)


def test_gradients_reach_every_parameter_and_match_transformers(case):
    """Per token: a few tokens whose top-k is a near tie could route differently in the two models; the losses of
    the tokens compared are those whose routing agrees (all of them here, checked), so gradients are comparable."""
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 48, seed=3)
    targets = random_ids(ours.args.vocab_size, 2 * 48, seed=4)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    logits = ours(input_ids_BT, torch.arange(48).expand(2, 48))
    expected = hf(input_ids=input_ids_BT).logits
    per_token = (logits - expected).abs().amax(-1).flatten()
    assert (per_token <= ATOL).all(), f"{name}: tokens {torch.nonzero(per_token > ATOL).flatten().tolist()} differ"
    F.cross_entropy(logits.flatten(0, 1), targets).backward()
    F.cross_entropy(expected.flatten(0, 1), targets).backward()
    hf_grads = MODEL_SPECS["minimax_m2"].from_hf({k: p.grad for k, p in hf.named_parameters()}, ours.args)
    worst = 0.0
    for key, param in ours.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"{name}: no gradient for {key}"
        worst = max(worst, max_diff(param.grad, hf_grads[key]))
        assert max_diff(param.grad, hf_grads[key]) <= ATOL, f"{name}: gradient of {key}"
    print(f"minimax_m2 {name}: max |grad diff| {worst:.2e}")
    assert not any("e_score_correction_bias" in k for k, _ in ours.named_parameters())  # a buffer, not trained
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)


@pytest.mark.parametrize("replay_own", [True, False])
def test_model_replays_per_moe_block(model_dir, replay_own):
    model = load_pretrained(model_dir("wide"), impl="custom").eval()
    input_ids_BT, position_ids_BT = random_ids(700, 1, 12), torch.arange(12)[None]
    moes = [m for m in model.modules() if isinstance(m, SigmoidMoE)]
    own = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: own.append(out[1].clone())) for m in moes]
    with torch.no_grad():
        h_plain = model.forward_hidden(input_ids_BT, position_ids_BT)
    for hook in hooks:
        hook.remove()
    assert model.num_moe_blocks == len(moes) == 3  # every layer is an MoE layer
    replay_BTRA = torch.stack(own, dim=1)[None]
    if not replay_own:
        replay_BTRA = (replay_BTRA + 1) % 16
    with torch.no_grad():
        h_replay = model.forward_hidden(input_ids_BT, position_ids_BT, replay_BTRA=replay_BTRA)
    if replay_own:
        assert torch.equal(h_replay, h_plain)
        assert all(m.router.replay_counts.tolist() == [12, 12] for m in moes)
    else:
        assert not torch.allclose(h_replay, h_plain, atol=1e-3)


def test_grouped_mm_matches_the_loop(model_dir):
    ours = load_pretrained(model_dir("wide"), impl="custom")
    input_ids_BT, position_ids_BT = random_ids(700, 2, 30, seed=5), torch.arange(30).expand(2, 30)
    results = []
    for grouped in (False, True):
        ours.set_grouped_mm(grouped)
        ours.zero_grad(set_to_none=True)
        logits = ours(input_ids_BT, position_ids_BT)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).mean().backward()
        results.append((logits.detach(), {k: p.grad.clone() for k, p in ours.named_parameters()}))
    (loop_logits, loop_grads), (gmm_logits, gmm_grads) = results
    assert max_diff(loop_logits, gmm_logits) <= 1e-5
    assert all(max_diff(loop_grads[k], gmm_grads[k]) <= 1e-5 for k in loop_grads)
    stats = ours.moe_stats()
    assert stats.tokens_per_expert_LE.shape == (3, 16) and (stats.tokens_per_expert_LE.sum(1) == 60 * 4).all()


def test_registry_picks_the_custom_model(model_dir):
    path = model_dir("tiny")
    config = AutoConfig.from_pretrained(path)
    assert resolve_impl("minimax_m2", "auto") == "custom"
    for impl in ("auto", "custom"):
        model = build_model(config, impl)
        assert type(model) is MiniMaxM2 and all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert type(load_pretrained(path)) is MiniMaxM2
    assert isinstance(build_model(config, "hf"), PreTrainedModel)
    with torch.device("meta"):  # how large models are built: the buffer comes from the checkpoint
        meta = build_model(config)
    meta.load_state_dict(load_pretrained(path).state_dict(), strict=True, assign=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_published_weights_equal_save_pretrained(model_dir, tmp_path, dtype):
    """The trainer's weight stream writes what save_pretrained writes for the same weights (names, shapes, values
    cast to the published dtype), except that e_score_correction_bias stays float32: a rounded selection bias would
    route differently in inference."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from slipstream.trainer.weights import publish_weights

    path = model_dir("tiny")
    ours = load_pretrained(path, impl="custom")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    probe_ids = tokenizer("hello world, the answer is 42")["input_ids"]
    out = publish_weights(ours, tokenizer, tmp_path, 1, probe_ids, dtype=dtype, source_dir=path, bucket_bytes=200_000)
    got = {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(shard).items()}
    hf.save_pretrained(tmp_path / "reference")
    want = read_safetensors(tmp_path / "reference")
    assert len(list(out.glob("*.safetensors"))) > 1 and got.keys() == want.keys()
    for name, tensor in want.items():
        expected = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        assert got[name].dtype == expected and torch.equal(got[name], tensor.to(expected)), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = random_ids(500, 1, 16)
    with torch.no_grad():
        diff = max_diff(reloaded(input_ids=ids).logits, hf.eval()(input_ids=ids).logits)
    assert diff <= (ATOL if dtype == torch.float32 else 0.5)
