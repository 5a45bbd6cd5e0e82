"""`slipstream sft` on a tiny model: the loss (and its gradient) is the exact per-token mean over the step whatever
the micro-batching, equal to a plain transformers computation; a run trains, validates, checkpoints, resumes
bit-exactly at the same sample, and writes a model folder that loads as `model.name`."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from slipstream.cli import main as cli_main
from slipstream.config.sft import SFTConfig
from slipstream.config.shared import ModelConfig
from slipstream.models.resolve import resolve_model_config
from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import RunDir
from slipstream.trainer.profile import profile_paths
from slipstream.trainer.setup import setup_trainer
from slipstream.trainer.sft import run_sft
from slipstream.trainer.sft_data import CURSOR_FILE, DataCursor, pack_micro_batches
from slipstream.trainer.sft_render import load_samples
from slipstream.trainer.sft_step import run_passes

_WORDS = "cat dog bird river city robot garden ocean apple book house tree".split()


def _write_data(path, num_rows, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num_rows):
        words = [_WORDS[int(j)] for j in torch.randint(0, len(_WORDS), (2 + i % 4,), generator=g)]
        text = " ".join(words)
        if i % 3 == 0:
            rows.append({"prompt": f"Reverse: {text}", "completion": text[::-1]})
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "system", "content": "Reverse the text."},
                        {"role": "user", "content": text},
                        {"role": "assistant", "content": text[::-1]},
                    ]
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(model_dir, tmp_path, out, **overrides):
    data = {
        "train_files": [str(_write_data(tmp_path / "train.jsonl", 10, seed=0))],
        "val_files": [str(_write_data(tmp_path / "val.jsonl", 3, seed=1))],
    }
    fields = {
        "model": {"name": str(model_dir)},
        "data": data,
        "output_dir": str(out),
        "max_steps": 4,
        "batch_size": 4,
        "micro_batch_tokens": 64,
        "val_interval": 2,
        "optim": {"lr": 1e-3},
        "checkpoint": {"interval": 2},
        "device": "cpu",
        "num_threads": 1,
    }
    return SFTConfig.model_validate(fields | overrides)


def test_loss_is_the_exact_token_mean_over_micro_batches(tiny_qwen3_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    config = _config(tiny_qwen3_dir, tmp_path, tmp_path / "out", model_impl="hf")
    trainer = setup_trainer(config.trainer_config())
    samples = load_samples(config.data.train_files, trainer.tokenizer, ["assistant"], 64)[:3]
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)
    assert len({s.num_loss_tokens for s in samples}) > 1  # unequal samples: a mean of means would differ

    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    total = 0.0
    for s in samples:  # plain transformers, one sample at a time: sum of the loss tokens' cross-entropy
        logits = reference(torch.tensor([s.input_ids])).logits[0, :-1]
        targets = torch.tensor(s.input_ids[1:])
        ce = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        total = total + (ce * torch.tensor(s.loss_mask[1:])).sum()
    (total / num_loss_tokens).backward()
    expected_grads = {f"model.{k}": p.grad for k, p in reference.named_parameters()}

    for packed in (True, False):  # one packed micro-batch of all three, or one micro-batch per sample
        micro_batches = pack_micro_batches(samples, 1024) if packed else [[s] for s in samples]
        assert len(micro_batches) == (1 if packed else 3)
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = run_passes(trainer, micro_batches, num_loss_tokens, backward=True)
        assert float(loss) == pytest.approx(float(total.detach() / num_loss_tokens), rel=1e-6)
        for name, p in trainer.policy.named_parameters():
            torch.testing.assert_close(p.grad, expected_grads[name], rtol=1e-4, atol=1e-6)


def _weights(out, step):
    return load_file(RunDir(out).weights_dir(step) / "model.safetensors")


def test_sft_trains_checkpoints_resumes_bit_exactly_and_exports(tiny_qwen3_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    # Uninterrupted run of 4 steps, through the CLI.
    full = tmp_path / "full"
    config = _config(tiny_qwen3_dir, tmp_path, full, profile_steps=[3])
    toml = tmp_path / "sft.toml"
    config.write_toml(toml)
    assert cli_main(["sft", "-c", str(toml)]) == 0
    records = read_metrics(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and r["num_loss_tokens"] > 0 for r in records)
    assert any(r["num_packed_tokens"] < r["num_tokens"] for r in records)  # prefix trees (shared_prefix), resumed too
    assert [("val/loss" in r) for r in records] == [False, True, False, True]
    assert records[3]["val/loss"] < records[1]["val/loss"]  # lr 1e-3 on reversals: the model learns something
    cursor_path = RunDir(full).checkpoint_dir(2) / CURSOR_FILE
    assert DataCursor.read(cursor_path, 10) == DataCursor(epoch=0, index=8)
    with pytest.raises(ValueError, match="trained on 10 samples, the training files now hold 11"):
        DataCursor.read(cursor_path, 11)
    assert "step 4/4" in capsys.readouterr().out
    summary, trace = profile_paths(full, 3, rank=0)  # profile_steps = [3]: step 3's training profiled, no other
    assert "trainer step 3, rank 0, cpu" in summary.read_text() and trace.is_file()
    assert len(list((full / "profiles").iterdir())) == 2
    with pytest.raises(ValueError, match=r"profile_steps are step numbers, >= 1 \(got \[-1\]\)"):
        _config(tiny_qwen3_dir, tmp_path, full, profile_steps=[-1])
    plots = RunDir(full).plots_dir  # drawn at the end: training loss with the validation points, grad norm, ...
    assert {"loss.png", "grad_norm.png", "overview.png"} <= {p.name for p in plots.iterdir()}

    # Interrupted after step 2 (its checkpoint), then resumed to step 4.
    part = tmp_path / "part"
    run_sft(_config(tiny_qwen3_dir, tmp_path, part, max_steps=2))
    with pytest.raises(ValueError, match="set resume_step = 'latest'"):
        run_sft(_config(tiny_qwen3_dir, tmp_path, part))
    run_sft(_config(tiny_qwen3_dir, tmp_path, part, resume_step="latest"))
    resumed = read_metrics(part)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(records, resumed, strict=True):
        assert a["loss"] == b["loss"] and a.get("val/loss") == b.get("val/loss")
    final, final_resumed = _weights(full, 4), _weights(part, 4)
    assert final.keys() == final_resumed.keys()
    assert all(torch.equal(final[k], final_resumed[k]) for k in final)
    initial = load_file(tiny_qwen3_dir / "model.safetensors")
    assert any(not torch.equal(final[k], initial[k]) for k in final)

    # The exported folder is a Hugging Face model that model.name accepts.
    folder = RunDir(full).weights_dir(4)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())
    assert resolve_model_config(ModelConfig(name=str(folder))) == folder


def test_sft_examples_parse():
    from pathlib import Path

    from slipstream.config.loader import load_config

    paths = sorted((Path(__file__).parents[2] / "examples").glob("**/sft*.toml"))
    assert paths
    for path in paths:
        config = load_config(SFTConfig, ["-c", str(path)])
        assert config.data.loss_roles == ["assistant"] and config.val_interval is not None
