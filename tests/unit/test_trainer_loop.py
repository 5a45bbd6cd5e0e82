"""Trainer on a tiny random model: packed log-probs equal per-sample ones, and run_trainer trains and publishes."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import OptimConfig, ParallelConfig, TrainerConfig
from slipstream.monitor.metrics import read_metrics
from slipstream.trainer.data import to_packed
from slipstream.trainer.logprobs import compute_logprobs
from slipstream.trainer.profile import profile_paths
from slipstream.trainer.rl import run_trainer, setup_trainer
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch, wait_for_batch, write_batch
from slipstream.utils.net import free_port
from slipstream.weights.send.folder import publish_weights
from slipstream.weights.wire.published import READY, read_probe, weights_dir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tiny_qwen3_dir):
    return tiny_qwen3_dir


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference_logprobs(model, token_ids, temperatures):
    """Plain full forward of one sample: out[t] = log p(token t | tokens < t) at temperatures[t]; out[0] = 0."""
    with torch.no_grad():
        logits_LV = model(torch.tensor([token_ids])).logits[0].float()
    temps_L = torch.tensor(temperatures)
    logp_LV = torch.log_softmax(logits_LV[:-1] / temps_L[1:, None], dim=-1)
    lp = logp_LV.gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp])


def _sample(num_prompt, num_completion, seed, temperature=1.0):
    g = torch.Generator().manual_seed(seed)
    n = num_prompt + num_completion
    return {
        "input_ids": torch.randint(1, 280, (n,), generator=g).tolist(),
        "position_ids": list(range(n)),
        "loss_mask": [False] * num_prompt + [True] * num_completion,
        "temperatures": [1.0] * num_prompt + [temperature] * num_completion,
    }


def _micro_batch(samples, advantages, inference_logprobs=None):
    fields = {k: [x for s in samples for x in s[k]] for k in ("input_ids", "position_ids", "loss_mask", "temperatures")}
    adv = [a if m else 0.0 for s, a in zip(samples, advantages, strict=True) for m in s["loss_mask"]]
    n = len(fields["input_ids"])
    return MicroBatch(advantages=adv, inference_logprobs=inference_logprobs or [0.0] * n, **fields)


def test_packed_logprobs_equal_each_sample_alone(model):
    a, b = _sample(3, 4, seed=1, temperature=0.7), _sample(2, 6, seed=2, temperature=1.3)
    with torch.no_grad():
        packed_lp, packed_ent = compute_logprobs(model, to_packed(_micro_batch([a, b], [1.0, -1.0]), CPU))
        alone_a, ent_a = compute_logprobs(model, to_packed(_micro_batch([a], [1.0]), CPU))
        alone_b, ent_b = compute_logprobs(model, to_packed(_micro_batch([b], [1.0]), CPU))
    torch.testing.assert_close(packed_lp, torch.cat([alone_a, alone_b]), rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_ent, torch.cat([ent_a, ent_b]), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        alone_a, _reference_logprobs(model, a["input_ids"], a["temperatures"]), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(
        alone_b, _reference_logprobs(model, b["input_ids"], b["temperatures"]), rtol=0, atol=1e-5
    )
    assert packed_lp[0] == 0 and packed_lp[7] == 0 and (packed_ent[1:7] > 0).all()


def test_chunked_lm_head_matches_unchunked_values_and_grads(model):
    mb = to_packed(_micro_batch([_sample(3, 5, seed=3), _sample(2, 4, seed=4)], [0.5, -0.5]), CPU)
    results = []
    for chunk_size in (3, 8192):
        model.zero_grad(set_to_none=True)
        logprobs_T, _ = compute_logprobs(model, mb, chunk_size=chunk_size)
        logprobs_T.sum().backward()
        results.append((logprobs_T.detach(), model.lm_head.weight.grad.clone()))
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)


def _write_batches(model, output_dir, num_steps):
    """Batches whose inference log-probs are the initial model's plus noise (so some tokens get masked)."""
    for step in range(1, num_steps + 1):
        samples = [_sample(3, 5, seed=10 * step + i) for i in range(4)]
        micro_batches = []
        for pair, adv in ((samples[:2], [1.0, -1.0]), (samples[2:], [0.5, -0.5])):
            mb = _micro_batch(pair, adv)
            with torch.no_grad():
                lp_T, _ = compute_logprobs(model, to_packed(mb, CPU))
            noisy_T = torch.where(to_packed(mb, CPU).loss_mask_T, lp_T + 0.3 * torch.randn_like(lp_T), 0.0)
            micro_batches.append(_micro_batch(pair, adv, noisy_T.clamp(max=0.0).tolist()))
        num_loss = sum(sum(mb.loss_mask) for mb in micro_batches)
        metrics = {"reward/mean": 0.5, "reward/std": 0.1}
        write_batch(output_dir, TrainingBatch(step, 0, num_loss, micro_batches, metrics=metrics))


@pytest.mark.parametrize("impl", ["custom", "hf"])
def test_run_trainer_trains_publishes_and_logs(model, model_dir, tmp_path, capsys, impl):
    from transformers import AutoModelForCausalLM

    _write_batches(model, tmp_path, num_steps=2)
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl=impl,
        output_dir=tmp_path,
        max_steps=2,
        optim=OptimConfig(lr=1e-2),
        device="cpu",
        batch_timeout_s=5.0,
        profile_steps=[2],
    )
    run_trainer(config)

    tensors = []
    for step in (1, 2):
        assert (weights_dir(tmp_path, step) / READY).is_file()
        tensors.append(load_file(weights_dir(tmp_path, step) / "model.safetensors"))
    assert any(not torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[0])

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["reward/mean"] == 0.5 and r["num_loss_tokens"] == 20
        for key in ("loss", "mismatch_kl", "entropy", "grad_norm", "lr", "tokens_per_s", "timing/step_s"):
            assert math.isfinite(r[key]), key
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float))
    # the trainer's stdout (its log file under the launcher): timestamped, levelled records, one line per step
    out = capsys.readouterr().out
    assert re.search(
        r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO \[trainer\] step 2/2 \| reward 0\.500", out, re.M
    ), out

    # trainer.profile_steps = [2]: step 2's training profiled, step 1 not
    summary, trace = profile_paths(tmp_path, 2, rank=0)
    assert re.match(r"trainer step 2, rank 0, cpu: the window .* took \d+\.\d{3} s of wall time", summary.read_text())
    assert "aten::mm" in summary.read_text() and json.loads(trace.read_text())["traceEvents"]
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == sorted([summary.name, trace.name])

    probe = read_probe(tmp_path, 2)
    assert len(probe["logprobs"]) == len(probe["token_ids"]) - 1
    published = AutoModelForCausalLM.from_pretrained(weights_dir(tmp_path, 2), dtype=torch.float32).eval()
    expected = _reference_logprobs(published, probe["token_ids"], [1.0] * len(probe["token_ids"]))[1:]
    torch.testing.assert_close(torch.tensor(probe["logprobs"]), expected, rtol=0, atol=1e-5)
    assert json.loads((weights_dir(tmp_path, 1) / "probe.json").read_text())["logprobs"] != probe["logprobs"]


def test_run_trainer_rejects_a_mesh_that_does_not_cover_the_ranks(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        output_dir=tmp_path,
        max_steps=1,
        device="cpu",
        parallel=ParallelConfig(dp_shard=3),
    )
    with pytest.raises(ValueError, match=r"= 3 ranks, but WORLD_SIZE is 2"):
        run_trainer(config)


def test_bf16_updates_fp32_masters_and_publishes_bf16(model, model_dir, tmp_path):
    """At lr 1e-6 a bf16 weight would round the update away; the fp32 masters must move wherever grad != 0."""
    from transformers import AutoModelForCausalLM

    _write_batches(model, tmp_path, num_steps=1)
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir), dtype="bfloat16"),
        model_impl="hf",
        output_dir=tmp_path,
        max_steps=1,
        optim=OptimConfig(lr=1e-6),
        device="cpu",
    )
    trainer = setup_trainer(config)
    params = dict(trainer.model.named_parameters())
    assert trainer.compute_dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in params.values())
    before = {name: p.detach().clone() for name, p in params.items()}
    nonzero_grad = {}

    def record_grads(optimizer, args, kwargs):
        assert all(p.grad.dtype == torch.float32 for p in params.values() if p.grad is not None)
        nonzero_grad.update({name: p.grad != 0 for name, p in params.items() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(record_grads)
    batch = wait_for_batch(tmp_path, 1, 0, timeout_s=5.0)
    metrics = train_step(
        trainer.policy, trainer.optimizer, batch, config.loss, config.optim.max_grad_norm, CPU, trainer.autocast_dtype
    )
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0

    num_nonzero = sum(int(mask.sum()) for mask in nonzero_grad.values())
    num_changed = sum(int((params[n].detach() != before[n])[mask].sum()) for n, mask in nonzero_grad.items())
    num_changed_bf16 = sum(
        int((params[n].detach().bfloat16() != before[n].bfloat16())[mask].sum()) for n, mask in nonzero_grad.items()
    )
    assert num_nonzero > 0.5 * sum(p.numel() for p in params.values())
    assert num_changed >= 0.99 * num_nonzero
    assert num_changed_bf16 < 0.1 * num_nonzero  # why the masters are fp32: in bf16 the step would mostly vanish
    assert all(p.dtype == torch.float32 for p in params.values())

    out = publish_weights(trainer.model, trainer.tokenizer, tmp_path, 1, trainer.probe_token_ids, dtype=torch.bfloat16)
    tensors = load_file(out / "model.safetensors")
    assert tensors and all(t.dtype == torch.bfloat16 for t in tensors.values())
    for name, t in tensors.items():
        torch.testing.assert_close(t, params[name].detach().bfloat16(), rtol=0, atol=0)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.rglob("*") if p.is_file())
    assert out.stat().st_mode & 0o777 == 0o755

    # The probe is computed in bf16 from the published tensors, as a bf16 inference server would compute it.
    probe = read_probe(tmp_path, 1)
    published = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).eval()
    expected = _reference_logprobs(published, probe["token_ids"], [1.0] * len(probe["token_ids"]))[1:]
    torch.testing.assert_close(torch.tensor(probe["logprobs"]), expected, rtol=0, atol=1e-5)


def test_run_trainer_serves_prometheus_and_logs_to_wandb_offline(model, model_dir, tmp_path, monkeypatch):
    """monitor.prometheus_port: rank 0 serves each step's record; monitor.wandb (offline): one local run."""

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from slipstream.config.monitor import MonitorConfig, WandbConfig
    from slipstream.monitor.prometheus import PrometheusExporter

    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    exporters = []
    monkeypatch.setattr(PrometheusExporter, "close", lambda self: exporters.append(self))  # scraped after the run
    port = free_port()
    _write_batches(model, tmp_path, num_steps=2)
    monitor = MonitorConfig(prometheus_port=port, wandb=WandbConfig(mode="offline"))
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir)), output_dir=tmp_path, max_steps=2, device="cpu", monitor=monitor
    )
    run_trainer(config)
    (exporter,) = exporters
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        exporter.server.shutdown()
        exporter.server.server_close()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.labels}
    last = read_metrics(tmp_path)[-1]
    assert got["slipstream_step"] == 2 and got["slipstream_reward_mean"] == 0.5
    assert got["slipstream_loss"] == pytest.approx(last["loss"])
    (run,) = (tmp_path / "wandb").rglob("offline-run-*")
    assert b"grad_norm" in b"".join(p.read_bytes() for p in run.glob("*.wandb"))


def test_profile_steps_are_step_numbers(model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"trainer.profile_steps are step numbers, >= 1 \(got \[0\]\)"):
        TrainerConfig(model=ModelConfig(name=str(model_dir)), output_dir=tmp_path, max_steps=2, profile_steps=[0, 2])
    config = TrainerConfig(
        model=ModelConfig(name=str(model_dir)), output_dir=tmp_path, max_steps=2, profile_steps=[3, 2, 3]
    )
    assert config.profile_steps == [2, 3]
