"""Our Nemotron-H (nemotron_h: Mamba2 + NoPE attention + squared-ReLU MLP / MoE blocks) against transformers (CPU,
float32), on three configs: the tiny fixture ([Mamba, MoE, attention, MLP, MoE]), a hybrid one (6 layers [Mamba, MoE,
attention, MLP, Mamba, MoE], 10 experts top 3 in 2 groups, Mamba and MLP biases, random norms, decays, D and biases)
and a latent one (the MoE's experts in a latent space, one group of Mamba heads, no conv bias, dt clamped). The shared
MoE-family checks (moe_family_helpers.py), plus: rows of many SSD chunks (samples crossing chunk edges) equal each
sample alone and transformers, the chunked scan equals the token-by-token recurrence with state resets (values and
gradients), the conv never reaches across a sample, and context parallelism, prefix trees and unsupported configs are
refused."""

import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from slipstream.models.common.attention import ContextShard
from slipstream.models.nemotron_h.args import NemotronHArgs
from slipstream.models.nemotron_h.layers import NemotronHMoE
from slipstream.models.nemotron_h.model import NemotronH
from slipstream.models.nemotron_h.ssd import chunked_ssd, packed_causal_conv1d, recurrent_ssd
from slipstream.models.registry import MODEL_SPECS, export_hf_state_dict, load_pretrained, read_safetensors
from tests.unit.moe_family_helpers import MoEFamilyChecks, case_fixture, max_diff, model_dir_fixture, random_ids

COMMON = dict(vocab_size=700, hidden_size=64, max_position_embeddings=512, layer_norm_epsilon=1e-6,
              initializer_range=0.1, bos_token_id=None, eos_token_id=2, pad_token_id=0, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)  # fmt: skip


def nemotron_h_config(case: str = "hybrid", **overrides) -> NemotronHConfig:
    if case == "hybrid":
        fields = dict(layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
                      intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2, ssm_state_size=16,
                      conv_kernel=4, chunk_size=16, use_bias=True, mlp_bias=True, n_routed_experts=10,
                      num_experts_per_tok=3, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                      moe_intermediate_size=32, moe_shared_expert_intermediate_size=48)  # fmt: skip
    else:
        fields = dict(layers_block_type=["full_attention", "moe", "linear_attention"], intermediate_size=64,
                      mamba_num_heads=4, mamba_head_dim=12, n_groups=1, ssm_state_size=8, conv_kernel=2,
                      chunk_size=8, use_conv_bias=False, time_step_min=0.05, n_routed_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=24,
                      moe_shared_expert_intermediate_size=40, moe_latent_size=24)  # fmt: skip
    return NemotronHConfig(**{**COMMON, **fields, **overrides})


def _randomise(hf) -> None:
    """transformers inits norms at 1, biases at 0, D at 1 and A alike per layer: vary them so a mix-up shows; dt_bias
    low enough that some steps hit the time_step_min clamp."""
    for name, param in hf.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight")):
            param.uniform_(0.5, 1.5)
        elif name.endswith(".bias"):
            param.normal_(0.0, 0.05)
        elif name.endswith("mixer.D"):
            param.normal_(1.0, 0.5)
        elif name.endswith("dt_bias"):
            param.normal_(-2.5, 1.0)
        elif name.endswith("A_log"):
            param.uniform_(-1.0, 1.5)
        elif name.endswith("gate.weight"):
            param.normal_(0.0, 0.1)


model_dir = model_dir_fixture("nemotron_h", nemotron_h_config, tweak=_randomise)
case = case_fixture(["tiny", "hybrid", "latent"])


class TestNemotronHFamily(MoEFamilyChecks):
    family, model_cls, moe_cls, rich_case, num_moe_blocks = "nemotron_h", NemotronH, NemotronHMoE, "hybrid", 2
    unknown_key = "backbone.layers.0.mixer.foo"
    checkpoint_keys = ("mixer.experts.0.up_proj.weight", "mixer.A_log", "mixer.gate.e_score_correction_bias")

    def test_state_dict_round_trip_is_bit_exact(self, case):
        """As the shared check, for Nemotron-H's layouts: checkpoints under `backbone.` with experts per expert,
        transformers' memory under `model.` with experts stacked (not fused: the experts have no gate)."""
        name, path, ours, hf = case
        spec = MODEL_SPECS[self.family]
        hf_sd = read_safetensors(path)
        assert all(k.startswith(("backbone.", "lm_head.")) for k in hf_sd)
        back = spec.to_hf(spec.from_hf(hf_sd, ours.args), ours.args)
        assert sorted(back) == sorted(hf_sd)
        assert all(torch.equal(back[k], hf_sd[k]) and back[k].dtype == hf_sd[k].dtype for k in hf_sd), name
        exported = export_hf_state_dict(ours)
        assert sorted(exported) == sorted(hf_sd) and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
        in_memory = hf.state_dict()
        assert any(k.endswith("mixer.experts.up_proj") for k in in_memory)
        from_memory, from_file = spec.from_hf(in_memory, ours.args), spec.from_hf(hf_sd, ours.args)
        assert sorted(from_memory) == sorted(from_file)
        assert all(torch.equal(from_memory[k], from_file[k]) for k in from_file)


def test_configs_read_as_intended(model_dir):
    tiny = load_pretrained(model_dir("tiny"))
    assert tiny.args.layer_types == ("linear_attention", "moe", "full_attention", "mlp", "moe")
    assert tiny.num_moe_blocks == 2 and tiny.lm_head is not None and tiny.embed_tokens.padding_idx is None
    hybrid = load_pretrained(model_dir("hybrid")).args
    assert (hybrid.num_groups, hybrid.topk_groups, hybrid.routed_scaling_factor) == (2, 1, 2.5)
    assert hybrid.mamba_bias and hybrid.mlp_bias and hybrid.use_conv_bias and hybrid.moe_latent_size is None
    latent = load_pretrained(model_dir("latent"))
    assert latent.layers[1].mixer.fc1_latent_proj.weight.shape == (24, 64)
    assert latent.layers[1].mixer.experts.up_proj.shape == (8, 24, 24)
    assert latent.layers[2].mixer.conv1d.bias is None and latent.args.time_step_min == 0.05


@pytest.mark.parametrize("name", ["hybrid", "latent"])
def test_rows_of_many_chunks_match_samples_alone_and_transformers(model_dir, name):
    """150 tokens (chunks of 16 / 8 tokens): samples that start mid-chunk, cross chunk edges, and start exactly on
    one; one sample of 150 tokens carries its state through every chunk."""
    ours = load_pretrained(model_dir(name)).eval()
    hf = AutoModelForCausalLM.from_pretrained(model_dir(name), dtype=torch.float32).eval()
    lengths = [50, 14, 70, 16]  # the third sample starts at token 64, a chunk's first
    samples = [random_ids(700, 1, n, seed=i + 30) for i, n in enumerate(lengths)]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    whole = torch.cat(samples, dim=1)
    with torch.no_grad():
        packed = ours(whole, position_ids_BT)
        alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
        hf_alone = torch.cat([hf(input_ids=s).logits for s in samples], dim=1)
        one_row, hf_one_row = ours(whole, torch.arange(150)[None]), hf(input_ids=whole).logits
    assert max_diff(packed, alone) <= 1e-5
    assert max_diff(packed, hf_alone) <= 1e-4
    assert max_diff(one_row, hf_one_row) <= 1e-4
    assert max_diff(one_row[:, 50:], hf_alone[:, 50:]) > 1e-2


def _ssd_inputs(T: int, H: int = 4, P: int = 3, G: int = 2, S: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, H, P, generator=g)
    dt = torch.rand(2, T, H, generator=g) * 0.5 + 0.01
    A = -torch.rand(H, generator=g) * 3
    b, c = torch.randn(2, T, G, S, generator=g), torch.randn(2, T, G, S, generator=g)
    return x, dt, A, b, c, torch.randn(H, generator=g)


def test_chunked_ssd_equals_the_recurrence_with_resets():
    """Rows of different packings (samples ending mid-chunk, on a chunk edge, one-token samples), chunk sizes that do
    and do not divide the row; the chunked form matches the token loop, and a packed sample its run alone."""
    T = 40
    inputs = _ssd_inputs(T)
    lengths = [[7, 1, 16, 9, 7], [40]]
    position_ids_BT = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    want = recurrent_ssd(*inputs, position_ids_BT)
    for chunk_size in (4, 8, 16, 64):
        got = chunked_ssd(*inputs, position_ids_BT, chunk_size)
        assert got.dtype == torch.float32 and max_diff(got.double(), want) <= 1e-5, chunk_size
    start, n = 24, 9  # row 0's fourth sample, alone
    alone = chunked_ssd(*(t[:1, start : start + n] if t.dim() > 1 else t for t in inputs), torch.arange(n)[None], 4)
    assert max_diff(alone.double(), want[:1, start : start + n]) <= 1e-5
    assert max_diff(want[0, 24:], want[1, 24:]) > 1e-2  # the resets matter


def test_chunked_ssd_gradients_equal_the_recurrence():
    inputs = [t.double().requires_grad_() for t in _ssd_inputs(20, seed=1)]
    position_ids_BT = torch.cat([torch.arange(6), torch.arange(14)]).expand(2, 20)
    weights = torch.randn(2, 20, 4, 3, dtype=torch.float64)
    grads = []
    for fn in (recurrent_ssd, lambda *a: chunked_ssd(*a, 8)):
        (fn(*inputs, position_ids_BT) * weights).sum().backward()
        grads.append([t.grad.clone() for t in inputs])
        for t in inputs:
            t.grad = None
    assert all(max_diff(a, b) <= 1e-10 for a, b in zip(*grads, strict=True))


def test_conv_never_reaches_across_a_sample():
    x_BTX, weight_XW, bias_X = torch.randn(1, 12, 6), torch.randn(6, 4), torch.randn(6)
    position_ids_BT = torch.cat([torch.arange(5), torch.arange(2), torch.arange(5)])[None]
    packed = packed_causal_conv1d(x_BTX, weight_XW, bias_X, position_ids_BT)
    pieces = [(0, 5), (5, 7), (7, 12)]
    alone = torch.cat(
        [packed_causal_conv1d(x_BTX[:, a:b], weight_XW, bias_X, torch.arange(b - a)[None]) for a, b in pieces], 1
    )
    reference = torch.nn.functional.conv1d(x_BTX.transpose(1, 2), weight_XW[:, None], bias_X, padding=3, groups=6)
    assert max_diff(packed, alone) <= 1e-6
    assert max_diff(packed[:, :5], torch.nn.functional.silu(reference[..., :5]).transpose(1, 2)) <= 1e-6


def test_context_parallelism_and_prefix_trees_are_refused(model_dir):
    ours = load_pretrained(model_dir("tiny"))
    assert ours.supports_context_parallel is False and ours.supports_prefix_trees is False
    input_ids_BT, position_ids_BT = random_ids(512, 1, 8), torch.arange(8)[None]
    shard = ContextShard(torch.arange(16)[None], 0, lambda x: torch.cat([x, x], dim=1))
    with pytest.raises(ValueError, match="context parallelism.*Mamba2.*trainer.parallel.cp = 1"):
        ours.forward_hidden(input_ids_BT, position_ids_BT, shard)
    tree_BT = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 4]])  # a branch forked at position 2
    with pytest.raises(ValueError, match="prefix-tree.*shared_prefix = false"):
        ours.forward_hidden(input_ids_BT, tree_BT)


def test_trainer_refuses_cp_for_the_family(model_dir):
    from slipstream.parallel.mesh import ParallelDims
    from slipstream.trainer.setup import check_parallel_fits_model

    ours = load_pretrained(model_dir("tiny"))
    check_parallel_fits_model(ParallelDims(1, 2, 1, 2, 2), ours, "custom")  # ep = 2 is fine
    with pytest.raises(ValueError, match="trainer.parallel.cp = 2: NemotronH .* set cp = 1"):
        check_parallel_fits_model(ParallelDims(1, 1, 2, 1, 2), ours, "custom")


def test_multi_token_prediction_weights_are_dropped_on_import(model_dir):
    path = model_dir("tiny")
    args = load_pretrained(path).args
    hf_sd = read_safetensors(path)
    extra = {"mtp.layers.0.mixer.q_proj.weight": torch.zeros(4, 4), "mtp.layers.0.eh_proj.weight": torch.zeros(4, 4)}
    spec = MODEL_SPECS["nemotron_h"]
    assert spec.from_hf({**hf_sd, **extra}, args).keys() == spec.from_hf(hf_sd, args).keys()


@pytest.mark.parametrize(
    ("override", "match"),
    [
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act"),
        (dict(layers_block_type=["linear_attention", "mamba"]), "layers_block_type"),
        (dict(n_groups=3), "n_groups"),
    ],
)
def test_unsupported_variants_are_rejected_at_load(override, match):
    config = nemotron_h_config("latent")
    for key, value in override.items():  # past the config's own checks, as an edited config.json could be
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=match):
        NemotronHArgs.from_hf_config(config)


def test_prefix_trees_train_as_their_samples(tiny_model_factory):
    """The trainer writes prefix trees out as their samples for this model (trainer/logprobs.py reads
    `supports_prefix_trees`), and trains exactly as one by one."""
    from tests.unit.test_trainer_prefix_tree import LOSSES, _tree_vs_one_by_one

    model = load_pretrained(tiny_model_factory("nemotron_h"), impl="custom")
    (got_metrics, got_grads), (want_metrics, want_grads) = _tree_vs_one_by_one(model, LOSSES["geo_mask"])
    for key in ["loss", "mismatch_kl", "entropy", "grad_norm", "num_loss_tokens"]:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 5
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_lora_adapts_the_linear_layers_and_refuses_the_squared_relu_experts(model_dir):
    """Adapters on attention, Mamba and MLP projections start as the base model and alone get gradients; the routed
    experts (not plain SwiGLU GroupedExperts) are refused by name when "experts" is targeted (the default)."""
    from slipstream.config.shared import LoRAConfig
    from slipstream.models.common.lora import apply_lora, is_lora_name

    with pytest.raises(ValueError, match="Relu2Experts; LoRA adapts plain GroupedExperts only"):
        apply_lora(load_pretrained(model_dir("tiny")), 4, 8.0, 0.0, LoRAConfig().target_modules)
    model = load_pretrained(model_dir("tiny"))
    input_ids_BT, position_ids_BT = random_ids(512, 1, 20), torch.arange(20)[None]
    with torch.no_grad():
        base = model(input_ids_BT, position_ids_BT)
    adapted = apply_lora(model, 4, 8.0, 0.0, ["q_proj", "o_proj", "up_proj", "down_proj", "in_proj", "out_proj"])
    assert {"layers.0.mixer.in_proj", "layers.2.mixer.q_proj", "layers.1.mixer.shared_experts.up_proj"} <= set(adapted)
    with torch.no_grad():
        assert torch.equal(model(input_ids_BT, position_ids_BT), base)
    model(input_ids_BT, position_ids_BT).logsumexp(-1).mean().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(n) for n in trainable)
    assert all((p.grad is not None) == (n in trainable) for n, p in model.named_parameters())
