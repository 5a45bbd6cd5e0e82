"""trainer.model_impl = custom vs hf in the trainer: same per-token log-probs, loss, metrics and gradients on the tiny
fixtures of every family (CPU, float32), and the published checkpoint of our models reloads in transformers."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from slipstream.config.trainer import LossConfig
from slipstream.models.registry import MODEL_SPECS, load_pretrained
from slipstream.trainer.data import to_packed
from slipstream.trainer.logprobs import compute_logprobs
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch
from slipstream.weights.send.folder import publish_weights
from slipstream.weights.wire.published import read_probe, weights_dir

CPU = torch.device("cpu")
FAMILIES = ["llama", "qwen3", "qwen3_moe", "glm4_moe", "minimax_m2", "glm_moe_dsa", "qwen3_5_moe_text", "afmoe",
            "nemotron_h", "laguna"]  # fmt: skip


def _micro_batch(lengths, seed, vocab_size):
    """Packed samples of (prompt, completion) lengths; completions at assorted temperatures, noisy lq."""
    g = torch.Generator().manual_seed(seed)
    ids, pos, mask, adv, temps = [], [], [], [], []
    for i, (num_prompt, num_completion) in enumerate(lengths):
        n = num_prompt + num_completion
        ids += torch.randint(3, vocab_size, (n,), generator=g).tolist()
        pos += list(range(n))
        mask += [False] * num_prompt + [True] * num_completion
        adv += [0.0] * num_prompt + [(-1.0) ** i * (0.5 + i)] * num_completion
        temps += [1.0] * num_prompt + [0.6 + 0.3 * i] * num_completion
    lq = [-(0.5 + torch.rand(1, generator=g).item()) if m else 0.0 for m in mask]
    return MicroBatch(ids, pos, mask, adv, lq, temps)


def _models(path):
    custom = load_pretrained(path, impl="custom")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return custom, hf


def _step_grads(model, batch):
    """Loss metrics and the gradients of one train_step (captured right before the optimizer step)."""
    grads = {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    names = {p: n for n, p in model.named_parameters()}
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: grads.update({names[p]: p.grad.clone() for p in names if p.grad is not None})
    )
    config = LossConfig(kind="dppo_tv")
    metrics = train_step(Policy(model), optimizer, batch, config, max_grad_norm=1e9, device=CPU)
    return metrics, grads


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_and_hf_give_the_same_logprobs_loss_and_grads(tiny_model_factory, family):
    path = tiny_model_factory(family)
    custom, hf = _models(path)
    vocab = hf.config.vocab_size
    mbs = [_micro_batch([(3, 5), (2, 7), (4, 3)], seed=1, vocab_size=vocab), _micro_batch([(5, 6)], 2, vocab)]
    for mb in mbs:
        with torch.no_grad():
            lp_c, ent_c = compute_logprobs(custom, to_packed(mb, CPU), chunk_size=4)
            lp_h, ent_h = compute_logprobs(hf, to_packed(mb, CPU))
        torch.testing.assert_close(lp_c, lp_h, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent_c, ent_h, rtol=0, atol=1e-5)

    num_loss = sum(sum(mb.loss_mask) for mb in mbs)
    batch = TrainingBatch(step=1, rank=0, num_loss_tokens=num_loss, micro_batches=mbs)
    metrics_c, grads_c = _step_grads(custom, batch)
    metrics_h, grads_h = _step_grads(hf, batch)
    for key in ("loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm"):
        assert metrics_c[key] == pytest.approx(metrics_h[key], abs=1e-5), key
    assert metrics_c["num_tokens"] == metrics_h["num_tokens"] == sum(len(mb.input_ids) for mb in mbs)

    spec = MODEL_SPECS[hf.config.model_type]
    # Parameters without a gradient in either model (glm_moe_dsa's indexers, never trained by the loss) convert as 0.
    grads_h = {n: grads_h[n] if n in grads_h else torch.zeros_like(p) for n, p in hf.named_parameters()}
    grads_h_ours = spec.from_hf(grads_h, custom.args)  # HF names (and fused expert layout) -> ours
    no_grad = {n for n, _ in custom.named_parameters() if ".indexer." in n}
    no_grad |= {n for n, _ in custom.named_buffers()} & grads_h_ours.keys()  # afmoe's expert_bias: an HF parameter
    assert grads_h_ours.keys() - no_grad == grads_c.keys() and not any(grads_h_ours[n].any() for n in no_grad)
    for name, grad in grads_c.items():
        torch.testing.assert_close(grad, grads_h_ours[name], rtol=0, atol=1e-5, msg=name)
    assert sum(g.abs().sum() for g in grads_c.values()) > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_publishing_our_model_writes_a_transformers_checkpoint(tiny_model_factory, family, tmp_path):
    bucket_bytes = 100_000 if family == "qwen3_moe" else 512 << 20  # ~1.3 MB in bf16: sharded
    path = tiny_model_factory(family)
    custom, hf = _models(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    probe_ids = tokenizer("hello world, the answer is 42")["input_ids"]
    # After a training forward/backward (MoE layers then hold graph tensors of their statistics).
    batch = TrainingBatch(1, 0, 5, [_micro_batch([(3, 5)], seed=3, vocab_size=hf.config.vocab_size)])
    train_step(Policy(custom), torch.optim.SGD(custom.parameters(), lr=0.0), batch, LossConfig(), 1e9, CPU)
    out = publish_weights(
        custom, tokenizer, tmp_path, 3, probe_ids, dtype=torch.bfloat16, source_dir=path, bucket_bytes=bucket_bytes
    )
    assert out == weights_dir(tmp_path, 3)
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 1) == (family == "qwen3_moe") == (out / "model.safetensors.index.json").is_file()
    assert (out / "generation_config.json").read_text() == (path / "generation_config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    expected = {k: v.bfloat16() for k, v in hf.state_dict().items()}
    got = reloaded.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name

    # The probe is the log-probs the published bf16 checkpoint gives under transformers (bf16 rounding differs a
    # little between our grouped experts and transformers' loop: llama matches exactly, qwen3_moe to ~0.016).
    probe = read_probe(tmp_path, 3)
    with torch.no_grad():
        logits = reloaded.eval()(torch.tensor([probe_ids])).logits[0, :-1].float()
    expected_lp = logits.log_softmax(-1).gather(-1, torch.tensor(probe_ids[1:])[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(probe["logprobs"]), expected_lp, rtol=0, atol=0.03)


def test_publishing_a_transformers_moe_writes_its_checkpoint_layout(tiny_model_factory, tmp_path):
    """transformers keeps an MoE layer's experts fused ([E, 2F, D] gate_up_proj); the published files hold them
    per expert, as save_pretrained writes them (and vLLM loads them)."""
    from safetensors.torch import load_file

    path = tiny_model_factory("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any("experts.gate_up_proj" in k for k in hf.state_dict())  # fused in memory
    tokenizer = AutoTokenizer.from_pretrained(path)
    probe_ids = tokenizer("hello world")["input_ids"]
    out = publish_weights(hf, tokenizer, tmp_path, 1, probe_ids, dtype=torch.bfloat16, bucket_bytes=100_000)
    hf.save_pretrained(tmp_path / "reference")
    want = load_file(tmp_path / "reference" / "model.safetensors")
    got = {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(shard).items()}
    assert got.keys() == want.keys() and any(".experts.0.gate_proj.weight" in k for k in got)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.bfloat16()), name
