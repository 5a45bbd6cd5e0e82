"""RL with `[model.lora]` end to end through real vLLM (CPU build): vLLM serves the base model with --enable-lora, the
trainer publishes each step's adapter as a PEFT folder, the orchestrator loads it in place under the adapter's name
and verifies every load with the trainer's probe; the published adapter reproduces inference's log-probs in peft.

The uninterrupted run and the resumed one use one vLLM server in turn (`lora_server`): the resumed run finds the
adapter of the run before it loaded under the same name, and must still end where that run ended. The interrupted run
starts its own (the kill must leave nothing of it behind)."""

import json
import os
import signal
import time
import uuid
import warnings

import pytest
import torch
from safetensors.torch import load_file

from slipstream.weights.send.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS, MERGED_DIR
from tests.e2e.helpers import MARKER_VAR, resume_config, shared_inference, write_config
from tests.e2e.test_resume import _finish, _metrics, _rl, _victim_pid, _wait_gone
from tests.e2e.test_rl_tiny import LOGPROB_TOLERANCE, MIN_CHANGE_PER_STEP, _read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]


def _lora_config(model_dir, out):
    """Synchronous, seeded requests (resume_config): the interrupted-and-resumed run must equal this one."""
    config = resume_config(model_dir, out)
    config["model"]["lora"] = {"rank": 8, "alpha": 16.0, "name": "tiny-lora"}
    config["trainer"]["optim"].update(lr=2e-2, max_grad_norm=10.0)
    return config


@pytest.fixture(scope="module")
def lora_server(tiny_qwen3_dir, tmp_path_factory):
    """The vLLM server of `_lora_config`'s flags (--enable-lora), used in turn by the uninterrupted and resumed runs."""
    root = tmp_path_factory.mktemp("lora_server")
    with shared_inference(_lora_config(tiny_qwen3_dir, root / "unused"), root) as server:
        yield server


@pytest.fixture(scope="module")
def lora_run(lora_server, tiny_qwen3_dir, tmp_path_factory):
    """One uninterrupted LoRA run (4 steps), checked by the first test and the reference of the resume test (one
    real-vLLM run fewer in the suite)."""
    root = tmp_path_factory.mktemp("lora_run")
    marker = uuid.uuid4().hex
    env = lora_server.env({**os.environ, MARKER_VAR: marker, "PYTHONUNBUFFERED": "1"})
    out = root / "run"
    config = lora_server.run_config(_lora_config(tiny_qwen3_dir, out))
    stdout, stderr = _finish(_rl(write_config(root / "rl.toml", config), env), 600)
    assert "[slipstream] step 4/4" in stdout, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    _wait_gone(marker)  # nothing of the run left behind
    return out


def test_lora_rl_steps_with_verified_adapter_loads(tiny_qwen3_dir, lora_run):
    out = lora_run
    assert [m["step"] for m in _read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]

    checks = _read_jsonl(out / "weight_checks.jsonl")
    steps = [c["step"] for c in checks]
    assert steps == sorted(set(steps)) and steps[-1] == 4 and len(steps) >= 2, steps
    previous = None
    for check in checks:
        assert check["passed"] and check["max_abs_diff"] <= LOGPROB_TOLERANCE, check
        if previous is not None:  # each load changed what inference serves
            assert (
                max(abs(a - b) for a, b in zip(check["inference_logprobs"], previous, strict=True))
                > MIN_CHANGE_PER_STEP
            )
        previous = check["inference_logprobs"]

    # The served version is a PEFT adapter folder (the last one with the merged model in merged/), and both reproduce
    # inference's log-probs.
    final = out / "weights" / "step_4"
    assert (final / "READY").exists() and (final / ADAPTER_WEIGHTS).exists()
    assert not list(final.glob("model*.safetensors")) and (final / MERGED_DIR / "READY").exists()
    assert json.loads((final / ADAPTER_CONFIG).read_text())["r"] == 8
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    token_ids = json.loads((final / "probe.json").read_text())["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        logits = PeftModel.from_pretrained(hf, final).eval()(input_ids=torch.tensor([token_ids])).logits[0]
        merged = AutoModelForCausalLM.from_pretrained(final / MERGED_DIR, dtype=torch.float32).eval()
        merged_logits = merged(input_ids=torch.tensor([token_ids])).logits[0]
    served = torch.tensor(checks[-1]["inference_logprobs"])
    for out_logits in (logits, merged_logits):  # the adapter in peft, and the last step's merged model
        logprobs = out_logits.log_softmax(-1)[:-1].gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
        assert (logprobs - served).abs().max() <= LOGPROB_TOLERANCE


def test_lora_rl_resume_matches_an_uninterrupted_run(tiny_qwen3_dir, tmp_path, run_env, lora_server, lora_run):
    """Kill -9 the trainer after the checkpoint of step 2, `--resume`: the adapter and its AdamW state come back from
    the checkpoint, the orchestrator serves step 2's adapter again, and the run ends with the losses and the adapter
    of an uninterrupted run (synchronous, seeded requests)."""
    marker, env = run_env
    reference, out = lora_run, tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", _lora_config(tiny_qwen3_dir, out))
    launcher = _rl(cfg, env)
    try:
        deadline = time.monotonic() + 400
        while not (out / "checkpoints/step_2/COMMITTED").exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the run never committed step 2"
            time.sleep(0.02)
        os.kill(_victim_pid(marker, "trainer"), signal.SIGKILL)
        _finish(launcher, 60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    _wait_gone(marker)
    resumed_cfg = write_config(tmp_path / "rl_resumed.toml", lora_server.run_config(_lora_config(tiny_qwen3_dir, out)))
    resumed = _rl(resumed_cfg, lora_server.env(env), "--resume")
    stdout, stderr = _finish(resumed, 600)
    assert resumed.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    _wait_gone(marker)
    assert "resumed from" in (out / "logs" / "trainer.log").read_text()

    metrics, want = _metrics(out), _metrics(reference)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for got, ref in zip(metrics, want, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "num_tokens"):
            assert got[key] == ref[key], (got["step"], key, got[key], ref[key])
    final = load_file(out / "weights" / "step_4" / ADAPTER_WEIGHTS)
    ref_final = load_file(reference / "weights" / "step_4" / ADAPTER_WEIGHTS)
    assert final.keys() == ref_final.keys()
    assert all(torch.equal(final[k], ref_final[k]) for k in final)
    assert all(c["passed"] for c in _read_jsonl(out / "weight_checks.jsonl"))
