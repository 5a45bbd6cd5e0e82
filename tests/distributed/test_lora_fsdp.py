"""`slipstream sft` with `[model.lora]` over 2 CPU ranks (gloo) equals one process: FSDP2 shards the frozen base and
the adapters together (expert parallelism the experts' adapters on dim 0), gradients reach only the adapters, and
losses, the exported adapter and the merged model match (<= 1e-5)."""

import pytest
import torch
from safetensors.torch import load_file

from slipstream.monitor.metrics import read_metrics
from slipstream.rundir import RunDir
from slipstream.trainer.lora_export import ADAPTER_DIR, ADAPTER_WEIGHTS
from slipstream.trainer.sft import run_sft
from tests.distributed.helpers import run_ranks
from tests.unit.test_lora_sft import _config


@pytest.mark.parametrize(
    ("family", "parallel"),
    [("qwen3", {"activation_checkpointing": True}), ("qwen3_moe", {"ep": 2})],
    ids=["qwen3-fsdp-ac", "qwen3_moe-fsdp-ep"],
)
def test_lora_sft_two_ranks_equals_one_process(family, parallel, tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory(family)
    # lr 1e-3 as the full-parameter parity test: Adam turns float noise on near-zero gradients into whole steps.
    common = dict(max_steps=3, batch_size=5, val_interval=None, optim={"lr": 1e-3})
    one = _config(model_dir, tmp_path, tmp_path / "one", **common)
    two = _config(model_dir, tmp_path, tmp_path / "two", **common)
    two.parallel = two.parallel.model_copy(update=parallel)
    run_sft(one)
    run_ranks(2, run_sft, two)
    for a, b in zip(read_metrics(one.output_dir), read_metrics(two.output_dir), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and a["num_loss_tokens"] == b["num_loss_tokens"]
    for name in (f"{ADAPTER_DIR}/{ADAPTER_WEIGHTS}", "model.safetensors"):
        w1 = load_file(RunDir(one.output_dir).weights_dir(3) / name)
        w2 = load_file(RunDir(two.output_dir).weights_dir(3) / name)
        assert w1.keys() == w2.keys()
        for k in w1:
            torch.testing.assert_close(w1[k], w2[k], rtol=0, atol=1e-5)
    adapter = load_file(RunDir(one.output_dir).weights_dir(3) / ADAPTER_DIR / ADAPTER_WEIGHTS)
    assert any(".experts." in k for k in adapter) == (family == "qwen3_moe")
    assert all(v.abs().max() > 0 for k, v in adapter.items() if "lora_B" in k and ".experts." not in k)
