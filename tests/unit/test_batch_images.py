"""Vision-language rollouts through batching: each sample keeps its prompt's images wherever packing puts it, image
samples never become prefix trees, the batch file round-trips them (format 2), and malformed image spans are refused."""

import msgspec
import pytest

from slipstream.envs.count_shapes import CountShapesEnv
from slipstream.orchestrator.batching import build_samples, build_training_batches
from slipstream.rollout.record import Rollout
from slipstream.transport.rollouts import (
    BATCH_FORMAT_VERSION,
    BatchFormatError,
    MicroBatch,
    SampleImages,
    TrainingBatch,
    read_batch,
    write_batch,
)
from slipstream.utils.images import data_url_bytes, decode_image_bytes, message_image_bytes

IMAGE = 9  # the image token of these made-up prompts


def _rollout(task, idx: int, group: int, num_completion: int = 3) -> Rollout:
    prompt = [1, 2, IMAGE, IMAGE, IMAGE, IMAGE, 3, 4]  # the same prompt tokens for the group: shareable but for images
    return Rollout(
        task=task,
        prompt_token_ids=prompt,
        completion_token_ids=[100 + idx + i for i in range(num_completion)],
        completion_logprobs=[-0.5] * num_completion,
        completion_text="",
        token_versions=[0] * num_completion,
        request_version=0,
        advantage=0.1 * idx,
        group_index=group,
    )


def _tasks(n: int):
    return list(CountShapesEnv(num_tasks=n, num_eval_tasks=0, seed=1).tasks("train"))


def test_image_bytes_are_the_data_urls_png_files():
    task = _tasks(1)[0]
    (data,) = message_image_bytes(task.prompt)
    url = next(p for m in task.prompt if isinstance(m["content"], list) for p in m["content"] if "image_url" in p)
    assert data == data_url_bytes(url["image_url"]["url"]) and data.startswith(b"\x89PNG")
    assert decode_image_bytes(data).size == (64, 64)
    with pytest.raises(ValueError, match="only inline base64"):
        data_url_bytes("https://example.com/cat.png")


def test_each_sample_keeps_its_images_through_packing_and_the_batch_file(tmp_path):
    tasks = _tasks(6)
    rollouts = [_rollout(tasks[g], 4 * g + i, g) for g in range(6) for i in range(4)]  # 6 groups of 4
    batches = build_training_batches(
        1, rollouts, temperature=1.0, micro_batch_tokens=40, num_ranks=2, metrics={}, shared_prefix=True
    )
    by_completion = {tuple(r.completion_token_ids): message_image_bytes(r.task.prompt) for r in rollouts}
    seen = 0
    for batch in batches:
        batch = read_batch(write_batch(tmp_path, batch))
        assert batch.format_version == BATCH_FORMAT_VERSION == 2
        for mb in batch.micro_batches:
            assert mb.images is not None
            # Every sample holds images: no prefix tree (each sample starts at position 0 and is listed once).
            starts = [i for i, p in enumerate(mb.position_ids) if p == 0]
            assert [s.start for s in mb.images] == starts
            for entry in mb.images:
                tokens = mb.input_ids[entry.start : entry.start + entry.num_tokens]
                assert tokens[:8] == [1, 2, IMAGE, IMAGE, IMAGE, IMAGE, 3, 4]
                assert entry.images == by_completion[tuple(tokens[8:])]
                seen += 1
    assert seen == len(rollouts)


def test_text_samples_carry_no_images_and_still_share_prefixes():
    from slipstream.envs.base import Task

    task = Task(id="t", prompt=[{"role": "user", "content": "hi"}])
    rollouts = [_rollout(task, i, 0) for i in range(4)]
    (batch,) = build_training_batches(1, rollouts, 1.0, micro_batch_tokens=512, num_ranks=1, metrics={})
    (mb,) = batch.micro_batches
    assert mb.images is None
    assert len(mb.input_ids) < sum(r.num_tokens for r in rollouts)  # one prefix tree


def test_every_sample_of_a_multi_turn_rollout_keeps_the_prompts_images():
    """A multi-turn rollout's samples (two here: a prefix break re-rendered the conversation) each start with the
    task's prompt, so each carries its images; environment tokens are masked as ever."""
    from slipstream.envs.tokens import TrainingSample

    task = _tasks(1)[0]
    rollout = _rollout(task, 0, 0)
    prompt = rollout.prompt_token_ids
    first = TrainingSample(
        prompt + [100, 101, 7, 8], [False] * 8 + [True, True, False, False], [0.0] * 8 + [-1.0] * 2 + [0.0] * 2
    )
    second = TrainingSample(prompt + [100, 5, 102], [False] * 8 + [False, False, True], [0.0] * 10 + [-2.0])
    rollout.samples = [first, second]
    samples = build_samples(rollout, 0.7)
    assert [s.images for s in samples] == [tuple(message_image_bytes(task.prompt))] * 2
    assert samples[1].temperatures[-1] == 0.7 and samples[1].inference_logprobs[-1] == -2.0
    assert samples[0].advantages[:10] == [0.0] * 8 + [rollout.advantage] * 2


def test_an_environment_message_with_an_image_fails_the_rollout_at_env_response():
    import asyncio

    from slipstream.envs.base import RewardResult
    from slipstream.envs.multiturn import MultiTurnEnv
    from slipstream.envs.rollout import ModelTurn, run_rollout

    task = _tasks(1)[0]

    class ShowsAnotherPicture(MultiTurnEnv):
        name = "shows_another_picture"

        def tasks(self, split):
            return [task]

        async def env_response(self, messages, state):
            return [{"role": "user", "content": task.prompt[-1]["content"]}], False  # the prompt's image again

        async def reward(self, task, state):
            return RewardResult(value=1.0)

    async def model(messages, tools):
        return ModelTurn(message={"role": "assistant", "content": "<answer>2</answer>"})

    outcome = asyncio.run(run_rollout(ShowsAnotherPicture(max_turns=3), task, model))
    assert outcome.stage == "env_response" and "images are supported in the task's prompt only" in outcome.error


def _mb(images: list[SampleImages]) -> MicroBatch:
    n = 6
    return MicroBatch(
        input_ids=[1] * n,
        position_ids=[0, 1, 2, 0, 1, 2],
        loss_mask=[False] * n,
        advantages=[0.0] * n,
        inference_logprobs=[0.0] * n,
        temperatures=[1.0] * n,
        images=images,
    )


@pytest.mark.parametrize(
    ("images", "problem"),
    [
        ([SampleImages(start=1, num_tokens=3, images=[b"x"])], "does not span exactly one sample"),
        ([SampleImages(start=0, num_tokens=2, images=[b"x"])], "does not span exactly one sample"),
        ([SampleImages(start=3, num_tokens=4, images=[b"x"])], "is not a sample of it"),
        ([SampleImages(start=0, num_tokens=3, images=[])], "is not a sample of it"),
        ([SampleImages(3, 3, [b"x"]), SampleImages(0, 3, [b"y"])], "is not a sample of it"),
    ],
)
def test_malformed_image_spans_are_refused(tmp_path, images, problem):
    batch = TrainingBatch(step=1, rank=0, num_loss_tokens=1, micro_batches=[_mb(images)])
    path = tmp_path / "b.msgpack"
    path.write_bytes(msgspec.msgpack.encode(batch))
    with pytest.raises(BatchFormatError, match=problem):
        read_batch(path)
    ok = TrainingBatch(step=1, rank=0, num_loss_tokens=1, micro_batches=[_mb([SampleImages(3, 3, [b"x"])])])
    path.write_bytes(msgspec.msgpack.encode(ok))
    assert read_batch(path).micro_batches[0].images == [SampleImages(3, 3, [b"x"])]


def test_samples_that_sampled_a_placeholder_are_dropped_and_counted():
    tasks = _tasks(2)
    rollouts = [_rollout(tasks[g], 2 * g + i, g) for g in range(2) for i in range(2)]
    rollouts[1].completion_token_ids[1] = IMAGE  # the model sampled an image placeholder
    metrics = {}
    (batch,) = build_training_batches(1, rollouts, 1.0, 4096, 1, metrics, placeholder_ids=frozenset({IMAGE, 10}))
    assert metrics["batch/dropped_image_samples"] == 1.0 == batch.metrics["batch/dropped_image_samples"]
    (mb,) = batch.micro_batches
    assert len(mb.images) == 3 and IMAGE not in [t for t, m in zip(mb.input_ids, mb.loss_mask, strict=True) if m]
    assert batch.num_loss_tokens == 9


def test_placeholder_token_ids_come_from_the_model_config(tmp_path):
    import json

    from slipstream.config.vlm import placeholder_token_ids

    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 7, "video_token_id": 8}))
    assert placeholder_token_ids(tmp_path) == {7, 8}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(ValueError, match="no integer image_token_id"):
        placeholder_token_ids(tmp_path)
