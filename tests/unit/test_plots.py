"""monitor/plots.py: fake run files -> valid, non-empty PNGs; panels follow the data that exists."""

import json
import math

import pytest

from slipstream.monitor.plots import (
    build_panels,
    main,
    metric_series,
    read_eval_results,
    read_jsonl,
    write_plots,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _fake_run(run_dir, num_steps=6, with_eval=True):
    run_dir.mkdir(parents=True, exist_ok=True)
    records = []
    for step in range(1, num_steps + 1):
        record = {
            "step": step,
            "time": 1000.0 + step,
            "reward/mean": 0.1 + 0.05 * step,
            "reward/std": 0.1,
            "loss": -0.01 * step,
            "mismatch_kl": 1e-5 * step if step > 1 else None,  # None: no loss tokens this step
            "grad_norm": 0.5 + 0.1 * step,
            "timing/step_s": 2.0,
            "timing/generate_s": 1.5,
        }
        records.append(record)
    _write_jsonl(run_dir / "metrics.jsonl", records)
    # online evaluations: of policy versions 0, 3, 6 (their metrics also land in later batches' records)
    (run_dir / "eval").mkdir()
    online = [{"step": v, "reward_mean": 0.2 + 0.02 * v, "reward_stderr": 0.03} for v in (0, 3, num_steps)]
    _write_jsonl(run_dir / "eval" / "online.jsonl", online)
    _write_jsonl(run_dir / "weight_checks.jsonl", [{"step": s, "max_abs_diff": 1e-6 * s} for s in range(1, 4)])
    if with_eval:
        for step, reward in ((0, 0.15), (num_steps, 0.4)):
            result = {"step": step, "reward_mean": reward, "reward_stderr": 0.02, "pass_at_k": {"1": 0.1}}
            (run_dir / "eval" / f"step_{step}.json").write_text(json.dumps(result))
    return run_dir


def test_write_plots_makes_valid_pngs(tmp_path):
    run = _fake_run(tmp_path / "run")
    paths = write_plots(run)
    names = {p.name for p in paths}
    expected = {"reward", "eval_reward", "mismatch_kl", "step_time", "loss", "grad_norm", "weight_sync", "overview"}
    assert names == {f"{n}.png" for n in expected}
    for path in paths:
        assert path.parent == run / "plots"
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), path
    assert not list((run / "plots").glob(".*.tmp"))  # atomic writes leave no temp files


def test_panels_skip_missing_data(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    _write_jsonl(run / "metrics.jsonl", [{"step": 1, "time": 0.0, "reward/mean": 0.3, "reward/std": 0.1}])
    paths = write_plots(run)
    assert sorted(p.name for p in paths) == ["overview.png", "reward.png"]


def test_metric_series_skips_none_and_nan():
    records = [{"step": 1, "x": None}, {"step": 2, "x": 0.5, "s": 0.1}, {"step": 3, "x": math.nan}, {"step": 4}]
    series = metric_series(records, "x", "x", spread_key="s")
    assert (series.steps, series.values, series.spread) == ([2], [0.5], [0.1])


def test_eval_panels_combine_online_and_offline(tmp_path):
    run = _fake_run(tmp_path / "run")
    from slipstream.monitor.metrics import read_metrics

    online_records = read_jsonl(run / "eval" / "online.jsonl")
    panels = {p.name: p for p in build_panels(read_metrics(run), [], read_eval_results(run), online_records)}
    labels = [s.label for s in panels["eval_reward"].series]
    assert labels == ["held-out (online)", "held-out (slipstream eval)"]
    online, offline = panels["eval_reward"].series
    assert online.steps == [0, 3, 6] and online.values == pytest.approx([0.2, 0.26, 0.32])
    assert offline.steps == [0, 6] and offline.values == [0.15, 0.4]
    assert panels["mismatch_kl"].log_y and "weight_sync" not in panels


def test_errors_are_clear(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_plots(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "step_1.json").write_text("{not json")
    with pytest.raises(ValueError, match="step_1.json is not valid JSON"):
        write_plots(tmp_path)


def test_cli_main_prints_paths(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", with_eval=False)
    assert main([str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(run / "plots" / "reward.png") in printed


def test_heldout_lines_compare_policy_zero_with_the_last_evaluation(tmp_path):
    from slipstream.monitor.heldout import heldout_lines

    assert heldout_lines(tmp_path) == []  # no online evaluation
    (tmp_path / "eval").mkdir()
    base = {"env": "reverse_text", "split": "eval", "num_tasks": 64, "num_samples": 4, "reward_stderr": 0.01}
    _write_jsonl(tmp_path / "eval" / "online.jsonl", [base | {"step": 0, "reward_mean": 0.1354}])
    assert heldout_lines(tmp_path) == []  # only the policy before training
    records = [
        base | {"step": s, "reward_mean": r, "completion_tokens_mean": n}
        for s, r, n in ((0, 0.1354, 35.46), (20, 0.3, 22.0), (10, 0.25, 30.0))
    ]
    _write_jsonl(tmp_path / "eval" / "online.jsonl", records)
    detail, last = heldout_lines(tmp_path)
    assert last == "heldout_reward: before 0.135 after 0.300"
    assert "reverse_text/eval, 64 tasks x 4 samples" in detail and "v20 0.300" in detail
    assert detail.endswith("mean completion tokens 35.5 -> 22.0")
