"""Chaos, small: benchmarks/chaos.py SIGKILLs each kind of process of a tiny exact-mode run once (launcher, trainer
agent, trainer rank, orchestrator, inference server) at seeded random moments, resumes after each, and the run must
end with the weights and per-step metrics of an uninterrupted run, every step trained once, nothing left running and
the run directory within retention. The 20-kill figures are in benchmarks/RESULTS.md."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "chaos.py"
KILLS = 5


def test_five_kills_of_every_process_kind_survive_bit_exactly(tiny_qwen3_dir, tmp_path):
    argv = [sys.executable, str(SCRIPT), "--kills", str(KILLS), "--steps", "20", "--seed", "0"]
    argv += ["--workdir", str(tmp_path / "chaos"), "--model", str(tiny_qwen3_dir)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"kills_survived: {KILLS}/{KILLS}", proc.stdout[-3000:]
    rows = [line.split() for line in lines if line[:3].strip().isdigit()]
    assert sorted(row[1] for row in rows) == sorted(
        ["launcher", "torchrun", "trainer_rank", "orchestrator", "inference"]
    )
