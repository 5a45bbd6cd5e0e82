"""wordle (multi-turn word game): guess a secret 5-letter word; after each guess the environment marks every letter.

Reward = 0.8 * solved_score + 0.2 * format_score, where solved_score is 0 when unsolved, 1.0 for a first-guess win
down to 0.5 for a win on the last allowed guess (fewer guesses are better), and format_score is the fraction of
turns whose reply held a well-formed guess (<guess>five letters</guess>).
"""

import random
import re
from collections.abc import Sequence

from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, Message, RewardResult, State, Task
from slipstream.envs.multiturn import MultiTurnEnv, check_task_counts, split_tasks

WORD_LENGTH = 5
SOLVE_WEIGHT, FORMAT_WEIGHT = 0.8, 0.2
WORDS = tuple(
    (
        "about above actor acute adopt adult after again agent agree alarm album alert alike alive allow alone "
        "along alter among angle angry apple apply arena argue arise armor array arrow aside asset avoid award "
        "aware badge baker basic beach begin being below bench birth black blade blame blank blast blend bless "
        "blind block blood board boost booth brain brand brave bread break brick brief bring broad brown brush "
        "build bunch burst buyer cabin cable candy cargo carry catch cause chain chair chalk charm chart chase "
        "cheap check chest chief child choir civil claim class clean clear climb clock close cloud coach coast "
        "count court cover craft crane crash cream crime cross crowd crown curve cycle daily dance delay depth "
        "diary dozen draft drama dream dress drink drive eager early earth eight elbow elder empty enemy "
        "enjoy enter entry equal error event exact exist extra faith false fault feast fence field fifty fight "
        "final flame flash fleet flour fluid focus force forge frame fresh front frost fruit funny ghost giant "
        "given glass globe glory grace grade grain grand grant grape grass great green greet group guard guess "
        "guest guide habit happy heart heavy hello honey horse hotel house human humor ideal image index inner "
        "input issue jelly joint judge juice knife label large laser later laugh layer learn lemon level light "
        "limit local logic lucky lunch magic major maple march match mayor metal model money month moral motor "
        "mount mouse mouth music nerve never night noble noise north novel nurse ocean offer often olive onion "
        "opera orbit order other outer owner paint panel paper party peace pearl phase phone photo piano piece "
        "pilot pitch place plain plane plant plate point power press price pride prime print prize proof proud "
        "quick quiet quote radio raise ranch range rapid ratio reach ready river robot rocky round route royal "
        "rural salad scale scene score sense serve seven shade shape share sharp sheep shelf shell shift shine "
        "shirt shock shore short sight skill sleep slice smile smoke snake solid solve sound south space spare "
        "speak speed spend spice spine sport staff stage stair stamp stand start state steam steel stick stone "
        "storm story stove sugar sunny sweet table taste teach theme thick thing think throw tiger title toast "
        "topic total touch tower track trade train treat trend trial tribe truck trust truth uncle union unity "
        "upper urban usage usual valid value video visit vital voice waste watch water wheel while white whole "
        "woman world worry write wrong youth zebra"
    ).split()
)
SYSTEM_PROMPT = (
    f"Let's play Wordle. Guess the secret {WORD_LENGTH}-letter English word. Reply with exactly one guess between "
    "<guess> and </guess>, e.g. <guess>crane</guess>. After each guess you get one mark per letter: G = right "
    "letter in the right place, Y = in the word but elsewhere, . = not in the word."
)
_GUESS_RE = re.compile(r"<guess>\s*([^<]*?)\s*</guess>", re.IGNORECASE)


def parse_guess(text: str) -> str | None:
    """The lower-cased word of the last <guess>...</guess> if it has exactly 5 letters, else None."""
    matches = _GUESS_RE.findall(text)
    if not matches:
        return None
    word = matches[-1].strip().lower()
    return word if len(word) == WORD_LENGTH and word.isascii() and word.isalpha() else None


def feedback(guess: str, secret: str) -> str:
    """Wordle marks (G, Y, .) of `guess` against `secret`; a repeated letter is marked Y only as often as it is
    still unmatched in the secret."""
    marks = ["."] * len(guess)
    unmatched: dict[str, int] = {}
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = "G"
        else:
            unmatched[s] = unmatched.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != "G" and unmatched.get(g, 0) > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


def solved_score(num_guesses: int, max_guesses: int) -> float:
    """1.0 for a win at the first guess, linearly down to 0.5 at the last allowed guess."""
    if max_guesses == 1:
        return 1.0
    return 1.0 - 0.5 * (num_guesses - 1) / (max_guesses - 1)


class WordleEnv(MultiTurnEnv):
    """Secrets are drawn from `WORDS` deterministically from `seed`; the model has `max_guesses` turns."""

    name = "wordle"

    def __init__(
        self,
        num_tasks: int = 1000,
        num_eval_tasks: int = 64,
        max_guesses: int = 6,
        seed: int = 0,
        rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S,
    ) -> None:
        super().__init__(max_turns=max_guesses, rollout_timeout_s=rollout_timeout_s)
        sizes = check_task_counts(self.name, num_tasks, num_eval_tasks)
        self._tasks = {split: self._make_tasks(split, n, seed) for split, n in sizes.items()}

    def tasks(self, split: str) -> Sequence[Task]:
        return split_tasks(self.name, self._tasks, split)

    async def setup_state(self, task: Task) -> State:
        return {"secret": task.answer, "guesses": [], "well_formed": [], "solved_at": None}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        guess = parse_guess(messages[-1].get("content") or "")
        state["guesses"].append(guess)
        state["well_formed"].append(guess is not None)
        number = len(state["guesses"])
        if guess == state["secret"]:
            state["solved_at"] = number
            return [{"role": "user", "content": f"Guess {number}: {guess} -> GGGGG. Solved!"}], True
        left = self.max_turns - number
        if guess is None:
            text = f"Guess {number} is invalid: reply with one {WORD_LENGTH}-letter word between <guess> and </guess>."
        else:
            text = f"Guess {number}: {guess} -> {feedback(guess, state['secret'])}"
        text += f" {left} guess{'es' if left != 1 else ''} left." if left else f" The word was {state['secret']}."
        return [{"role": "user", "content": text}], left == 0

    async def reward(self, task: Task, state: State) -> RewardResult:
        turns = max(len(state["guesses"]), 1)
        format_score = sum(state["well_formed"]) / turns
        solved = state["solved_at"] is not None
        solve = solved_score(state["solved_at"], self.max_turns) if solved else 0.0
        return RewardResult(
            value=SOLVE_WEIGHT * solve + FORMAT_WEIGHT * format_score,
            metrics={"solved": float(solved), "num_guesses": float(len(state["guesses"])), "format": format_score},
        )

    def _make_tasks(self, split: str, num_tasks: int, seed: int) -> list[Task]:
        rng = random.Random(f"wordle:{split}:{seed}")
        user = f"The secret word has {WORD_LENGTH} letters. You have {self.max_turns} guesses. Make your first guess."
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        return [Task(id=f"{split}-{i}", prompt=prompt, answer=rng.choice(WORDS)) for i in range(num_tasks)]
