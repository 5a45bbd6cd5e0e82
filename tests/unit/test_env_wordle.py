"""wordle: feedback marks, reward for solving (fewer guesses better) with format partial credit."""

import pytest

from slipstream.envs.driver_testing import assistant, play
from slipstream.envs.wordle import FORMAT_WEIGHT, SOLVE_WEIGHT, WORDS, WordleEnv, feedback, parse_guess, solved_score


def guess(word: str):
    return assistant(f"Let me think. <guess>{word}</guess>")


@pytest.fixture
def env_task():
    env = WordleEnv(num_tasks=10, max_guesses=6, seed=2)
    return env, env.tasks("train")[0]


def test_first_guess_win_scores_one(env_task):
    env, task = env_task
    result = play(env, task, [guess(task.answer.upper())])
    assert result.reward.value == pytest.approx(1.0) and result.reward.metrics["solved"] == 1.0
    assert result.stop_reason == "env_done" and "Solved" in result.messages[-1]["content"]


def test_fewer_guesses_score_more(env_task):
    env, task = env_task
    wrong = [w for w in WORDS if w != task.answer][:5]
    rewards = [play(env, task, [guess(w) for w in wrong[:k]] + [guess(task.answer)]).reward.value for k in range(6)]
    assert rewards == sorted(rewards, reverse=True) and len(set(rewards)) == 6
    assert rewards[-1] == pytest.approx(SOLVE_WEIGHT * 0.5 + FORMAT_WEIGHT)


def test_unsolved_gets_only_format_credit(env_task):
    env, task = env_task
    wrong = [w for w in WORDS if w != task.answer][:6]
    result = play(env, task, [guess(w) for w in wrong])
    assert result.reward.value == pytest.approx(FORMAT_WEIGHT) and result.reward.metrics["solved"] == 0.0
    assert result.stop_reason == "env_done" and f"The word was {task.answer}" in result.messages[-1]["content"]
    half = [guess(w) for w in wrong[:3]] + [assistant("no tags"), assistant("<guess>toolong</guess>"), guess(wrong[5])]
    result = play(env, task, half)
    assert result.reward.value == pytest.approx(FORMAT_WEIGHT * 4 / 6)
    assert "invalid" in result.messages[-3]["content"] and "invalid" in result.messages[-5]["content"]


def test_feedback_marks_with_repeated_letters():
    assert feedback("crane", "crane") == "GGGGG"
    assert feedback("slate", "crane") == "..G.G"
    assert feedback("eerie", "there") == "Y.Y.G"  # the secret has two e's; the third e gets no mark
    assert feedback("speed", "abide") == "..Y.Y"
    assert feedback("allee", "apple") == "GY..G"


def test_parse_guess_and_scores():
    assert parse_guess("<guess> CRANE </guess>") == "crane"
    assert parse_guess("<guess>crane</guess> then <guess>slate</guess>") == "slate"
    assert parse_guess("<guess>cran</guess>") is None and parse_guess("crane") is None
    assert parse_guess("<guess>cr4ne</guess>") is None
    assert solved_score(1, 6) == 1.0 and solved_score(6, 6) == 0.5 and solved_score(1, 1) == 1.0


def test_words_and_tasks():
    assert all(len(w) == 5 and w.isalpha() and w.islower() for w in WORDS) and len(set(WORDS)) == len(WORDS)
    a, b = WordleEnv(num_tasks=50, seed=1), WordleEnv(num_tasks=50, seed=1)
    assert [t.answer for t in a.tasks("train")] == [t.answer for t in b.tasks("train")]
    assert len({t.answer for t in a.tasks("train")}) > 20
