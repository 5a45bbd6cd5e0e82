"""monitor/phases.py: the base / SFT / RL summary lines and the phase plot, from fake evaluation and run files."""

import json

import pytest

from slipstream.monitor.phases import PhaseScore, phase_lines, phase_panels, phase_score, rl_scores, write_phase_plot


def _eval(reward, exact, tokens, threshold=1.0):
    return {
        "reward_mean": reward,
        "reward_stderr": 0.01,
        "pass_threshold": threshold,
        "pass_at_k": {"1": exact, "4": min(1.0, 2 * exact)},
        "completion_tokens_mean": tokens,
    }


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _runs(tmp_path):
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    sft_records = [{"step": s, "loss": 1.0 / s} | ({"val/loss": 0.5 / s} if s % 2 == 0 else {}) for s in range(1, 7)]
    _write_jsonl(sft / "metrics.jsonl", sft_records)
    _write_jsonl(rl / "metrics.jsonl", [{"step": s, "reward/mean": 0.6 + 0.01 * s} for s in range(1, 5)])
    online = [_eval(0.62, 0.2, 23.0) | {"step": 0}, _eval(0.7, 0.3, 22.0) | {"step": 4}, _eval(0.66, 0.25, 22.5)]
    online[2]["step"] = 2
    _write_jsonl(rl / "eval" / "online.jsonl", online)
    return sft, rl


def test_phase_score_reads_reward_exact_rate_and_length():
    assert phase_score(_eval(0.5, 0.25, 20.0)) == PhaseScore(0.5, 0.01, 0.25, 20.0)


def test_phase_score_refuses_an_evaluation_that_does_not_count_exact_answers():
    with pytest.raises(ValueError, match="pass_threshold = 1.0"):
        phase_score(_eval(0.5, 0.25, 20.0, threshold=0.9))
    with pytest.raises(ValueError, match="no pass@1"):
        phase_score(_eval(0.5, 0.25, 20.0) | {"pass_at_k": {}})


def test_rl_scores_are_policy_zero_and_the_last_evaluation(tmp_path):
    _, rl = _runs(tmp_path)
    sft, after = rl_scores(rl)
    assert (sft.reward, sft.exact) == (0.62, 0.2)
    assert (after.reward, after.exact, after.completion_tokens) == (0.7, 0.3, 22.0)  # step 4, written before step 2
    _write_jsonl(rl / "eval" / "online.jsonl", [_eval(0.62, 0.2, 23.0) | {"step": 0}])
    with pytest.raises(ValueError, match="no online evaluation of policy 0 and of a later policy"):
        rl_scores(rl)


def test_phase_lines_print_each_phase_and_the_length_ratio():
    scores = {
        "base": PhaseScore(0.1284, 0.004, 0.0, 35.5),
        "sft": PhaseScore(0.7, 0.01, 0.25, 23.0),
        "rl": PhaseScore(0.8, 0.01, 0.4, 22.0),
    }
    assert phase_lines(scores, reference_tokens=20.0) == [
        "heldout_reward: base 0.128 sft 0.700 rl 0.800",
        "heldout_exact: base 0.000 sft 0.250 rl 0.400",
        "heldout_length_ratio: 1.100",
    ]
    with pytest.raises(ValueError, match="positive mean token count"):
        phase_lines(scores, reference_tokens=0.0)


def test_phase_panels_put_rl_after_sft_on_one_step_axis(tmp_path):
    sft, rl = _runs(tmp_path)
    panels, sft_steps, rl_steps = phase_panels(_eval(0.13, 0.0, 35.0), sft, rl)
    assert (sft_steps, rl_steps) == (6, 4)
    by_name = {p.name: p for p in panels}
    train, validation = by_name["sft_loss"].series
    assert train.steps == [1, 2, 3, 4, 5, 6] and validation.steps == [2, 4, 6]
    rl_train, heldout = by_name["reward"].series
    assert rl_train.steps == [7, 8, 9, 10]
    assert heldout.steps == [0, 6, 10, 8] and heldout.values == [0.13, 0.62, 0.7, 0.66]
    assert by_name["exact"].series[0].values == [0.0, 0.2, 0.3, 0.25]


def test_write_phase_plot_writes_a_png(tmp_path):
    sft, rl = _runs(tmp_path)
    path = write_phase_plot(tmp_path / "plots" / "phases.png", _eval(0.13, 0.0, 35.0), sft, rl)
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(ValueError, match="phase plots need"):
        write_phase_plot(tmp_path / "x.png", _eval(0.13, 0.0, 35.0), tmp_path / "missing", rl)
