"""MetricsWriter (metrics.jsonl) and the console progress line."""

import json

import pytest

from slipstream.monitor.metrics import MetricsWriter, format_progress, merge_metrics, read_metrics


def test_writer_appends_one_json_line_per_step(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"loss": -0.5, "reward/mean": 0.25, "mismatch_kl_masked": None})
    record = writer.write(2, {"loss": 0.125})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["step"] == 1 and first["loss"] == -0.5 and first["reward/mean"] == 0.25
    assert first["mismatch_kl_masked"] is None and isinstance(first["time"], float)
    assert read_metrics(tmp_path)[1] == record
    assert read_metrics(tmp_path / "missing") == []


def test_writer_rejects_reserved_names(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        MetricsWriter(tmp_path).write(1, {"step": 3})


def test_merge_metrics_rejects_clashing_names():
    assert merge_metrics({"reward/mean": 1.0}, {"loss": 0.5}) == {"reward/mean": 1.0, "loss": 0.5}
    with pytest.raises(ValueError, match="clash"):
        merge_metrics({"loss": 1.0}, {"loss": 0.5})


def test_format_progress_full_line():
    metrics = {
        "reward/mean": 0.4123,
        "reward/std": 0.111,
        "loss": -0.01234,
        "mismatch_kl": 1.234e-4,
        "grad_norm": 0.531,
        "tokens_per_s": 812.4,
        "timing/step_s": 4.07,
    }
    line = format_progress(3, 10, metrics)
    assert line == "step 3/10 | reward 0.412 ± 0.11 | loss -0.01234 | kl 1.2e-04 | grad 0.53 | 812 tok/s | 4.1s"


def test_format_progress_skips_missing_and_shows_nan():
    line = format_progress(1, 2, {"loss": float("nan"), "mismatch_kl": None, "reward/mean": 1.0})
    assert line == "step 1/2 | reward 1.000 | loss nan"
