"""count_shapes environment: drawn pictures hold exactly the counted shapes, tasks are deterministic, rewards,
answer parsing, argument errors, registry, and images that round-trip through their data URLs."""

import asyncio

import pytest

from slipstream.envs.base import Environment, score
from slipstream.envs.count_shapes import CountShapesEnv, draw_shapes, parse_answer
from slipstream.envs.registry import build_env, known_envs
from slipstream.utils.images import decode_data_url, message_images, png_data_url


def _blobs(image) -> int:
    """Connected groups of non-white pixels (4-neighbourhood)."""
    width, height = image.size
    pixels = image.load()
    seen, blobs = set(), 0
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == (255, 255, 255):
            continue
        blobs += 1
        stack = [start]
        seen.add(start)
        while stack:
            x, y = stack.pop()
            for nx, ny in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen and pixels[nx, ny] != (255, 255, 255):
                    seen.add((nx, ny))
                    stack.append((nx, ny))
    return blobs


def test_pictures_hold_the_counted_shapes():
    env = CountShapesEnv(num_tasks=20, num_eval_tasks=5, max_shapes=4, seed=2)
    counts = set()
    for task in [*env.tasks("train"), *env.tasks("eval")]:
        (image,) = message_images(task.prompt)
        assert image.size == (64, 64)
        assert _blobs(image) == task.answer == len(task.info["shapes"])
        counts.add(task.answer)
    assert counts == {1, 2, 3, 4}


def test_larger_images_hold_more_shapes():
    env = CountShapesEnv(num_tasks=10, min_shapes=5, max_shapes=9, image_size=96, seed=1)
    for task in env.tasks("train"):
        (image,) = message_images(task.prompt)
        assert image.size == (96, 96) and 5 <= task.answer <= 9 and _blobs(image) == task.answer


def test_prompt_shape_and_determinism():
    a, b, c = (
        CountShapesEnv(num_tasks=8, seed=4),
        CountShapesEnv(num_tasks=8, seed=4),
        CountShapesEnv(num_tasks=8, seed=5),
    )
    assert [t.prompt for t in a.tasks("train")] == [t.prompt for t in b.tasks("train")]
    assert [t.prompt for t in a.tasks("train")] != [t.prompt for t in c.tasks("train")]
    assert [t.prompt for t in a.tasks("train")] != [t.prompt for t in a.tasks("eval")][:8]
    task = a.tasks("train")[0]
    assert [m["role"] for m in task.prompt] == ["system", "user"]
    image, text = task.prompt[1]["content"]
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    assert text == {"type": "text", "text": "How many shapes are in the image?"}
    assert len({t.id for t in a.tasks("train")}) == 8


def test_rewards_and_parsing():
    env = CountShapesEnv(num_tasks=3, seed=0)
    task = env.tasks("train")[0]
    assert env.reward(task, f"<answer>{task.answer}</answer>") == 1.0
    assert env.reward(task, f"<answer> {task.answer}") == 1.0  # truncated closing tag
    assert env.reward(task, f"I count {task.answer}.") == 1.0  # untagged: the last number
    assert env.reward(task, f"<answer>{task.answer + 1}</answer>") == 0.0
    assert env.reward(task, "no idea") == 0.0
    assert parse_answer("<answer>3</answer> or 5") == 3
    assert parse_answer("2 then 7") == 7
    assert parse_answer("") is None


def test_argument_errors():
    with pytest.raises(ValueError, match=r"max_shapes <= 16 \(the cells of a 64px image\).*raise image_size"):
        CountShapesEnv(max_shapes=17)
    with pytest.raises(ValueError, match="1 <= min_shapes <= max_shapes"):
        CountShapesEnv(min_shapes=3, max_shapes=2)
    with pytest.raises(ValueError, match="image_size >= 32"):
        CountShapesEnv(image_size=16)
    with pytest.raises(ValueError, match="num_tasks >= 1"):
        CountShapesEnv(num_tasks=0)
    with pytest.raises(ValueError, match="splits: train, eval"):
        CountShapesEnv(num_tasks=1).tasks("test")


def test_registry_and_async_score():
    env = build_env("count_shapes", num_tasks=2)
    assert isinstance(env, Environment) and "count_shapes" in known_envs()
    task = env.tasks("train")[1]
    assert asyncio.run(score(env, task, f"<answer>{task.answer}</answer>")) == 1.0


def test_data_urls_round_trip_and_reject_remote_images():
    image = draw_shapes([("triangle", "green", 1), ("square", "black", 2)], 64)
    url = png_data_url(image)
    assert png_data_url(image) == url  # deterministic bytes
    assert decode_data_url(url).tobytes() == image.tobytes()
    with pytest.raises(ValueError, match="only inline base64 image data URLs"):
        decode_data_url("https://example.com/cat.png")
    with pytest.raises(ValueError, match="not valid base64"):
        decode_data_url("data:image/png;base64,@@@")


def test_the_retry_variant_tells_a_wrong_answer_and_scores_by_attempts():
    """count_shapes_retry: a wrong answer gets a text-only reply (the picture stays in the prompt), a right one ends
    the rollout with reward 1 / answers given; max_attempts wrong answers end it with 0."""
    import asyncio

    from slipstream.envs.base import is_multi_turn
    from slipstream.envs.rollout import ModelTurn, run_rollout

    env = build_env("count_shapes_retry", num_tasks=2, max_attempts=3)
    assert is_multi_turn(env) and "count_shapes_retry" in known_envs()
    task = env.tasks("train")[0]

    def answering(*answers):
        replies = iter(answers)

        async def model(messages, tools):
            return ModelTurn(message={"role": "assistant", "content": f"<answer>{next(replies)}</answer>"})

        return model

    wrong = task.answer + 1
    solved = asyncio.run(run_rollout(env, task, answering(wrong, task.answer)))
    assert solved.reward.value == 0.5 and solved.stop_reason == "env_done" and len(solved.turns) == 2
    retry = solved.messages[3]
    assert (
        retry["role"] == "user"
        and retry["content"].startswith("That is not right")
        and "2 attempts left" in retry["content"]
    )
    failed = asyncio.run(run_rollout(env, task, answering(wrong, wrong, wrong)))
    assert failed.reward.value == 0.0 and len(failed.turns) == 3 and failed.reward.metrics["attempts"] == 3
