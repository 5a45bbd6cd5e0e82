"""LoRA on our models (models/common/lora.py, weights/send/lora_export.py), CPU float32: a zero B is the base model bit
for bit, only adapters get gradients, the merged weights are W + (alpha / rank) B A, and the PEFT export loads in `peft`
on transformers' model with the same logits (dense and MoE families)."""

import json
import warnings

import pytest
import torch

from slipstream.config.shared import LoRAConfig
from slipstream.models.common.lora import (
    EXPERT_PROJECTIONS,
    LoRAGroupedExperts,
    LoRALinear,
    apply_lora,
    is_lora_name,
    merged_state_dict,
)
from slipstream.models.registry import load_pretrained
from slipstream.weights.send.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft_adapter

FAMILIES = ["llama", "qwen3", "qwen3_moe", "glm4_moe", "minimax_m2", "afmoe", "laguna"]
LORA = LoRAConfig(rank=4, alpha=8.0)


def _load(tiny_model_factory, family: str):
    return load_pretrained(tiny_model_factory(family), impl="custom", dtype=torch.float32, device="cpu").eval()


def _adapt(model, config: LoRAConfig = LORA, seed: int = 0) -> list[str]:
    torch.manual_seed(seed)
    adapted = apply_lora(model, config.rank, config.alpha, config.dropout, config.target_modules)
    return adapted


def _randomize_b(model, seed: int = 1) -> None:
    """B is zero after init (the base model): give it values so the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _inputs(model, num_tokens: int = 24):
    ids_BT = torch.randint(0, model.args.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(3))
    return ids_BT, torch.arange(num_tokens)[None]


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_b_is_the_base_model_and_only_adapters_get_gradients(family, tiny_model_factory):
    model = _load(tiny_model_factory, family)
    ids_BT, pos_BT = _inputs(model)
    with torch.no_grad():
        base = model(ids_BT, pos_BT)
    adapted = _adapt(model)
    kinds = {type(m) for m in model.modules()}
    assert LoRALinear in kinds and (LoRAGroupedExperts in kinds) == (family not in ("llama", "qwen3"))
    assert len(adapted) > 0
    with torch.no_grad():
        assert torch.equal(model(ids_BT, pos_BT), base)  # B = 0: exactly the base model

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_lora_name(n) for n in trainable)
    model.train()
    model(ids_BT, pos_BT).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == (name in trainable), name
    # With B = 0 the gradient reaches B (A's is zero until B moves).
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("lora_B"))


@pytest.mark.parametrize("family", FAMILIES)
def test_merged_weights_are_base_plus_scaled_BA(family, tiny_model_factory):
    model = _load(tiny_model_factory, family)
    base_state = {k: v.clone() for k, v in model.state_dict().items()}
    _adapt(model)
    _randomize_b(model)
    merged = merged_state_dict(model)
    assert merged.keys() == base_state.keys()
    changed = set()
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            expected = base_state[f"{name}.weight"] + LORA.scale * module.lora_B @ module.lora_A
            torch.testing.assert_close(merged[f"{name}.weight"], expected, rtol=0, atol=1e-6)
            changed.add(f"{name}.weight")
        elif isinstance(module, LoRAGroupedExperts):
            for proj in EXPERT_PROJECTIONS:
                a, b = getattr(module, f"{proj}_lora_A"), getattr(module, f"{proj}_lora_B")
                expected = base_state[f"{name}.{proj}"] + LORA.scale * torch.einsum("eor,eri->eoi", b, a)
                torch.testing.assert_close(merged[f"{name}.{proj}"], expected, rtol=0, atol=1e-6)
                changed.add(f"{name}.{proj}")
    assert all(torch.equal(merged[k], base_state[k]) for k in merged.keys() - changed)

    plain = type(model)(model.args)
    plain.load_state_dict(merged)
    ids_BT, pos_BT = _inputs(model)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids_BT, pos_BT), model(ids_BT, pos_BT), rtol=0, atol=1e-5)


# transformers 5 fuses MoE experts, and peft 0.21 then maps *every* target named gate_proj / up_proj / down_proj to
# the fused experts: in GLM-4.5 (dense first layers, shared experts) the dense ones would be dropped, so the peft
# comparison there adapts attention + routed experts only; so does AFMoE's (also an attention `gate_proj`).
PEFT_TARGETS = {family: ["q_proj", "k_proj", "v_proj", "o_proj", "experts"] for family in ("glm4_moe", "afmoe")}


# peft 0.21 adapts transformers' fused experts only for model types in transformers' `_MODEL_TO_CONVERSION_PATTERN`;
# laguna has a mapping of its own, so peft would leave its experts unadapted: not compared here.
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "laguna"])
def test_peft_export_loads_in_peft_with_the_same_logits(family, tiny_model_factory, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(family)
    model = _load(tiny_model_factory, family)
    config = LoRAConfig(rank=4, alpha=8.0, target_modules=PEFT_TARGETS.get(family, LORA.target_modules))
    _adapt(model, config)
    _randomize_b(model)
    export_peft_adapter(model, tmp_path, config, str(model_dir))
    saved = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert saved["peft_type"] == "LORA" and saved["r"] == 4 and saved["lora_alpha"] == 8.0
    assert (tmp_path / ADAPTER_WEIGHTS).is_file()

    ids_BT, pos_BT = _inputs(model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ours, base = model(ids_BT, pos_BT), hf(input_ids=ids_BT).logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # peft's notes on converting expert targets for transformers 5
            peft_model = PeftModel.from_pretrained(hf, tmp_path).eval()
        reference = peft_model(input_ids=ids_BT).logits
    assert (ours - base).abs().max() > 1e-2  # the adapters change the model...
    assert (ours - reference).abs().max() <= 1e-5  # ...exactly as peft applies them


def test_expert_adapters_grouped_mm_equal_the_loop(tiny_model_factory):
    model = _load(tiny_model_factory, "qwen3_moe")
    _adapt(model, LoRAConfig(rank=4, alpha=8.0, target_modules=["experts"]))
    _randomize_b(model)
    ids_BT, pos_BT = _inputs(model)
    results = []
    for grouped in (True, False):
        model.set_grouped_mm(grouped)
        model.zero_grad()
        logits = model(ids_BT, pos_BT)
        logits.logsumexp(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-5)
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        torch.testing.assert_close(grad, results[1][1][name], rtol=1e-4, atol=1e-6)


def test_dropout_only_in_training_and_bad_targets_refused(tiny_model_factory):
    model = _load(tiny_model_factory, "qwen3")
    _adapt(model, LoRAConfig(rank=4, alpha=8.0, dropout=0.5))
    _randomize_b(model)
    ids_BT, pos_BT = _inputs(model)
    with torch.no_grad():
        eval_a, eval_b = model(ids_BT, pos_BT), model(ids_BT, pos_BT)
        model.train()
        train = model(ids_BT, pos_BT)
    assert torch.equal(eval_a, eval_b) and not torch.equal(train, eval_a)
    with pytest.raises(ValueError, match="matched no module"):
        apply_lora(_load(tiny_model_factory, "llama"), 4, 8.0, 0.0, ["experts", "w9"])


def test_adapters_compile_whole_under_activation_checkpointing(tiny_model_factory):
    """The trainer's GPU defaults (checkpointed, compiled blocks) on an adapted MoE model: no graph break, and the
    eager model's log-probs and adapter gradients (bf16 autocast, as compiling the grouped experts needs; full router
    replay so both take the same experts)."""
    import copy

    import torch._dynamo
    from torch._dynamo.utils import counters

    from slipstream.config.trainer import ParallelConfig
    from slipstream.parallel.fsdp import parallelize_model
    from slipstream.trainer.policy import Policy
    from tests.compile_backend import compile_backend
    from tests.unit.test_compile_moe import _inputs as compile_inputs
    from tests.unit.test_compile_moe import _run

    model = _load(tiny_model_factory, "qwen3_moe").train()
    _adapt(model)
    _randomize_b(model)
    eager = Policy(copy.deepcopy(model))
    with compile_backend("aot_eager"):  # the graph and its gradients; Inductor's kernels: test_compile_moe.py
        compiled = parallelize_model(Policy(model), None, ParallelConfig(activation_checkpointing=True), compile=True)
    cfg = model.args
    inputs = compile_inputs(model.num_moe_blocks, cfg.num_experts_per_tok, cfg.num_experts, cfg.vocab_size)
    torch._dynamo.reset()
    counters.clear()
    got, want = _run(compiled, inputs, replay=True), _run(eager, inputs, replay=True)
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)
    assert got[3].keys() == want[3].keys() and all(is_lora_name(n) for n in want[3])
    for name, grad in want[3].items():  # bf16 noise: relative norm of the difference, per parameter
        error = (got[3][name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < 5e-2, (name, float(error))


def test_transformers_model_takes_the_same_adapters(tiny_model_factory, tmp_path):
    """model_impl "hf": the adapters go on transformers' linear layers; the PEFT export and the merged publish
    (weights/send/folder.py) reproduce the adapted model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream.weights.send.folder import publish_weights

    model_dir = tiny_model_factory("qwen3")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert len(_adapt(model)) == 14  # q/k/v/o/gate/up/down of 2 layers
    _randomize_b(model)
    ids_BT = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    export_peft_adapter(model, tmp_path / "adapter", LORA, str(model_dir))
    folder = publish_weights(model, AutoTokenizer.from_pretrained(model_dir), tmp_path / "run", 1, [1, 2, 3])
    with torch.no_grad():
        ours = model(input_ids=ids_BT).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_logits = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids_BT).logits
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=ids_BT).logits
    assert (peft_logits - ours).abs().max() <= 1e-5 and (merged - ours).abs().max() <= 1e-5


def test_vllm_is_started_for_one_adapter_of_a_supported_rank():
    from slipstream.inference.server import lora_args

    assert lora_args(None) == []
    assert lora_args(LoRAConfig(rank=4)) == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert lora_args(LoRAConfig(rank=16))[2] == "16"
    with pytest.raises(ValueError, match="largest LoRA rank"):
        lora_args(LoRAConfig(rank=1024))


def test_lora_on_moe_is_refused_on_the_cpu_build_of_vllm(tiny_model_factory):
    from slipstream.config.inference import InferenceConfig
    from slipstream.inference.server import check_lora_servable

    def config(family: str, lora: bool) -> InferenceConfig:
        model = {"name": family, "lora": {"rank": 8}} if lora else {"name": family}
        return InferenceConfig.model_validate({"model": model, "device": "cpu"})

    check_lora_servable(config("qwen3", True), tiny_model_factory("qwen3"))
    check_lora_servable(config("qwen3_moe", False), tiny_model_factory("qwen3_moe"))
    with pytest.raises(ValueError, match="needs vLLM's GPU build"):
        check_lora_servable(config("qwen3_moe", True), tiny_model_factory("qwen3_moe"))
