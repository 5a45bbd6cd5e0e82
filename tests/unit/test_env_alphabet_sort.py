"""alphabet_sort: per-turn correctness drives the reward; tasks are deterministic."""

from slipstream.envs.alphabet_sort import AlphabetSortEnv, parse_names, turn_score
from slipstream.envs.driver_testing import assistant, play


def _sorted_reply(names: list[str]) -> str:
    return "<sorted>\n" + "\n".join(sorted(names)) + "\n</sorted>"


def perfect_policy(task):
    schedule = task.answer
    return [assistant(_sorted_reply([n for turn in schedule[: k + 1] for n in turn])) for k in range(len(schedule))]


def test_perfect_answers_score_one_and_turns_follow_the_schedule():
    env = AlphabetSortEnv(num_tasks=20, min_turns=3, max_turns=3, seed=3)
    for task in env.tasks("train")[:5]:
        result = play(env, task, perfect_policy(task))
        assert result.reward.value == 1.0 and result.reward.metrics["exact_turns"] == 1.0
        users = [m["content"] for m in result.messages if m["role"] == "user"]
        assert len(users) == 3 and all(name in users[1] for name in task.answer[1])


def test_wrong_and_missing_turns_lose_credit():
    env = AlphabetSortEnv(num_tasks=5, min_turns=2, max_turns=2, min_names_per_turn=3, max_names_per_turn=3, seed=1)
    task = env.tasks("train")[0]
    first, second = task.answer
    unsorted = "<sorted>\n" + "\n".join(sorted(first)[::-1]) + "\n</sorted>"
    result = play(env, task, [assistant(unsorted), assistant(_sorted_reply(first + second))])
    assert 0.5 <= result.reward.value < 1.0 and result.reward.metrics["exact_turns"] == 0.5
    # No tags: zero for that turn.
    result = play(env, task, [assistant(_sorted_reply(first)), assistant("no idea")])
    assert result.reward.value == 0.5
    # A rollout cut short (here by the turn limit) scores the unanswered turns as 0.
    env.max_turns = 1
    result = play(env, task, [assistant(_sorted_reply(first))])
    assert result.stop_reason == "max_turns" and result.reward.value == 0.5


def test_parse_and_score():
    assert parse_names("<sorted>\nAda Lee\n Bo King \n</sorted> trailing") == ["Ada Lee", "Bo King"]
    assert parse_names("<sorted>a</sorted><sorted>\nb\nc") == ["b", "c"]
    assert parse_names("Ada Lee") == []
    assert parse_names("Ada Lee\n\n Bo King", without_tags=True) == ["Ada Lee", "Bo King"]
    assert parse_names("x\n<sorted>Bo King", without_tags=True) == ["Bo King"]  # tags win when present
    assert turn_score(["a", "b"], ["a", "b"], 4.0) == 1.0
    assert 0 < turn_score(["a", "c"], ["a", "b"], 4.0) < turn_score(["a", "c"], ["a", "b"], 1.0) < 1


def test_tasks_are_deterministic_and_distinct():
    a, b = AlphabetSortEnv(num_tasks=30, seed=5), AlphabetSortEnv(num_tasks=30, seed=5)
    assert [t.answer for t in a.tasks("train")] == [t.answer for t in b.tasks("train")]
    assert [t.answer for t in a.tasks("train")] != [t.answer for t in AlphabetSortEnv(num_tasks=30).tasks("train")]
    for task in a.tasks("train"):
        names = [n for turn in task.answer for n in turn]
        assert len(names) == len(set(names)) and 2 <= len(task.answer) <= 3
        assert task.prompt[0]["role"] == "system"


def test_answers_without_tags_get_partial_credit_when_enabled():
    task = AlphabetSortEnv(num_tasks=5, min_turns=2, max_turns=2, seed=1).tasks("train")[0]
    first, second = task.answer
    untagged = [assistant("\n".join(sorted(first))), assistant("\n".join(sorted(first + second)))]
    assert play(AlphabetSortEnv(num_tasks=5, min_turns=2, max_turns=2, seed=1), task, untagged).reward.value == 0.0
    lenient = AlphabetSortEnv(num_tasks=5, min_turns=2, max_turns=2, seed=1, answers_without_tags=True)
    assert play(lenient, task, untagged).reward.value == 1.0
