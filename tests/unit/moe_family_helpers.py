"""What every custom MoE family's tests check against transformers (CPU, float32), written once: a family's test
module builds its `model_dir` and `case` fixtures with `model_dir_fixture` / `case_fixture` and subclasses
`MoEFamilyChecks` as a `Test...` class (this module's class is not collected itself). Checks: logits, packed rows ==
samples alone, bit-exact weight round trips (checkpoint and in-memory layouts), gradients, router replay per MoE block,
statistics + grouped GEMM == loop + bf16 autocast, the registry, and published weights == save_pretrained."""

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from slipstream.models.registry import (
    MODEL_SPECS,
    build_model,
    export_hf_state_dict,
    load_pretrained,
    read_safetensors,
    resolve_impl,
)

ATOL = 1e-4


def random_ids(vocab_size: int, *shape: int, seed: int = 0, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def save_random_hf(config, folder: Path, seed: int = 1, tweak: Callable[[torch.nn.Module], None] | None = None) -> Path:
    """A random transformers model of `config` (seed `seed`; selection biases random, as transformers inits them at
    0; then `tweak`, under no_grad) saved to `folder`."""
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        if tweak is not None:
            tweak(hf)
    hf.save_pretrained(folder)
    return folder


def model_dir_fixture(family: str, config: Callable[[str], object], tweak: Callable[[torch.nn.Module], None] = None):
    """A module-scoped `model_dir` fixture: `case -> folder`, "tiny" the session's tiny model of `family`, any other
    case a random transformers model of `config(case)` (seed 1, `save_random_hf`)."""

    @pytest.fixture(scope="module")
    def model_dir(tiny_model_factory, tmp_path_factory):
        built: dict[str, Path] = {}

        def get(case: str) -> Path:
            if case not in built:
                if case == "tiny":
                    built[case] = tiny_model_factory(family)
                else:
                    built[case] = save_random_hf(config(case), tmp_path_factory.mktemp(case), 1, tweak)
            return built[case]

        return get

    return model_dir


def case_fixture(cases: list[str]):
    """A module-scoped `case` fixture over `cases`: (name, folder, ours, transformers), both in eval mode."""

    @pytest.fixture(scope="module", params=cases)
    def case(request, model_dir):
        path = model_dir(request.param)
        ours = load_pretrained(path, impl="custom").eval()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return request.param, path, ours, hf

    return case


def run_with_replay(model, moe_cls: type, input_ids_BT, position_ids_BT, replay_own: bool):
    """(moes, h_plain, h_replay): hidden states without replay, and with a replay of every MoE block's own choice
    (`replay_own`) or of other experts for every token (each choice + 1)."""
    moes = [m for m in model.modules() if isinstance(m, moe_cls)]
    own = []  # each MoE block's own top-k, recorded by a hook
    hooks = [m.router.register_forward_hook(lambda mod, args, out: own.append(out[1].clone())) for m in moes]
    with torch.no_grad():
        h_plain = model.forward_hidden(input_ids_BT, position_ids_BT)
    for hook in hooks:
        hook.remove()
    replay_BTRA = torch.stack(own, dim=1)[None]  # [1, T, R, A]
    if not replay_own:
        replay_BTRA = (replay_BTRA + 1) % model.args.num_experts
    with torch.no_grad():
        h_replay = model.forward_hidden(input_ids_BT, position_ids_BT, replay_BTRA=replay_BTRA)
    return moes, h_plain, h_replay


def check_grouped_mm_matches_loop(model, input_ids_BT, position_ids_BT) -> torch.Tensor:
    """The grouped-GEMM experts give the per-expert loop's logits and gradients (<= 1e-5); returns the logits."""
    results = []
    for grouped in (False, True):
        model.set_grouped_mm(grouped)
        model.zero_grad(set_to_none=True)
        logits = model(input_ids_BT, position_ids_BT)
        (logits * torch.linspace(-1, 1, logits.shape[-1])).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (loop_logits, loop_grads), (gmm_logits, gmm_grads) = results
    assert max_diff(loop_logits, gmm_logits) <= 1e-5 and loop_grads.keys() == gmm_grads.keys()
    assert all(max_diff(loop_grads[k], gmm_grads[k]) <= 1e-5 for k in loop_grads)
    return gmm_logits


class MoEFamilyChecks:
    """The shared checks; a subclass sets the class attributes below."""

    family: str
    model_cls: type
    moe_cls: type
    """The family's MoE layer class (router replay hooks its router)."""
    checkpoint_keys: tuple[str, ...]
    """Key endings the saved checkpoint must hold (its selection bias, its per-expert layout)."""
    rich_case: str
    """The case whose model the replay and statistics checks use."""
    num_moe_blocks: int
    """MoE blocks of the `rich_case` model."""
    unknown_key: str
    """A key the family's checkpoints never hold (import must refuse it)."""
    packed_lengths = (9, 17, 12)
    hf_keeps_bias_in_fp32 = True
    bf16_mean_tolerance = 0.05
    """Mean |logits difference| between bf16 autocast and float32 (routing, and DSA's top-k, flip for a few tokens)."""
    low_token_id = 0
    """Random token ids start here."""
    """transformers keeps the selection bias in float32 in a bf16 model (`_keep_in_fp32_modules_strict`)."""
    no_grad_params: tuple[str, ...] = ()
    """Parameter name parts that get no gradient from the loss (in transformers neither)."""

    def test_logits_match_transformers(self, case):
        name, _, ours, hf = case
        input_ids_BT = random_ids(ours.args.vocab_size, 2, 40, low=self.low_token_id)
        with torch.no_grad():
            logits = ours(input_ids_BT, torch.arange(40).expand(2, 40))
            expected = hf(input_ids=input_ids_BT).logits
            hidden = ours.forward_hidden(input_ids_BT, torch.arange(40).expand(2, 40))
        diff = max_diff(logits, expected)
        print(f"{self.family} {name}: max |logits diff| {diff:.2e} (max |logit| {expected.abs().max().item():.2f})")
        assert diff <= ATOL, name
        assert torch.equal(ours.logits(hidden), logits)

    def test_packed_row_matches_samples_run_alone(self, case):
        name, _, ours, hf = case
        lengths = self.packed_lengths
        samples = [
            random_ids(ours.args.vocab_size, 1, n, seed=i + 10, low=self.low_token_id) for i, n in enumerate(lengths)
        ]
        input_ids_BT = torch.cat(samples, dim=1)
        position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
        with torch.no_grad():
            packed = ours(input_ids_BT, position_ids_BT)
            ours_alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
            hf_alone = torch.cat([hf(input_ids=s).logits for s in samples], dim=1)
            unpacked = ours(input_ids_BT, torch.arange(sum(lengths))[None])
        assert max_diff(packed, ours_alone) <= 1e-5, name
        assert max_diff(packed, hf_alone) <= ATOL, name
        assert max_diff(unpacked[:, lengths[0] :], hf_alone[:, lengths[0] :]) > 1e-2  # the boundaries do matter

    def test_state_dict_round_trip_is_bit_exact(self, case):
        name, path, ours, hf = case
        spec = MODEL_SPECS[self.family]
        hf_sd = read_safetensors(path)
        for ending in self.checkpoint_keys:
            assert any(k.endswith(ending) for k in hf_sd), ending
        back = spec.to_hf(spec.from_hf(hf_sd, ours.args), ours.args)
        assert sorted(back) == sorted(hf_sd)
        assert all(torch.equal(back[k], hf_sd[k]) and back[k].dtype == hf_sd[k].dtype for k in hf_sd), name
        exported = export_hf_state_dict(ours)  # through the loaded model's parameters and buffers
        assert sorted(exported) == sorted(hf_sd) and all(torch.equal(exported[k], hf_sd[k]) for k in hf_sd)
        # transformers' in-memory layout (experts fused into gate_up_proj; a tied head listed twice) converts the same
        in_memory = hf.state_dict()
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in in_memory)
        from_memory, from_file = spec.from_hf(in_memory, ours.args), spec.from_hf(hf_sd, ours.args)
        assert sorted(from_memory) == sorted(from_file)
        assert all(torch.equal(from_memory[k], from_file[k]) for k in from_file)

    def test_multi_token_prediction_layers_are_dropped_on_import(self, model_dir):
        """Layers past num_layers (a copy of the last one, plus an MTP-only weight) are dropped; any other unknown key
        is still an error."""
        path = model_dir("tiny")
        args = load_pretrained(path).args
        hf_sd = read_safetensors(path)
        last, mtp = f"model.layers.{args.num_layers - 1}.", f"model.layers.{args.num_layers}."
        extra = {k.replace(last, mtp, 1): v for k, v in hf_sd.items() if k.startswith(last)}
        extra[mtp + "eh_proj.weight"] = torch.zeros(4, 4)
        spec = MODEL_SPECS[self.family]
        assert spec.from_hf({**hf_sd, **extra}, args).keys() == spec.from_hf(hf_sd, args).keys()
        with pytest.raises(ValueError, match="unexpected"):
            spec.from_hf({**hf_sd, self.unknown_key: torch.zeros(1)}, args)

    def test_gradients_reach_every_parameter_and_match_transformers(self, case):
        """Per token first: a token whose top-k is a near tie could route differently in the two models; the
        gradients are compared once every token's logits agree (checked)."""
        name, _, ours, hf = case
        input_ids_BT = random_ids(ours.args.vocab_size, 2, 48, seed=3, low=self.low_token_id)
        targets = random_ids(ours.args.vocab_size, 2 * 48, seed=4, low=self.low_token_id)
        ours.zero_grad(set_to_none=True)
        hf.zero_grad(set_to_none=True)
        logits = ours(input_ids_BT, torch.arange(48).expand(2, 48))
        expected = hf(input_ids=input_ids_BT).logits
        per_token = (logits - expected).abs().amax(-1).flatten()
        assert (per_token <= ATOL).all(), f"{name}: tokens {torch.nonzero(per_token > ATOL).flatten().tolist()} differ"
        F.cross_entropy(logits.flatten(0, 1), targets).backward()
        F.cross_entropy(expected.flatten(0, 1), targets).backward()
        hf_grads = {k: torch.zeros_like(p) if p.grad is None else p.grad for k, p in hf.named_parameters()}
        hf_grads = MODEL_SPECS[self.family].from_hf(hf_grads, ours.args)
        worst = 0.0
        for key, param in ours.named_parameters():
            if any(part in key for part in self.no_grad_params):
                assert param.grad is None and not hf_grads[key].any(), f"{name}: {key} got a gradient"
                continue
            assert param.grad is not None and param.grad.abs().sum() > 0, f"{name}: no gradient for {key}"
            worst = max(worst, max_diff(param.grad, hf_grads[key]))
            assert max_diff(param.grad, hf_grads[key]) <= ATOL, f"{name}: gradient of {key}"
        print(f"{self.family} {name}: max |grad diff| {worst:.2e}")
        assert not any("e_score_correction_bias" in k for k, _ in ours.named_parameters())  # a buffer, not trained
        ours.zero_grad(set_to_none=True)
        hf.zero_grad(set_to_none=True)

    @pytest.mark.parametrize("replay_own", [True, False])
    def test_model_replays_per_moe_block(self, model_dir, replay_own):
        model = load_pretrained(model_dir(self.rich_case), impl="custom").eval()
        input_ids_BT, position_ids_BT = (
            random_ids(model.args.vocab_size, 1, 12, low=self.low_token_id),
            torch.arange(12)[None],
        )
        moes, h_plain, h_replay = run_with_replay(model, self.moe_cls, input_ids_BT, position_ids_BT, replay_own)
        assert model.num_moe_blocks == len(moes) == self.num_moe_blocks
        if replay_own:
            assert torch.equal(h_replay, h_plain)
            assert all(m.router.replay_counts.tolist() == [12, 12, 12] for m in moes)
        else:
            assert not torch.allclose(h_replay, h_plain, atol=1e-3)

    def test_moe_stats_grouped_mm_and_bf16_autocast(self, model_dir):
        ours = load_pretrained(model_dir(self.rich_case), impl="custom")
        args = ours.args
        input_ids_BT, position_ids_BT = (
            random_ids(args.vocab_size, 2, 30, seed=5, low=self.low_token_id),
            torch.arange(30).expand(2, 30),
        )
        _, aux_loss_L = ours.forward_with_aux_loss(input_ids_BT, position_ids_BT)
        stats = ours.moe_stats()
        num_moe = ours.num_moe_blocks
        assert stats.tokens_per_expert_LE.shape == (num_moe, args.num_experts)
        assert (stats.tokens_per_expert_LE.sum(1) == 60 * args.num_experts_per_tok).all()
        assert aux_loss_L.shape == (num_moe,) and aux_loss_L.requires_grad
        assert torch.equal(stats.aux_loss_L, aux_loss_L.detach())
        gmm_logits = check_grouped_mm_matches_loop(ours, input_ids_BT, position_ids_BT)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = ours(input_ids_BT, position_ids_BT)
        # bf16 flips a few routing choices (so a few tokens differ more): compare the mean
        assert logits.dtype == torch.bfloat16 and (logits.float() - gmm_logits).abs().mean() <= self.bf16_mean_tolerance

    def test_registry_picks_the_custom_model(self, model_dir):
        path = model_dir("tiny")
        config = AutoConfig.from_pretrained(path)
        assert resolve_impl(self.family, "auto") == "custom"
        for impl in ("auto", "custom"):
            model = build_model(config, impl)
            assert type(model) is self.model_cls
            assert all(torch.isfinite(t).all() for t in model.state_dict().values())
        assert type(load_pretrained(path)) is self.model_cls
        assert isinstance(build_model(config, "hf"), PreTrainedModel)
        with torch.device("meta"):  # how large models are built: the buffers come from the checkpoint
            meta = build_model(config)
        meta.load_state_dict(load_pretrained(path).state_dict(), strict=True, assign=True)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_published_weights_equal_save_pretrained(self, model_dir, tmp_path, dtype):
        """The trainer's weight stream (weights/send/export.py, names from to_hf on meta tensors) writes what
        transformers' save_pretrained writes for the same weights: names, shapes and values (cast to the published
        dtype, except e_score_correction_bias, which transformers keeps in float32 and so do we: a rounded selection
        bias would route differently in inference)."""
        from safetensors.torch import load_file

        from slipstream.weights.send.folder import publish_weights

        path = model_dir("tiny")
        ours = load_pretrained(path, impl="custom")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
        probe_ids = tokenizer("hello world, the answer is 42")["input_ids"]
        out = publish_weights(
            ours, tokenizer, tmp_path, 1, probe_ids, dtype=dtype, source_dir=path, bucket_bytes=200_000
        )
        got = {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(shard).items()}
        hf.save_pretrained(tmp_path / "reference")
        want = read_safetensors(tmp_path / "reference")
        assert len(list(out.glob("*.safetensors"))) > 1 and got.keys() == want.keys()
        # Published dtypes are those transformers itself keeps in a model of that dtype (the selection bias float32).
        if self.hf_keeps_bias_in_fp32:
            kept = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()
            biases = [k for k in kept if k.endswith("e_score_correction_bias")]
            assert biases and all(kept[k].dtype == torch.float32 for k in biases)
        for name, tensor in want.items():
            expected = torch.float32 if name.endswith("e_score_correction_bias") else dtype
            assert got[name].dtype == expected and torch.equal(got[name], tensor.to(expected)), name
        # what transformers loads from the published folder computes as the source model rounded to `dtype`
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        rounded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).float().eval()
        ids = random_ids(500, 1, 16, low=self.low_token_id)
        with torch.no_grad():
            assert max_diff(reloaded(input_ids=ids).logits, rounded(input_ids=ids).logits) <= ATOL
