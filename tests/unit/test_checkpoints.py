"""Whole-run checkpoint rules (transport/checkpoints.py): which steps are checkpointed, the step commit marker,
retention, preparing a run directory for resume, and the config of `slipstream rl --resume`."""

import json

import pytest

from slipstream.config.base import ConfigError
from slipstream.config.loader import load_config
from slipstream.config.rl import RLConfig
from slipstream.config.shared import CheckpointConfig
from slipstream.launch.local import prepare_resume_run
from slipstream.transport.checkpoints import (
    COMMITTED,
    ORCHESTRATOR_PART,
    TRAINER_PART,
    commit_step,
    committed_run_steps,
    is_checkpoint_step,
    part_dir,
    prepare_resume,
    prune_checkpoints,
    resolve_run_step,
    retained_steps,
    step_dir,
)
from slipstream.weights.wire.published import READY, weights_dir


def _part(root, step, part):
    path = part_dir(root, step, part)
    path.mkdir(parents=True)
    (path / COMMITTED).write_text(f"{step}\n")


def _commit(root, *steps):
    for step in steps:
        _part(root, step, TRAINER_PART)
        _part(root, step, ORCHESTRATOR_PART)
        commit_step(root, step)


def test_checkpoint_steps():
    assert [s for s in range(1, 8) if is_checkpoint_step(s, 3, 7)] == [3, 6, 7]
    assert not any(is_checkpoint_step(s, 0, 7) or is_checkpoint_step(s, None, 7) for s in range(1, 8))


def test_slipstream_rl_checkpoints_by_default_and_0_turns_them_off(tmp_path):
    """Every 50 steps and the last, in both processes' configs, whatever else [checkpoint] sets; 0: never. `slipstream
    trainer`, `orchestrator` and `sft` alone keep checkpoints off unless asked."""
    base = ["--model.name", "m", "--max-steps", "120", "--output-dir", str(tmp_path)]
    for extra, expected in (([], 50), (["--checkpoint.keep-last", "2"], 50), (["--checkpoint.interval", "0"], 0)):
        config = load_config(RLConfig, [*base, *extra])
        assert config.checkpoint.interval == config.trainer.checkpoint.interval == expected
        assert config.orchestrator.checkpoint == config.checkpoint
        assert config.rebuilt({}).checkpoint == config.checkpoint
        assert RLConfig.model_validate(config.user_toml_dict()).checkpoint == config.checkpoint  # rl.toml round-trips
        steps = [s for s in range(1, 121) if is_checkpoint_step(s, config.checkpoint.interval, config.max_steps)]
        assert steps == ([50, 100, 120] if expected else [])
    assert CheckpointConfig().interval == 0


def test_a_step_commits_only_with_both_parts(tmp_path):
    _part(tmp_path, 2, TRAINER_PART)
    with pytest.raises(FileNotFoundError, match="its orchestrator part is not committed.*same checkpoint.interval"):
        commit_step(tmp_path, 2)
    (part_dir(tmp_path, 2, ORCHESTRATOR_PART)).mkdir(parents=True)  # written but not committed: still refused
    with pytest.raises(FileNotFoundError, match="orchestrator part"):
        commit_step(tmp_path, 2)
    (part_dir(tmp_path, 2, ORCHESTRATOR_PART) / COMMITTED).write_text("2\n")
    assert committed_run_steps(tmp_path) == []
    commit_step(tmp_path, 2)
    _part(tmp_path, 10, TRAINER_PART)  # uncommitted step: not resumable
    assert committed_run_steps(tmp_path) == [2]
    assert resolve_run_step(tmp_path, "latest", "resume") == 2 and resolve_run_step(tmp_path, None, "resume") is None
    with pytest.raises(FileNotFoundError, match=r"resume_step = 10 .*\(committed steps: \[2\]\)"):
        resolve_run_step(tmp_path, 10, "resume_step")


def test_retention_policy():
    committed = [2, 4, 6, 8, 10, 12]
    assert retained_steps(committed, None, None) == set(committed)
    assert retained_steps(committed, 2, None) == {10, 12}
    assert retained_steps(committed, 1, 4) == {4, 8, 12}
    assert retained_steps([3], 1, 100) == {3}  # the newest is always kept


def test_pruning_never_touches_the_newest_or_checkpoints_being_written(tmp_path):
    _commit(tmp_path, 1, 2, 3, 4)
    _part(tmp_path, 3, "stale")  # ignored by the rules: its step is committed
    _part(tmp_path, 0, TRAINER_PART)  # uncommitted, older than the newest committed: crash leftover
    _part(tmp_path, 5, ORCHESTRATOR_PART)  # being written (the orchestrator runs ahead)
    assert prune_checkpoints(tmp_path, committed_run_steps(tmp_path), 1, 2) == [0, 1, 3]
    assert committed_run_steps(tmp_path) == [2, 4] and step_dir(tmp_path, 5).is_dir()
    assert not list((tmp_path / "checkpoints").glob(".deleting_*"))
    assert prune_checkpoints(tmp_path, committed_run_steps(tmp_path), None, None) == []
    assert prune_checkpoints(tmp_path / "empty", [], 1, None) == []


def _write_run(root, steps):
    for step in range(1, steps + 1):
        (root / "rollouts" / f"step_{step}").mkdir(parents=True)
        weights_dir(root, step).mkdir(parents=True)
        (weights_dir(root, step) / READY).write_text("")
    (root / "weights" / ".tmp_step_9_123").mkdir()
    lines = [json.dumps({"step": s, "loss": 0.1 * s}) for s in range(1, steps + 1)]
    (root / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 9, "lo')  # torn last append
    (root / "weight_checks.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))


def test_prepare_resume_removes_everything_after_the_step(tmp_path):
    _write_run(tmp_path, 5)
    _commit(tmp_path, 2, 4)
    _part(tmp_path, 3, TRAINER_PART)  # uncommitted before the resumed step
    _part(tmp_path, 5, ORCHESTRATOR_PART)
    removed = prepare_resume(tmp_path, 2)
    assert {"rollouts/step_3", "weights/step_5", "weights/.tmp_step_9_123", "checkpoints/step_4"} <= set(removed)
    assert "4 record(s) of metrics.jsonl" in removed  # steps 3-5 and the torn line
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["step_1", "step_2"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_2"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert (tmp_path / "weight_checks.jsonl").read_text().count("\n") == 1  # step 2 is loaded and checked again
    assert prepare_resume(tmp_path, 2) == []  # idempotent
    assert prepare_resume(tmp_path, 0)  # start over: nothing of any step is left
    assert not (tmp_path / "metrics.jsonl").read_text() and not list((tmp_path / "weights").iterdir())


def _rl_config(tmp_path, *argv):
    base = ["--model.name", "m", "--max-steps", "4", "--output-dir", str(tmp_path), "--checkpoint.interval", "2"]
    return load_config(RLConfig, [*base, *argv])


def test_rl_resume_flags_reach_both_processes(tmp_path):
    config = _rl_config(tmp_path, "--resume", "--orchestrator.seed_requests")
    assert config.trainer.resume_step == config.orchestrator.resume_step == "latest"
    assert config.trainer.checkpoint == config.orchestrator.checkpoint == CheckpointConfig(interval=2)
    assert config.trainer.whole_run_checkpoints and config.inference.chunked_prefill is False
    assert _rl_config(tmp_path, "--resume-step", "3").orchestrator.resume_step == 3
    assert _rl_config(tmp_path).trainer.resume_step is None
    with pytest.raises(ConfigError, match="set trainer.resume_step with --resume"):
        _rl_config(tmp_path, "--trainer.resume_step", "2")
    with pytest.raises(ConfigError, match="trainer.checkpoint differs from the top-level checkpoint"):
        _rl_config(tmp_path, "--trainer.checkpoint.interval", "3")
    with pytest.raises(ConfigError, match="keep_every only matters with checkpoint.keep_last"):
        _rl_config(tmp_path, "--checkpoint.keep_every", "2")


def test_launcher_resolves_the_resume_step_and_prepares_the_run(tmp_path, capsys):
    _write_run(tmp_path, 3)
    _commit(tmp_path, 2)
    config = prepare_resume_run(_rl_config(tmp_path, "--resume"))
    assert config.trainer.resume_step == config.orchestrator.resume_step == config.resume_step == 2
    assert "resuming" in capsys.readouterr().out and not weights_dir(tmp_path, 3).exists()
    assert RLConfig.model_validate(config.model_dump()) == config  # the written rl.toml round-trips
    with pytest.raises(FileNotFoundError, match=r"resume_step = 1 .*\(committed steps: \[2\]\)"):
        prepare_resume_run(_rl_config(tmp_path, "--resume-step", "1"))
    (weights_dir(tmp_path, 2) / READY).unlink()
    with pytest.raises(FileNotFoundError, match="step_2 is missing or incomplete"):
        prepare_resume_run(_rl_config(tmp_path, "--resume"))
    fresh = prepare_resume_run(_rl_config(tmp_path / "new", "--resume"))
    assert fresh.trainer.resume_step is None and not fresh.resume
    assert "no committed checkpoint" in capsys.readouterr().out


def test_a_fresh_run_refuses_committed_checkpoints_and_clears_what_an_earlier_run_left(tmp_path, capsys):
    """Without --resume: a directory with committed checkpoints is refused (a later --resume would mix two runs);
    otherwise the earlier run's rollouts, weights and step records go, so the trainer cannot take them for this run's."""
    _write_run(tmp_path, 3)
    _commit(tmp_path, 2)
    with pytest.raises(ConfigError, match=r"committed checkpoints of an earlier run \(steps \[2\]\): continue it"):
        prepare_resume_run(_rl_config(tmp_path))
    assert committed_run_steps(tmp_path) == [2] and weights_dir(tmp_path, 3).exists()  # nothing touched

    other = tmp_path / "other"
    _write_run(other, 3)
    split = prepare_resume_run(
        _rl_config(other, "--deployment.run", '["trainer"]', "--weights.transport", "filesystem")
    )
    assert split.trainer.resume_step is None and weights_dir(other, 3).exists()  # it may have written already
    config = prepare_resume_run(_rl_config(other))
    assert config.trainer.resume_step is None and not config.resume
    assert not list((other / "rollouts").iterdir()) and not list((other / "weights").iterdir())
    assert not (other / "metrics.jsonl").read_text()
    assert "starting afresh" in capsys.readouterr().out
    prepare_resume_run(_rl_config(other))
    assert "starting afresh" not in capsys.readouterr().out  # nothing left to remove: nothing said


def test_resume_applies_the_retention_a_killed_run_did_not_get_to(tmp_path, capsys):
    """Found by benchmarks/chaos.py: a run killed after committing its last step but before pruning the one before
    kept that checkpoint forever (a run resumed at its last step commits nothing more, so never prunes)."""
    _write_run(tmp_path, 4)
    _commit(tmp_path, 2, 3, 4)  # keep_last = 1, keep_every = 2: step 3 should have gone when step 4 was committed
    retention = ["--checkpoint.keep-last", "1", "--checkpoint.keep-every", "2"]
    config = prepare_resume_run(_rl_config(tmp_path, "--resume", *retention))
    assert config.resume_step == 4
    assert committed_run_steps(tmp_path) == [2, 4] and not step_dir(tmp_path, 3).exists()
    assert "checkpoints/step_3 (beyond checkpoint.keep_last / keep_every)" in capsys.readouterr().out
