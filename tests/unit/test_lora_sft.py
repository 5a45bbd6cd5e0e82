"""`slipstream sft` with `[model.lora]` on a tiny model (CPU): the loss falls, checkpoints hold the adapters and their
optimizer state only, resume is bit-exact, and the final folder is the merged model (W + s B A) with the PEFT adapter
beside it, which peft loads with the merged model's logits."""

import math
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from slipstream.config.sft import SFTConfig
from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import RunDir
from slipstream.trainer.ckpt import checkpoint_dir
from slipstream.trainer.sft import run_sft
from slipstream.weights.send.lora_export import ADAPTER_DIR, ADAPTER_WEIGHTS, PEFT_PREFIX
from tests.unit.test_sft_loop import _write_data

LORA = {"rank": 8, "alpha": 16.0}


def _config(model_dir, tmp_path, out, **overrides) -> SFTConfig:
    fields = {
        "model": {"name": str(model_dir), "lora": LORA},
        "data": {
            "train_files": [str(_write_data(tmp_path / "train.jsonl", 10, seed=0))],
            "val_files": [str(_write_data(tmp_path / "val.jsonl", 3, seed=1))],
        },
        "output_dir": str(out),
        "max_steps": 6,
        "batch_size": 4,
        "micro_batch_tokens": 64,
        "val_interval": 3,
        "optim": {"lr": 2e-2},
        "checkpoint": {"interval": 3},
        "device": "cpu",
        "num_threads": 1,
    }
    return SFTConfig.model_validate(fields | overrides)


def _adapter(out, step):
    return load_file(RunDir(out).weights_dir(step) / ADAPTER_DIR / ADAPTER_WEIGHTS)


def test_sft_with_lora_learns_resumes_bit_exactly_and_exports(tiny_qwen3_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full = tmp_path / "full"
    run_sft(_config(tiny_qwen3_dir, tmp_path, full))
    records = read_metrics(full)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[5]["val/loss"] < records[2]["val/loss"] and records[-1]["loss"] < records[0]["loss"]

    # The checkpoint holds the adapters (and their AdamW state), not the frozen base weights.
    keys = FileSystemReader(checkpoint_dir(full, 3)).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_A" in k or ".lora_B" in k for k in model_keys)
    assert any(k.startswith("optimizer.state.") and "lora_B" in k for k in keys)

    # Interrupted after step 3, resumed to step 6: the same losses, the same adapter, the same merged model.
    part = tmp_path / "part"
    run_sft(_config(tiny_qwen3_dir, tmp_path, part, max_steps=3))
    run_sft(_config(tiny_qwen3_dir, tmp_path, part, resume_step="latest"))
    resumed = read_metrics(part)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records]
    adapter, adapter_resumed = _adapter(full, 6), _adapter(part, 6)
    assert adapter.keys() == adapter_resumed.keys()
    assert all(torch.equal(adapter[k], adapter_resumed[k]) for k in adapter)
    folder = RunDir(full).weights_dir(6)
    merged, merged_resumed = load_file(folder / "model.safetensors"), _weights(part)
    assert all(torch.equal(merged[k], merged_resumed[k]) for k in merged)

    # Merged folder = base + (alpha / rank) B A for every adapted weight, the base elsewhere.
    base = load_file(tiny_qwen3_dir / "model.safetensors")
    scale = LORA["alpha"] / LORA["rank"]
    adapted = set()
    for key in adapter:
        if key.endswith("lora_A.weight"):
            module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            lora_b = adapter[key.replace("lora_A", "lora_B")]
            expected = base[f"{module}.weight"] + scale * lora_b @ adapter[key]
            torch.testing.assert_close(merged[f"{module}.weight"], expected, rtol=0, atol=1e-6)
            adapted.add(f"{module}.weight")
    assert len(adapted) == 7 * 2  # q/k/v/o/gate/up/down of both layers
    assert all(torch.equal(merged[k], base[k]) for k in merged.keys() - adapted)

    # The adapter in peft on the base model gives the merged model's logits.
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(input_ids=ids).logits
        hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logits = PeftModel.from_pretrained(hf, folder / ADAPTER_DIR).eval()(input_ids=ids).logits
    assert (logits - expected).abs().max() <= 1e-5


def _weights(out):
    return load_file(RunDir(out).weights_dir(6) / "model.safetensors")


def test_lora_is_refused_with_fp8(tiny_qwen3_dir, tmp_path):
    config = _config(tiny_qwen3_dir, tmp_path, tmp_path / "out").trainer_config()
    with pytest.raises(ValueError, match="fp8 = true with \\[model.lora\\]"):
        config.fp8 = True


def test_optimizer_holds_only_the_adapters(tiny_model_factory, tmp_path):
    from slipstream.models.common.lora import is_lora_name
    from slipstream.trainer.setup import setup_trainer

    config = _config(tiny_model_factory("qwen3_moe"), tmp_path, tmp_path / "out").trainer_config()
    trainer = setup_trainer(config)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    names = {name for name, p in trainer.policy.named_parameters() if id(p) in in_optimizer}
    assert names == {name for name, _ in trainer.policy.named_parameters() if is_lora_name(name)}
    assert any(".experts.gate_proj_lora_A" in n for n in names) and any(".attn.q_proj.lora_B" in n for n in names)
