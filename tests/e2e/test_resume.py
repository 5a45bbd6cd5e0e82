"""Whole-run resume through real vLLM: kill -9 the orchestrator at a random point after the first committed
checkpoint, `slipstream rl --resume`, and the run ends at the same step with the weights, losses and metrics of an
uninterrupted run of the same seed, every step trained exactly once.

Other victims are covered elsewhere: test_launcher_kill.py kills the launcher (everything) and resumes through real
vLLM the same way; benchmarks/chaos.py (tests/e2e/test_chaos.py) kills a trainer rank, the torchrun agent, the
launcher, the orchestrator and the inference server in one seeded run and checks every resume bit-exact and the
launcher naming the failed role."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.helpers import RESUME_MAX_STEPS as MAX_STEPS
from tests.e2e.helpers import processes_with_marker, resume_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]
# a random point of the run after the first commit: (file that must exist, extra sleep bound in s)
KILL_POINTS = [
    ("checkpoints/step_1/COMMITTED", 0.5),
    ("rollouts/step_2/rank_0.msgpack", 0.3),
    ("weights/step_2/READY", 0.3),
    ("checkpoints/step_2/orchestrator/COMMITTED", 0.2),
    ("rollouts/step_3/rank_0.msgpack", 0.2),
]


def _rl(config_path: Path, env: dict, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(config_path), *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _wait_gone(marker: str) -> None:
    deadline = time.monotonic() + 10
    while processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with_marker(marker) == [], "processes left behind by the run"


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "weights" / f"step_{MAX_STEPS}" / "model.safetensors")


def _victim_pid(marker: str, victim: str) -> int:
    """The trainer's worker process (under torchrun) or the orchestrator process of the run tagged `marker`."""
    needle = {"trainer": "config/trainer.toml", "orchestrator": "config/orchestrator.toml"}[victim]
    matches = {}
    for pid in processes_with_marker(marker):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue
        if needle in cmdline and "torch.distributed.run" not in cmdline:
            matches[pid] = ppid
    assert len(matches) == 1, matches
    return next(iter(matches))


@pytest.mark.parametrize("victim", ["orchestrator"])
def test_kill_and_resume_matches_an_uninterrupted_run(victim, resume_reference, tiny_qwen3_dir, tmp_path, run_env):
    reference = resume_reference  # an uninterrupted run of the same config
    marker, env = run_env
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "rl.toml", resume_config(tiny_qwen3_dir, out))
    rng = random.Random()
    point, max_sleep = rng.choice(KILL_POINTS)
    sleep = rng.uniform(0.0, max_sleep)
    print(f"killing the {victim} once {point} exists, {sleep:.2f}s later")

    launcher = _rl(cfg, env)
    try:
        deadline = time.monotonic() + 400
        while not (out / point).exists():
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, f"the run never reached {point}"
            time.sleep(0.02)
        time.sleep(sleep)
        assert launcher.poll() is None, "the run ended before the kill"
        os.kill(_victim_pid(marker, victim), signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = _finish(launcher, 60)
        assert time.monotonic() - killed_at < 30, "the launcher took more than 30 s to stop the run"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode != 0 and f"error: {victim} " in stderr, stderr
    if victim == "orchestrator":  # a direct child of the launcher (the trainer victim is a rank under torchrun)
        assert "orchestrator was killed by signal 9" in stderr, stderr
    _wait_gone(marker)
    trained_before = [m["step"] for m in _metrics(out)]
    assert trained_before == list(range(1, len(trained_before) + 1)) and len(trained_before) < MAX_STEPS

    resumed = _rl(cfg, env, "--resume")
    stdout, stderr = _finish(resumed, 600)
    assert resumed.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    _wait_gone(marker)
    committed = sorted(int(p.parent.name.removeprefix("step_")) for p in (out / "checkpoints").glob("*/COMMITTED"))
    resume_step = int(re.search(r"resuming \S+ after step (\d+)", stdout).group(1))
    assert 1 <= resume_step <= len(trained_before)
    assert f"resumed from {out}/checkpoints/step_{resume_step}" in (out / "logs" / "trainer.log").read_text()
    trained_after = [int(s) for s in re.findall(r"\] step (\d+)/", stdout)]  # the launcher's progress lines
    assert trained_after == list(range(resume_step + 1, MAX_STEPS + 1)), stdout

    # every step trained exactly once, and each the same as in the uninterrupted run
    metrics, want = _metrics(out), _metrics(reference)
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    for got, ref in zip(metrics, want, strict=True):
        for key in ("loss", "grad_norm", "reward/mean", "num_tokens"):
            assert got[key] == ref[key], (got["step"], key, got[key], ref[key])
    final, ref_final = _final_weights(out), _final_weights(reference)
    assert final.keys() == ref_final.keys()
    for name, tensor in ref_final.items():
        assert torch.equal(final[name], tensor), name
    # retention (keep_last = 1, keep_every = 2): the newest and the even steps are left
    assert committed == [2, 4], committed
