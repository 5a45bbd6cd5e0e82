"""reverse_text environment: rewards on known answers, deterministic tasks, registry errors."""

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.envs.base import Environment, score
from slipstream.envs.registry import build_env, known_envs
from slipstream.envs.reverse_text import ReverseTextEnv, parse_answer


def test_exact_reversal_scores_one():
    env = ReverseTextEnv(num_tasks=5, seed=1)
    task = env.tasks("train")[0]
    text = task.prompt[-1]["content"]
    assert env.reward(task, f"<reversed_text>{text[::-1]}</reversed_text>") == 1.0
    assert env.reward(task, f"  {text[::-1]}\n") == 1.0
    assert env.reward(task, f"<reversed_text>\n{text[::-1]}") == 1.0  # truncated closing tag


def test_garbage_scores_low():
    env = ReverseTextEnv(num_tasks=5, seed=1)
    task = env.tasks("train")[0]
    assert env.reward(task, "zzzzzzzzzzzzzzzzzzzzzzzzzzzzzz") < 0.2
    assert env.reward(task, "") == 0.0
    # Unreversed text is only partially similar.
    assert env.reward(task, task.prompt[-1]["content"]) < 1.0


def test_train_reward_power_sharpens_train_rewards_only():
    plain, sharp = ReverseTextEnv(num_tasks=5, seed=1), ReverseTextEnv(num_tasks=5, seed=1, train_reward_power=4)
    for split in ("train", "eval"):
        task = sharp.tasks(split)[0]
        near_miss = task.answer[:-2]
        ratio = plain.reward(task, near_miss)
        assert 0.5 < ratio < 1.0
        expected = ratio**4 if split == "train" else ratio  # held-out tasks keep the plain ratio: comparable scores
        assert sharp.reward(task, near_miss) == pytest.approx(expected)
        assert sharp.reward(task, task.answer) == 1.0
    with pytest.raises(ValueError, match="train_reward_power > 0"):
        ReverseTextEnv(train_reward_power=0)


def test_plain_answer_format_scores_the_whole_reply():
    tags, plain = ReverseTextEnv(num_tasks=5, seed=1), ReverseTextEnv(num_tasks=5, seed=1, answer_format="plain")
    assert [t.answer for t in plain.tasks("train")] == [t.answer for t in tags.tasks("train")]  # the same texts
    task = plain.tasks("train")[0]
    assert "<reversed_text>" in tags.tasks("train")[0].prompt[0]["content"]
    assert "<reversed_text>" not in task.prompt[0]["content"] and "only" in task.prompt[0]["content"]
    assert plain.solution(task) == task.answer and plain.reward(task, f" {task.answer}\n") == 1.0
    assert tags.solution(task) == f"<reversed_text>{task.answer}</reversed_text>"
    assert tags.reward(task, tags.solution(task)) == 1.0
    # tags in a plain reply are part of its answer: not an exact reversal any more
    assert plain.reward(task, tags.solution(task)) < 0.9
    with pytest.raises(ValueError, match="answer_format must be one of"):
        ReverseTextEnv(answer_format="xml")


def test_tasks_are_deterministic_and_in_range():
    a = ReverseTextEnv(num_tasks=50, min_words=3, max_words=8, seed=7)
    b = ReverseTextEnv(num_tasks=50, min_words=3, max_words=8, seed=7)
    c = ReverseTextEnv(num_tasks=50, min_words=3, max_words=8, seed=8)
    assert [t.prompt for t in a.tasks("train")] == [t.prompt for t in b.tasks("train")]
    assert [t.answer for t in a.tasks("train")] != [t.answer for t in c.tasks("train")]
    assert [t.answer for t in a.tasks("train")] != [t.answer for t in a.tasks("eval")][:50]
    for task in a.tasks("train"):
        text = task.prompt[-1]["content"]
        assert 3 <= len(text.split()) <= 8
        assert task.answer == text[::-1]
        assert [m["role"] for m in task.prompt] == ["system", "user"]
    assert len({t.id for t in a.tasks("train")}) == 50


def test_protocol_registry_and_async_score():
    env = build_env("reverse_text", num_tasks=3)
    assert isinstance(env, Environment)
    assert "reverse_text" in known_envs()
    task = env.tasks("train")[1]
    assert asyncio.run(score(env, task, task.answer)) == 1.0
    with pytest.raises(ValueError, match="known: .*reverse_text"):
        build_env("nope")
    with pytest.raises(ValueError, match="orchestrator.env.args"):
        build_env("reverse_text", bogus=1)
    with pytest.raises(ValueError, match="splits"):
        env.tasks("test")


def test_parse_answer():
    assert parse_answer("blah <reversed_text> cba </reversed_text> tail") == "cba"
    assert parse_answer(" cba ") == "cba"


def test_default_tasks_are_unchanged_by_the_heldout_words_option():
    """The demo's settings (examples/reverse_text) give the same tasks as when its figures were measured."""
    env = ReverseTextEnv(num_tasks=1000, num_eval_tasks=64, min_words=2, max_words=5)
    assert env.tasks("train")[0].info["text"] == "castle engine valley forest"
    assert env.tasks("eval")[0].info["text"] == "large rain modern basket white"


def test_heldout_words_keep_the_eval_vocabulary_out_of_training():
    env = ReverseTextEnv(num_tasks=500, num_eval_tasks=64, min_words=2, max_words=5, heldout_words=20)
    train_words = {w for t in env.tasks("train") for w in t.info["text"].split()}
    eval_words = {w for t in env.tasks("eval") for w in t.info["text"].split()}
    assert not train_words & eval_words
    assert len(eval_words) <= 20 and len(eval_words) > 10  # 64 tasks of 2-5 words draw most of the 20
    again = ReverseTextEnv(num_tasks=500, num_eval_tasks=64, min_words=2, max_words=5, heldout_words=20)
    assert [t.answer for t in again.tasks("eval")] == [t.answer for t in env.tasks("eval")]
    for bad in (-1, 10_000):
        with pytest.raises(ValueError, match="heldout_words"):
            ReverseTextEnv(heldout_words=bad)


def test_sft_data_script_writes_solved_examples_in_the_word_range_asked(tmp_path):
    """examples/reverse_text/make_sft_data.py: the environment's prompt + the exact reversal, texts of --min-words to
    --max-words words (prime-rl's split: SFT on other lengths than RL)."""
    script = Path(__file__).parents[2] / "examples/reverse_text/make_sft_data.py"
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--min-words", "6", "--max-words", "8"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "wrote 1000 rows" in run.stdout
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 1000
    lengths = set()
    for row in rows:
        system, user, answer = row["messages"]
        lengths.add(len(user["content"].split()))
        assert answer["content"] == f"<reversed_text>{user['content'][::-1]}</reversed_text>"
    assert lengths == {6, 7, 8}
    plain = tmp_path / "plain"
    subprocess.run(
        [sys.executable, str(script), str(plain), "--answer-format", "plain"], capture_output=True, check=True
    )
    for line in (plain / "val.jsonl").read_text().splitlines():
        system, user, answer = json.loads(line)["messages"]
        assert answer["content"] == user["content"][::-1] and "<reversed_text>" not in system["content"]
    bad = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--min-words", "5", "--max-words", "2"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "min_words <= max_words" in bad.stderr


def test_demo_summary_takes_reference_answers_from_the_rl_runs_own_heldout_tasks(tmp_path):
    """examples/reverse_text/summary.py: the length ratio's reference is the RL run's held-out tasks (rebuilt from its
    resolved config), not the SFT data, which the demo writes with other text lengths."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "demo_summary", Path(__file__).parents[2] / "examples/reverse_text/summary.py"
    )
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    config = tmp_path / "config" / "rl.toml"
    config.parent.mkdir()
    args = {"num_tasks": 10, "num_eval_tasks": 7, "min_words": 2, "max_words": 3}
    config.write_text(
        '[orchestrator.env]\nname = "reverse_text"\nargs = { num_tasks = 10, num_eval_tasks = 7, min_words = 2, max_words = 3 }\n'
    )
    answers = summary.heldout_answers(tmp_path)
    expected = [t.answer for t in ReverseTextEnv(**args).tasks("eval")]
    assert answers == [f"<reversed_text>{a}</reversed_text>" for a in expected]
    assert all(2 <= len(a.split()) <= 3 for a in expected)
    config.write_text('[orchestrator.env]\nname = "other"\nargs = {}\n')
    with pytest.raises(SystemExit, match="this summary is for reverse_text"):
        summary.heldout_answers(tmp_path)
