"""Our GLM-4.5 MoE (glm4_moe) against transformers (CPU, float32): logits on three configs (the tiny fixture, a
feature-rich one: dense first layer, 2 shared experts, 4 expert groups of which 2 are kept, partial RoPE, q/k norm,
q/k/v biases, a random selection bias; a simple one: full RoPE, one group, no norm of the top-k, tied head), packed
rows, bit-exact weight round trips, gradients, the sigmoid group-limited router, router replay, the registry, and
weight publishing against save_pretrained."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Glm4MoeConfig,
    PreTrainedModel,
    Qwen3Config,
)
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from slipstream.models.common.moe_routing import GroupLimitedSigmoidRouter, SharedExpertMoE
from slipstream.models.glm4_moe.model import Glm4Moe
from slipstream.models.qwen3.args import Qwen3Args
from slipstream.models.registry import (
    MODEL_SPECS,
    build_model,
    export_hf_state_dict,
    load_pretrained,
    read_safetensors,
    resolve_impl,
)

ATOL = 1e-4
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


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            if case == "tiny":
                built[case] = tiny_model_factory("glm4_moe")
            else:
                torch.manual_seed(1)
                hf = AutoModelForCausalLM.from_config(glm_config(case), dtype=torch.float32)
                with torch.no_grad():  # transformers inits the selection bias at 0: make it matter
                    for name, buffer in hf.named_buffers():
                        if name.endswith("e_score_correction_bias"):
                            buffer.normal_(0.0, 0.1)
                built[case] = tmp_path_factory.mktemp(case)
                hf.save_pretrained(built[case])
        return built[case]

    return get


@pytest.fixture(scope="module", params=["tiny", "full", "simple"])
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


def test_logits_match_transformers(case):
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 40)
    with torch.no_grad():
        logits = ours(input_ids_BT, torch.arange(40).expand(2, 40))
        expected = hf(input_ids=input_ids_BT).logits
    diff = max_diff(logits, expected)
    print(f"glm4_moe {name}: max |logits diff| {diff:.2e} (max |logit| {expected.abs().max().item():.2f})")
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
    spec = MODEL_SPECS["glm4_moe"]
    hf_sd = read_safetensors(path)
    assert any(k.endswith("mlp.gate.e_score_correction_bias") for k in hf_sd)
    assert any(k.endswith("mlp.experts.0.gate_proj.weight") for k in hf_sd)  # per expert in the checkpoint
    back = spec.to_hf(spec.from_hf(hf_sd, ours.args), ours.args)
    assert sorted(back) == sorted(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) and back[k].dtype == hf_sd[k].dtype for k in hf_sd), name
    exported = export_hf_state_dict(ours)  # through the loaded model's parameters and buffers
    assert sorted(exported) == sorted(hf_sd) and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
    # transformers' in-memory layout (experts fused into gate_up_proj; tied head listed twice) converts the same
    in_memory = hf.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in in_memory)
    from_memory, from_file = spec.from_hf(in_memory, ours.args), spec.from_hf(hf_sd, ours.args)
    assert sorted(from_memory) == sorted(from_file)
    assert all(torch.equal(from_memory[k], from_file[k]) for k in from_file)


def test_multi_token_prediction_layers_are_dropped_on_import(model_dir):
    path = model_dir("tiny")
    args = load_pretrained(path).args
    hf_sd = read_safetensors(path)
    mtp = {k.replace("model.layers.2.", f"model.layers.{args.num_layers}.", 1): v for k, v in hf_sd.items()}
    mtp = {k: v for k, v in mtp.items() if f"layers.{args.num_layers}." in k}
    mtp[f"model.layers.{args.num_layers}.eh_proj.weight"] = torch.zeros(4, 4)
    ours = MODEL_SPECS["glm4_moe"].from_hf({**hf_sd, **mtp}, args)
    assert ours.keys() == MODEL_SPECS["glm4_moe"].from_hf(hf_sd, args).keys()
    with pytest.raises(ValueError, match="unexpected"):  # anything else unknown is still an error
        MODEL_SPECS["glm4_moe"].from_hf({**hf_sd, "model.layers.0.mlp.gate.weight": torch.zeros(1)}, args)


def test_gradients_reach_every_parameter_and_match_transformers(case):
    name, _, ours, hf = case
    input_ids_BT = random_ids(ours.args.vocab_size, 2, 48, seed=3)
    targets = random_ids(ours.args.vocab_size, 2 * 48, seed=4)
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    F.cross_entropy(ours(input_ids_BT, torch.arange(48).expand(2, 48)).flatten(0, 1), targets).backward()
    F.cross_entropy(hf(input_ids=input_ids_BT).logits.flatten(0, 1), targets).backward()
    hf_grads = MODEL_SPECS["glm4_moe"].from_hf({k: p.grad for k, p in hf.named_parameters()}, ours.args)
    worst = 0.0
    for key, param in ours.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, f"{name}: no gradient for {key}"
        worst = max(worst, max_diff(param.grad, hf_grads[key]))
        assert max_diff(param.grad, hf_grads[key]) <= ATOL, f"{name}: gradient of {key}"
    print(f"glm4_moe {name}: max |grad diff| {worst:.2e}")
    assert not any("e_score_correction_bias" in k for k, _ in ours.named_parameters())  # a buffer, not trained
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)


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
    assert ours.replay_counts.tolist()[0] == 3
    # gradients reach the router through the replayed experts' scores
    ours.weight.grad = None
    ours(x_ND, replay_NA)[2][:, 0].sum().backward()
    assert ours.weight.grad is not None and ours.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("replay_own", [True, False])
def test_model_replays_per_moe_block(model_dir, replay_own):
    model = load_pretrained(model_dir("tiny"), impl="custom").eval()
    input_ids_BT, position_ids_BT = random_ids(500, 1, 12), torch.arange(12)[None]
    moes = [m for m in model.modules() if isinstance(m, SharedExpertMoE)]
    own = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: own.append(out[1].clone())) for m in moes]
    with torch.no_grad():
        h_plain = model.forward_hidden(input_ids_BT, position_ids_BT)
    for hook in hooks:
        hook.remove()
    assert model.num_moe_blocks == len(moes) == 2  # layer 0 is dense
    replay_BTRA = torch.stack(own, dim=1)[None]
    if not replay_own:
        replay_BTRA = (replay_BTRA + 1) % 8
    with torch.no_grad():
        h_replay = model.forward_hidden(input_ids_BT, position_ids_BT, replay_BTRA=replay_BTRA)
    if replay_own:
        assert torch.equal(h_replay, h_plain)
        assert all(m.router.replay_counts.tolist() == [12, 12] for m in moes)
    else:
        assert not torch.allclose(h_replay, h_plain, atol=1e-3)


def test_moe_stats_grouped_mm_and_bf16_autocast(model_dir):
    ours = load_pretrained(model_dir("full"), impl="custom")
    input_ids_BT, position_ids_BT = random_ids(700, 2, 30, seed=5), torch.arange(30).expand(2, 30)
    _, aux_loss_L = ours.forward_with_aux_loss(input_ids_BT, position_ids_BT)
    stats = ours.moe_stats()
    assert stats.tokens_per_expert_LE.shape == (3, 16) and (stats.tokens_per_expert_LE.sum(1) == 60 * 4).all()
    assert aux_loss_L.shape == (3,) and aux_loss_L.requires_grad and torch.equal(stats.aux_loss_L, aux_loss_L.detach())
    results = []
    for grouped in (False, True):
        ours.set_grouped_mm(grouped)
        ours.zero_grad(set_to_none=True)
        logits = ours(input_ids_BT, position_ids_BT)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).mean().backward()
        results.append((logits.detach(), {k: p.grad.clone() for k, p in ours.named_parameters()}))
    (loop_logits, loop_grads), (gmm_logits, gmm_grads) = results
    assert max_diff(loop_logits, gmm_logits) <= 1e-5 and all(
        max_diff(loop_grads[k], gmm_grads[k]) <= 1e-5 for k in loop_grads
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ours(input_ids_BT, position_ids_BT)
    # bf16 flips a few routing choices (so a few tokens differ more): compare the mean
    assert logits.dtype == torch.bfloat16 and (logits.float() - gmm_logits).abs().mean() <= 0.05


def test_registry_picks_the_custom_model(model_dir):
    path = model_dir("tiny")
    config = AutoConfig.from_pretrained(path)
    assert resolve_impl("glm4_moe", "auto") == "custom"
    for impl in ("auto", "custom"):
        model = build_model(config, impl)
        assert type(model) is Glm4Moe and all(torch.isfinite(t).all() for t in model.state_dict().values())
    assert type(load_pretrained(path)) is Glm4Moe
    assert isinstance(build_model(config, "hf"), PreTrainedModel)
    with torch.device("meta"):  # how large models are built: the buffer comes from the checkpoint
        meta = build_model(config)
    meta.load_state_dict(load_pretrained(path).state_dict(), strict=True, assign=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_published_weights_equal_save_pretrained(model_dir, tmp_path, dtype):
    """The trainer's weight stream (trainer/weight_export.py, names from to_hf on meta tensors) writes what
    transformers' save_pretrained writes for the same weights: names, shapes and values (cast to the published
    dtype, except e_score_correction_bias, which transformers keeps in float32 and so do we)."""
    from safetensors.torch import load_file

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
    # Published dtypes are those transformers itself keeps in a model of that dtype (the selection bias in float32).
    kept = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
    biases = [k for k in kept if k.endswith("e_score_correction_bias")]
    assert biases and all(kept[k].dtype == torch.float32 for k in biases)
    for name, tensor in want.items():
        expected = torch.float32 if name.endswith("e_score_correction_bias") else dtype
        assert got[name].dtype == expected and torch.equal(got[name], tensor.to(expected)), name
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = random_ids(500, 1, 16)
    with torch.no_grad():
        diff = max_diff(reloaded(input_ids=ids).logits, hf.eval()(input_ids=ids).logits)
    assert diff <= (ATOL if dtype == torch.float32 else 0.5)


def test_shared_expert_moe_layer_compiles_without_graph_break():
    moe = SharedExpertMoE(
        32, 16, 8, 2, True, shared_hidden_dim=16, num_groups=4, topk_groups=2, routed_scaling_factor=2.5
    )
    moe.init_weights(0.1)
    moe.router.e_score_correction_bias.normal_(0.0, 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(moe)(torch.randn(2, 10, 32))
    assert explanation.graph_break_count == 0, [r.reason for r in explanation.break_reasons]
