"""A torchrun rank of `slipstream trainer` / `sft` leaves without the interpreter's shutdown once its work is done
(cli._leave_rank: gloo's worker thread can abort a rank that shuts down while it still lets go of a tensor;
tests/distributed/gloo_exit_race.py). A single process, and any command that is not a rank's, exits as usual."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import atexit
import sys

from slipstream import cli


def fake_run(config):
    atexit.register(lambda: print("interpreter shutdown ran", flush=True))
    print("work done", flush=True)
    return int(sys.argv[2])


command = sys.argv[1]
cli.CONFIG_COMMANDS[command] = (*cli.CONFIG_COMMANDS[command][:2], "__main__", "fake_run")
args = {"trainer": ["--model.name", "m", "--output_dir", "out", "--max_steps", "1"], "rl": ["--model.name", "m", "--max_steps", "1"]}
sys.exit(cli.main([command, *args[command]]))
"""


def _probe(tmp_path: Path, command: str, world_size: int, rc: int) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    src = Path(__file__).parents[2] / "src"
    env = os.environ | {
        "WORLD_SIZE": str(world_size),
        "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    return subprocess.run(
        [sys.executable, str(script), command, str(rc)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("rc", [0, 3])
def test_a_trainer_rank_leaves_without_interpreter_shutdown(tmp_path, rc):
    done = _probe(tmp_path, "trainer", world_size=2, rc=rc)
    assert done.returncode == rc, done.stderr
    assert "work done" in done.stdout
    assert "interpreter shutdown ran" not in done.stdout


def test_a_single_trainer_process_exits_as_usual(tmp_path):
    done = _probe(tmp_path, "trainer", world_size=1, rc=0)
    assert done.returncode == 0, done.stderr
    assert "interpreter shutdown ran" in done.stdout


def test_a_launcher_under_world_size_exits_as_usual(tmp_path):
    """`slipstream rl` is never a rank: WORLD_SIZE inherited from elsewhere does not change how it ends."""
    done = _probe(tmp_path, "rl", world_size=2, rc=0)
    assert done.returncode == 0, done.stderr
    assert "interpreter shutdown ran" in done.stdout
