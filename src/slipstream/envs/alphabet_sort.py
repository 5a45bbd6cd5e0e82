"""alphabet-sort (multi-turn, as in prime-rl): each turn the user adds names; the model answers with every name so
far in alphabetical order. Reward: mean over the task's turns of the per-turn score (turns never reached score 0).

Per-turn score = (difflib ratio between the answered and the expected list of names) ** `similarity_power`, so an
exactly sorted list scores 1 and near misses get a little credit.
"""

import difflib
import random
import re
from collections.abc import Sequence

from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, Message, RewardResult, State, Task
from slipstream.envs.multiturn import MultiTurnEnv, check_task_counts, split_tasks

SYSTEM_PROMPT = (
    "You sort names alphabetically. Each user message gives you more names. Reply with ALL names given so far, "
    "in alphabetical order, one per line, between <sorted> and </sorted>, and nothing else."
)
_FIRST = (
    "Ada Adam Adrian Aiden Alan Alba Albert Alex Alice Amber Amelia Ana Andre Anna Anne Arlo Aron Ava Axel Bea Ben "
    "Bianca Blake Bo Bruno Caleb Cara Carl Cecil Chloe Clara Cleo Colin Dan Dana Dara Dean Delia Dora Eden Edgar "
    "Elena Eli Ella Elsa Emil Emma Enzo Eric Erin Esme Eva Ezra Felix Fern Finn Flora Frank Gail Gemma Gia Grace "
    "Greta Hana Hank Hazel Hugo Ian Ida Ines Iris Isla Ivan Ivy Jade Jake Jana Jay Joel Jude June Kai Kara Kate "
    "Kira Lana Lara Leo Lena Levi Lila Lina Liam Lola Luca Lucy Luna Mae Maia Mara Max Mia Milo Mina Nell Nia Nico "
    "Nina Noah Nora Olga Omar Otto Owen Pia Remy Rhea Rosa Ruby Ruth Sara Sami Seth Sofia Tara Theo Tom Uma Vera "
    "Vic Wade Wren Yara Yuri Zane Zara Zoe"
).split()
_LAST = (
    "Abbott Acosta Adler Baker Banks Barnes Bauer Becker Bell Berg Blair Bond Brandt Brooks Burke Byrne Cain Carr "
    "Chen Clark Cole Cross Dahl Dalton Davis Dean Diaz Doyle Drake Dunn Eaton Ellis Engel Evans Falk Fischer Flynn "
    "Ford Fox Frey Gill Graf Grant Gray Gross Hahn Hale Hall Hart Hayes Holt Horn Hunt Ito Jansen Kane Keller Kent "
    "King Klein Koch Kraft Lang Lee Lind Long Lowe Lutz Marsh Meyer Moss Nash Novak Olsen Park Pratt Quinn Reed "
    "Roth Ruiz Sato Shaw Stone Voss Wade Walsh Weber Wolf Young Zhang"
).split()
_ANSWER_RE = re.compile(r"<sorted>(.*?)(?:</sorted>|$)", re.DOTALL)


def parse_names(text: str, without_tags: bool = False) -> list[str]:
    """Names inside the last <sorted>...</sorted> (closing tag optional), one per line. Without the tag: [] or,
    with `without_tags`, every non-empty line of the reply."""
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return [line.strip() for line in text.splitlines() if line.strip()] if without_tags else []
    return [line.strip() for line in matches[-1].splitlines() if line.strip()]


def turn_score(answer: list[str], expected: list[str], power: float) -> float:
    return difflib.SequenceMatcher(None, answer, expected, autojunk=False).ratio() ** power


def _names_message(names: Sequence[str], first: bool) -> Message:
    lead = "Sort these names:" if first else "Add these names and sort all names so far:"
    return {"role": "user", "content": lead + "\n" + "\n".join(names)}


class AlphabetSortEnv(MultiTurnEnv):
    """Tasks have `min_turns`..`max_turns` turns of `min_names_per_turn`..`max_names_per_turn` distinct
    "First Last" names, generated deterministically from `seed`."""

    name = "alphabet_sort"

    def __init__(
        self,
        num_tasks: int = 1000,
        num_eval_tasks: int = 64,
        min_turns: int = 2,
        max_turns: int = 3,
        min_names_per_turn: int = 2,
        max_names_per_turn: int = 4,
        similarity_power: float = 4.0,
        answers_without_tags: bool = False,
        seed: int = 0,
        rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S,
    ) -> None:
        if not 1 <= min_turns <= max_turns or not 1 <= min_names_per_turn <= max_names_per_turn:
            raise ValueError(
                "alphabet_sort needs 1 <= min_turns <= max_turns and 1 <= min_names_per_turn <= max_names_per_turn, "
                f"got turns {min_turns}..{max_turns}, names {min_names_per_turn}..{max_names_per_turn}"
            )
        if similarity_power <= 0:
            raise ValueError(f"alphabet_sort needs similarity_power > 0, got {similarity_power}")
        super().__init__(max_turns=max_turns, rollout_timeout_s=rollout_timeout_s)
        self.similarity_power = similarity_power
        self.answers_without_tags = answers_without_tags
        """Score a reply without <sorted> tags by its lines (as reverse_text scores an untagged reply) instead of 0:
        partial credit for small models that list names but never learned the tag format."""
        sizes = check_task_counts(self.name, num_tasks, num_eval_tasks)
        shape = (min_turns, max_turns, min_names_per_turn, max_names_per_turn)
        self._tasks = {split: _make_tasks(split, n, shape, seed) for split, n in sizes.items()}

    def tasks(self, split: str) -> Sequence[Task]:
        return split_tasks(self.name, self._tasks, split)

    async def setup_state(self, task: Task) -> State:
        return {"schedule": task.answer, "turn": 0, "scores": [], "exact": []}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        """Score the answer to the current turn; then hand out the next turn's names, if any."""
        schedule: list[list[str]] = state["schedule"]
        turn = state["turn"]
        expected = sorted(name for names in schedule[: turn + 1] for name in names)
        answer = parse_names(messages[-1].get("content") or "", self.answers_without_tags)
        state["scores"].append(turn_score(answer, expected, self.similarity_power))
        state["exact"].append(answer == expected)
        state["turn"] = turn + 1
        if state["turn"] == len(schedule):
            return [], True
        return [_names_message(schedule[state["turn"]], first=False)], False

    async def reward(self, task: Task, state: State) -> RewardResult:
        num_turns = len(task.answer)
        scores = state["scores"] + [0.0] * (num_turns - len(state["scores"]))
        return RewardResult(
            value=sum(scores) / num_turns,
            metrics={
                "exact_turns": sum(state["exact"]) / num_turns,
                "answered_turns": float(len(state["scores"])),
                "num_task_turns": float(num_turns),
            },
        )


def _make_tasks(split: str, num_tasks: int, shape: tuple[int, int, int, int], seed: int) -> list[Task]:
    min_turns, max_turns, min_names, max_names = shape
    rng = random.Random(f"alphabet_sort:{split}:{seed}")
    tasks = []
    for i in range(num_tasks):
        num_turns = rng.randint(min_turns, max_turns)
        counts = [rng.randint(min_names, max_names) for _ in range(num_turns)]
        pool: set[str] = set()
        while len(pool) < sum(counts):
            pool.add(f"{rng.choice(_FIRST)} {rng.choice(_LAST)}")
        names = rng.sample(sorted(pool), len(pool))
        schedule, start = [], 0
        for count in counts:
            schedule.append(names[start : start + count])
            start += count
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, _names_message(schedule[0], first=True)]
        tasks.append(Task(id=f"{split}-{i}", prompt=prompt, answer=schedule, info={"num_turns": num_turns}))
    return tasks
