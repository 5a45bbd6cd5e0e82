"""count-shapes: an image environment for vision-language models. Each task is a small picture drawn with PIL
(circles, squares and triangles of several colours on a white canvas, never overlapping) and the question how many
shapes it holds; the reward is 1.0 for the right count, else 0.0.

The picture travels inside the prompt as an OpenAI `image_url` part (a PNG data URL), so vLLM's chat API and the
trainer's image processor see the same pixels. Tasks are deterministic for a seed.
"""

import random
import re
from collections.abc import Sequence

from slipstream.envs.base import DEFAULT_ROLLOUT_TIMEOUT_S, Message, RewardResult, State, Task
from slipstream.envs.multiturn import MultiTurnEnv
from slipstream.utils.images import image_part

SYSTEM_PROMPT = "Look at the image. Answer with a single number between <answer> and </answer>, and nothing else."
QUESTION = "How many shapes are in the image?"
SHAPES = ("circle", "square", "triangle")
COLORS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220), "black": (20, 20, 20)}
_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*(?:</answer>|$)")
_NUMBER_RE = re.compile(r"-?\d+")
SPLITS = ("train", "eval")


class CountShapesEnv:
    """Pictures of `image_size` x `image_size` pixels, split into a grid of cells holding at most one shape each;
    tasks hold `min_shapes`..`max_shapes` shapes."""

    name = "count_shapes"

    def __init__(
        self,
        num_tasks: int = 1000,
        num_eval_tasks: int = 64,
        min_shapes: int = 1,
        max_shapes: int = 4,
        image_size: int = 64,
        seed: int = 0,
    ) -> None:
        grid = _grid_size(image_size)
        if not 1 <= min_shapes <= max_shapes <= grid * grid:
            raise ValueError(
                f"count_shapes needs 1 <= min_shapes <= max_shapes <= {grid * grid} (the cells of a {image_size}px "
                f"image), got {min_shapes} and {max_shapes}; lower max_shapes or raise image_size"
            )
        if num_tasks < 1 or num_eval_tasks < 0:
            raise ValueError(
                f"count_shapes needs num_tasks >= 1 and num_eval_tasks >= 0, got {num_tasks}, {num_eval_tasks}"
            )
        sizes = {"train": num_tasks, "eval": num_eval_tasks}
        self._tasks = {
            split: _make_tasks(split, sizes[split], min_shapes, max_shapes, image_size, seed) for split in SPLITS
        }

    def tasks(self, split: str) -> Sequence[Task]:
        if split not in self._tasks:
            raise ValueError(f"count_shapes has no split {split!r}; splits: {', '.join(SPLITS)}")
        return self._tasks[split]

    def reward(self, task: Task, completion_text: str) -> float:
        return 1.0 if parse_answer(completion_text) == task.answer else 0.0


class CountShapesRetryEnv(MultiTurnEnv):
    """count_shapes over several turns (`count_shapes_retry`): a wrong or malformed answer is told so and the model
    looks again, up to `max_attempts` answers; the reward is 1 / (answers given) for a right count, else 0. The
    picture stays in the first user message: every turn's prompt holds it, and the environment adds text only."""

    name = "count_shapes_retry"

    def __init__(
        self, max_attempts: int = 3, rollout_timeout_s: float = DEFAULT_ROLLOUT_TIMEOUT_S, **task_args
    ) -> None:
        super().__init__(max_turns=max_attempts, rollout_timeout_s=rollout_timeout_s)
        self.single = CountShapesEnv(**task_args)

    def tasks(self, split: str) -> Sequence[Task]:
        return self.single.tasks(split)

    async def setup_state(self, task: Task) -> State:
        return {"answer": task.answer, "attempts": 0, "solved": False}

    async def env_response(self, messages: list[Message], state: State) -> tuple[list[Message], bool]:
        state["attempts"] += 1
        if parse_answer(messages[-1].get("content") or "") == state["answer"]:
            state["solved"] = True
            return [], True
        left = self.max_turns - state["attempts"]
        text = f"That is not right. Look at the image again and answer. {left} attempt{'s' if left != 1 else ''} left."
        return ([{"role": "user", "content": text}], False) if left else ([], True)

    async def reward(self, task: Task, state: State) -> RewardResult:
        value = 1.0 / state["attempts"] if state["solved"] else 0.0
        return RewardResult(value=value, metrics={"solved": float(state["solved"]), "attempts": state["attempts"]})


def parse_answer(completion_text: str) -> int | None:
    """The number inside <answer>...</answer> (closing tag optional), else the last number of the reply, else None."""
    match = _ANSWER_RE.search(completion_text)
    if match:
        return int(match.group(1))
    numbers = _NUMBER_RE.findall(completion_text)
    return int(numbers[-1]) if numbers else None


def _grid_size(image_size: int) -> int:
    """Cells per side: cells of at least 16 pixels, so every shape stays recognisable."""
    if image_size < 32:
        raise ValueError(f"count_shapes needs image_size >= 32 pixels, got {image_size}")
    return min(4, image_size // 16)


def draw_shapes(shapes: list[tuple[str, str, int]], image_size: int):
    """A white `image_size` square with each (shape, colour, cell index) drawn inside its cell, with a margin."""
    from PIL import Image, ImageDraw

    grid = _grid_size(image_size)
    cell = image_size // grid
    image = Image.new("RGB", (image_size, image_size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for shape, color, index in shapes:
        margin = max(2, cell // 6)
        x0, y0 = (index % grid) * cell + margin, (index // grid) * cell + margin
        x1, y1 = x0 + cell - 2 * margin, y0 + cell - 2 * margin
        fill = COLORS[color]
        if shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return image


def _make_tasks(split: str, num_tasks: int, min_shapes: int, max_shapes: int, image_size: int, seed: int) -> list[Task]:
    # A string seed is hashed with sha512 by `random`, so tasks are identical across processes and runs.
    rng = random.Random(f"count_shapes:{split}:{seed}")
    grid = _grid_size(image_size)
    tasks = []
    for i in range(num_tasks):
        count = rng.randint(min_shapes, max_shapes)
        cells = rng.sample(range(grid * grid), count)
        shapes = [(rng.choice(SHAPES), rng.choice(sorted(COLORS)), cell) for cell in cells]
        user = [image_part(draw_shapes(shapes, image_size)), {"type": "text", "text": QUESTION}]
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
        info = {"shapes": [{"shape": s, "color": c, "cell": k} for s, c, k in shapes], "image_size": image_size}
        tasks.append(Task(id=f"{split}-{i}", prompt=prompt, answer=count, info=info))
    return tasks
