"""Soak, small: benchmarks/soak.py runs a tiny asynchronous `slipstream rl` (simulated inference) for 30 steps and
samples RSS, open fds and threads of every process of the run at each step. The criteria here are looser than the
issue's, because 20 steps after a 10-step warm-up are too few for noise to average out: warm-up 10 instead of 20, RSS
growth < 20% instead of 10% (the trainer rank's RSS moves +-2% step to step), fds within +4 and threads within +2
instead of flat (the floors are taken over 5 steps at each end, shorter than the tens of steps the orchestrator's
HTTP pool keeps up to 3 extra connections open). The 200-step figures with the strict criteria are in
benchmarks/RESULTS.md."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
KINDS = {"launcher", "inference", "torchrun", "trainer_rank", "orchestrator"}


def test_thirty_step_soak_grows_nothing(tiny_qwen3_dir, tmp_path):
    samples = tmp_path / "samples.jsonl"
    argv = [sys.executable, str(SCRIPT), "--steps", "30", "--warmup", "10", "--window", "3"]
    argv += ["--max-rss-growth-pct", "20", "--max-fd-delta", "4", "--max-thread-delta", "2"]
    argv += ["--workdir", str(tmp_path / "soak"), "--model", str(tiny_qwen3_dir), "--samples", str(samples)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "soak_ok: true", proc.stdout[-3000:]
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    assert {r["process"] for r in rows} == KINDS
    for kind in KINDS:  # sampled through the run (a busy machine may let the driver miss a step's record)
        steps = [r["step"] for r in rows if r["process"] == kind]
        assert steps == sorted(set(steps)) and steps[-1] == 30 and len(steps) >= 20, (kind, steps)
