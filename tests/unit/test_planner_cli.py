"""`slipstream plan`: help, a small plan end to end (table, config fragment, plot), the workload from a file or from
a run's batches, and clear errors for bad input."""

import tomllib

import pytest

from slipstream.cli import main as cli_main
from slipstream.config.base import ConfigError
from slipstream.planner.workload import load_workload, workload_from_run
from slipstream.transport.rollouts import MicroBatch, TrainingBatch, write_batch

RL_TOML = """
max_steps = 10
[model]
name = "Qwen/Qwen3-0.6B"
[orchestrator]
batch_size = 64
group_size = 8
max_async_level = 2
"""
WORKLOAD_TOML = """
prompt_tokens = { p50 = 200, tail_ratio = 2 }
completion_tokens = { p50 = 1000, tail_ratio = 6, max = 8192 }
"""


@pytest.fixture
def files(tmp_path):
    rl, workload = tmp_path / "rl.toml", tmp_path / "workload.toml"
    rl.write_text(RL_TOML)
    workload.write_text(WORKLOAD_TOML)
    return rl, workload


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--nodes", "--gpus-per-node", "--gpu", "--workload", "--from-run", "--target-step-s"):
        assert option in out
    cli_main(["--help"])
    assert "plan" in capsys.readouterr().out


def test_small_plan_writes_fragment_and_plot(files, tmp_path, capsys):
    rl, workload = files
    out = tmp_path / "plan"
    argv = ["plan", "-c", str(rl), "--nodes", "3", "--gpu", "h100", "--workload", str(workload), "--out", str(out)]
    assert cli_main([*argv, "--steps", "8", "--orchestrator.max_async_level", "1", "--target-step-s", "60"]) == 0
    text = capsys.readouterr().out
    assert "qwen3-0.6b" in text and "max_async_level 1" in text and "steps/h" in text
    lines = [line for line in text.splitlines() if line.strip()[:1].isdigit()]
    assert len(lines) == 2  # two splits of 3 nodes
    fragment = tomllib.loads((out / "plan.toml").read_text())
    assert fragment["deployment"]["inference_gpus"] + fragment["deployment"]["trainer_gpus"] == 24
    assert fragment["inference"]["tensor_parallel_size"] * fragment["inference"]["data_parallel_size"] >= 1
    assert (out / "steps_per_hour.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "1"], "--nodes must be at least 2"),
        (["--nodes", "2", "--steps", "2"], "--steps must be at least 4"),
        (["--nodes", "2", "--weight-update-gbps", "0"], "--weight-update-gbps must be positive"),
        (["--nodes", "2", "--orchestrator.batch_size", "0"], "batch_size"),
        (["--nodes", "2", "--model.name", "someone/unknown-7b"], "--model-shape"),
    ],
)
def test_bad_input_names_the_field(files, extra, message, capsys):
    rl, workload = files
    assert cli_main(["plan", "-c", str(rl), "--gpu", "h100", "--workload", str(workload), *extra]) == 2
    assert message in capsys.readouterr().err


def test_bad_workload_file_names_file_and_field(tmp_path):
    path = tmp_path / "w.toml"
    path.write_text("prompt_tokens = { p50 = 10 }\ncompletion_tokens = { p50 = 10, tail_ratio = 0.5 }\n")
    with pytest.raises(ConfigError, match=r"w\.toml.*completion_tokens\.tail_ratio|completion_tokens.*tail_ratio"):
        load_workload(path)
    path.write_text("completion_tokens = { p50 = 10 }\n")
    with pytest.raises(ConfigError, match="prompt_tokens"):
        load_workload(path)


def test_workload_from_a_runs_batches(tmp_path):
    samples = [(30, 70), (50, 150), (40, 100)]  # (prompt, completion)
    ids, pos, mask = [], [], []
    for prompt, completion in samples:
        ids += [1] * (prompt + completion)
        pos += list(range(prompt + completion))
        mask += [False] * prompt + [True] * completion
    zeros = [0.0] * len(ids)
    mb = MicroBatch(ids, pos, mask, zeros, zeros, [1.0] * len(ids))
    write_batch(tmp_path, TrainingBatch(step=1, rank=0, num_loss_tokens=320, micro_batches=[mb]))
    w = workload_from_run(tmp_path)
    assert w.prompt_tokens.p50 == 40 and w.completion_tokens.p50 == 100 and w.num_turns == 1
    with pytest.raises(ConfigError, match="no training batches"):
        workload_from_run(tmp_path / "nothing")


def test_from_run_on_the_command_line(files, tmp_path, capsys):
    rl, _ = files
    missing = tmp_path / "no_run"
    assert cli_main(["plan", "-c", str(rl), "--nodes", "2", "--gpu", "h200", "--from-run", str(missing)]) == 2
    assert "no training batches" in capsys.readouterr().err


def test_known_shapes_match_published_sizes():
    from slipstream.planner.hardware import GLM5_ASSUMED, QWEN3_30B_A3B

    assert QWEN3_30B_A3B.total_params == pytest.approx(30.5e9, rel=0.02)
    assert GLM5_ASSUMED.total_params == pytest.approx(744e9, rel=0.01)
    assert GLM5_ASSUMED.active_params == pytest.approx(40e9, rel=0.01)
