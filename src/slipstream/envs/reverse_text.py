"""reverse-text (as in prime-rl): reverse a short English text character by character.

Reward is the difflib similarity ratio between the model's answer and the reversed text (on the train split raised to
`train_reward_power`). The answer comes between <reversed_text> tags (prime-rl's format), or, with
`answer_format = "plain"`, is the whole reply.
"""

import difflib
import random
import re
from collections.abc import Sequence

from slipstream.envs.base import Task

SYSTEM_PROMPT = (
    "Reverse the text the user gives you character by character. "
    "Answer with the reversed text between <reversed_text> and </reversed_text>, and nothing else."
)
PLAIN_SYSTEM_PROMPT = (
    "Reverse the text the user gives you character by character. Answer with the reversed text only, and nothing else."
)
ANSWER_FORMATS = ("tags", "plain")

_WORDS = (
    "apple river stone cloud garden window silver quiet bright forest yellow ocean mountain paper "
    "candle morning winter summer little green orange simple market travel dinner letter friend "
    "castle engine planet rocket mirror button pencil basket honey lemon tiger rabbit horse "
    "bridge street island valley desert thunder shadow golden purple gentle happy sudden narrow "
    "ancient modern silent frozen wooden broken hidden open empty heavy light warm cold fast slow "
    "old new red blue black white small large long short sweet bitter soft hard clean dark early "
    "late lamp chair table music dream story voice smile water fire earth wind sun moon star "
    "road door book song bird fish tree leaf rain snow sand salt bread milk coffee tea sugar"
).split()
_ANSWER_RE = re.compile(r"<reversed_text>(.*?)(?:</reversed_text>|$)", re.DOTALL)
SPLITS = ("train", "eval")
MIN_TRAIN_WORDS = 10
"""Words `heldout_words` always leaves to the train split."""


class ReverseTextEnv:
    """Tasks are `min_words`..`max_words` random words, generated deterministically from `seed`.

    `heldout_words` > 0 reserves that many words of the vocabulary (a seeded choice) for the eval split: train tasks
    never contain them and eval tasks are made of them only, so the eval split measures reversal of words never
    trained on (with 0, the default, eval tasks are new combinations of the same words).

    `train_reward_power` p: a train task's reward is ratio ** p, so with p > 1 a near miss earns less against an exact
    reversal (0.9 -> 0.66 at p = 4) and training is pushed toward exact answers; eval tasks are always scored by the
    plain ratio, so held-out rewards stay comparable across settings.

    `answer_format`: "tags" (the default, prime-rl's): the answer is what the reply puts between <reversed_text> and
    </reversed_text>; "plain": the whole reply is the answer, and the system prompt asks for nothing else. A plain
    answer is about half the tokens (SmolLM2's tokenizer: ~10 against ~22 for 2-5 words), so each rollout costs about
    half as much to generate and to train on."""

    name = "reverse_text"

    def __init__(
        self,
        num_tasks: int = 1000,
        num_eval_tasks: int = 64,
        min_words: int = 3,
        max_words: int = 8,
        seed: int = 0,
        heldout_words: int = 0,
        train_reward_power: float = 1.0,
        answer_format: str = "tags",
    ) -> None:
        if not 1 <= min_words <= max_words:
            raise ValueError(f"reverse_text needs 1 <= min_words <= max_words, got {min_words} and {max_words}")
        if num_tasks < 1 or num_eval_tasks < 0:
            raise ValueError(
                f"reverse_text needs num_tasks >= 1 and num_eval_tasks >= 0, got {num_tasks}, {num_eval_tasks}"
            )
        if not 0 <= heldout_words <= len(_WORDS) - MIN_TRAIN_WORDS:
            raise ValueError(
                f"reverse_text needs 0 <= heldout_words <= {len(_WORDS) - MIN_TRAIN_WORDS} (the vocabulary has "
                f"{len(_WORDS)} words and training keeps at least {MIN_TRAIN_WORDS}), got {heldout_words}"
            )
        if not train_reward_power > 0:
            raise ValueError(f"reverse_text needs train_reward_power > 0, got {train_reward_power}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"reverse_text answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        self.train_reward_power = train_reward_power
        self.answer_format = answer_format
        system_prompt = SYSTEM_PROMPT if answer_format == "tags" else PLAIN_SYSTEM_PROMPT
        vocab = {"train": list(_WORDS), "eval": list(_WORDS)}
        if heldout_words:
            shuffled = sorted(_WORDS)
            random.Random(f"reverse_text:heldout_words:{seed}").shuffle(shuffled)
            vocab = {"train": sorted(shuffled[heldout_words:]), "eval": sorted(shuffled[:heldout_words])}
        sizes = {"train": num_tasks, "eval": num_eval_tasks}
        self._tasks = {
            split: _make_tasks(split, sizes[split], min_words, max_words, seed, vocab[split], system_prompt)
            for split in SPLITS
        }

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in self._tasks:
            raise ValueError(f"reverse_text has no split {split!r}; splits: {', '.join(SPLITS)}")
        return self._tasks[split]

    def solution(self, task: Task) -> str:
        """The reply that earns the full reward, in this environment's answer format (SFT data)."""
        return f"<reversed_text>{task.answer}</reversed_text>" if self.answer_format == "tags" else task.answer

    def reward(self, task: Task, completion_text: str) -> float:
        answer = parse_answer(completion_text) if self.answer_format == "tags" else completion_text.strip()
        ratio = difflib.SequenceMatcher(None, answer, task.answer, autojunk=False).ratio()
        return ratio**self.train_reward_power if task.info.get("split") == "train" else ratio


def parse_answer(completion_text: str) -> str:
    """The text inside <reversed_text>...</reversed_text> (closing tag optional), else the whole stripped reply."""
    match = _ANSWER_RE.search(completion_text)
    return (match.group(1) if match else completion_text).strip()


def _make_tasks(
    split: str, num_tasks: int, min_words: int, max_words: int, seed: int, words: Sequence[str], system_prompt: str
) -> list[Task]:
    # A string seed is hashed with sha512 by `random`, so tasks are identical across processes and runs.
    rng = random.Random(f"reverse_text:{split}:{seed}")
    tasks = []
    for i in range(num_tasks):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))
        prompt = [{"role": "system", "content": system_prompt}, {"role": "user", "content": text}]
        tasks.append(Task(id=f"{split}-{i}", prompt=prompt, answer=text[::-1], info={"text": text, "split": split}))
    return tasks
