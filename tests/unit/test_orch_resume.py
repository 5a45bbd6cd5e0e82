"""Orchestrator checkpoints against the fake vLLM server: the state written at checkpoint steps round-trips, and an
orchestrator resumed from step 1 serves step 1's weights before any rollout and writes the same batches 2..3, with
the same request seeds, as an uninterrupted synchronous run."""

import threading
from pathlib import Path

import pytest
from starlette.requests import Request

from slipstream.orchestrator.loop import run_orchestrator
from slipstream.orchestrator.sampler import TaskCursor, request_seed
from slipstream.orchestrator.state import OrchestratorState, load_state, save_state
from slipstream.transport.checkpoints import (
    COMMITTED,
    ORCHESTRATOR_PART,
    TRAINER_PART,
    commit_step,
    part_dir,
    prepare_resume,
)
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream.weights.wire.published import weights_dir
from tests.unit.test_orch_loop import FakeVLLM, ServerThread, make_config, publish_weights
from tests.unit.test_orch_multiturn import FakeChatModel, TalkEnv, run_env, talk_script


class SeedRecordingVLLM(FakeVLLM):
    """Also records the sampling seed of every chat request."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int | None] = []

    async def chat(self, request: Request):
        self.seeds.append((await request.json()).get("seed"))
        return await super().chat(request)


def _trainer(output_dir: Path, first: int, last: int, stop: threading.Event) -> None:
    """A synchronous fake trainer from step `first`: after batch n, publish weights n and commit checkpoint n."""
    for n in range(first, last + 1):
        while not batch_path(output_dir, n, 0).exists():
            if stop.wait(0.01):
                return
        publish_weights(output_dir, n)
        trainer_part = part_dir(output_dir, n, TRAINER_PART)
        trainer_part.mkdir(parents=True)
        (trainer_part / COMMITTED).write_text(f"{n}\n")
        commit_step(output_dir, n)  # raises if the orchestrator's part is missing


def _run(config, server: FakeVLLM, first_step: int) -> None:
    stop = threading.Event()
    args = (config.output_dir, first_step, config.max_steps, stop)
    trainer = threading.Thread(target=_trainer, args=args, daemon=True)
    with ServerThread(server.app) as srv:
        config.inference_url = srv.url
        trainer.start()
        try:
            run_orchestrator(config)
        finally:
            stop.set()
            trainer.join(timeout=10)


def _batches(output_dir: Path, steps: range) -> list:
    return [read_batch(batch_path(output_dir, n, r)).micro_batches for n in steps for r in range(2)]


def test_resumed_orchestrator_regenerates_the_same_batches(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    fields = dict(max_async_level=0, seed_requests=True, checkpoint={"interval": 1})
    reference = SeedRecordingVLLM()
    _run(make_config(straight, "", **fields), reference, 1)

    first = SeedRecordingVLLM()
    _run(make_config(resumed, "", **fields), first, 1)
    state = load_state(resumed, 1, seed=0, env_name="reverse_text", tasks_per_step=2)
    assert (state.next_task_index, state.requeued_task_indices, state.num_dispatched) == (2, [], 2)
    removed = prepare_resume(resumed, 1)
    assert "rollouts/step_3" in removed and "checkpoints/step_2" in removed and "weights/step_2" in removed
    assert not weights_dir(resumed, 2).exists() and part_dir(resumed, 1, ORCHESTRATOR_PART).is_dir()

    server = SeedRecordingVLLM()
    _run(make_config(resumed, "", resume_step="latest", **fields), server, 2)
    # step 1's weights are loaded and verified before the first rollout; it is served at policy version 1, in a
    # cache-salt scope of its own: nothing the first start cached (its version 1 included) is reused
    assert server.calls[:6] == ["pause:keep", "load:step_1", "reset_prefix_cache", "resume", "score", "chat:policy-1"]
    assert len(first.salt_scopes) == len(server.salt_scopes) == 1 and first.salt_scopes != server.salt_scopes
    assert _batches(resumed, range(2, 4)) == _batches(straight, range(2, 4))
    assert server.seeds == reference.seeds[2:] and len(set(reference.seeds)) == 6 and None not in reference.seeds
    assert read_batch(batch_path(resumed, 3, 0)).metrics["pipeline/dispatched_groups"] == 6


def test_resume_refuses_batches_left_after_the_checkpoint(tmp_path):
    fields = dict(max_async_level=0, checkpoint={"interval": 1})
    _run(make_config(tmp_path, "", **fields), FakeVLLM(), 1)
    with ServerThread(FakeVLLM().app) as srv, pytest.raises(RuntimeError, match=r"batches of steps \[2, 3\]"):
        run_orchestrator(make_config(tmp_path, srv.url, resume_step=1, **fields))


def _state(**overrides) -> OrchestratorState:
    fields = dict(
        step=4,
        seed=7,
        env_name="reverse_text",
        tasks_per_step=2,
        next_task_index=11,
        requeued_task_indices=[8, 10],
        num_dispatched=12,
        num_cancelled=1,
        num_dropped=0,
        num_failed=1,
        num_abandoned=0,
        failed_rollouts_by_stage={"score": 2},
    )
    return OrchestratorState(**{**fields, **overrides})


def test_state_round_trip_and_mismatches(tmp_path):
    path = save_state(tmp_path, _state())
    assert path == part_dir(tmp_path, 4, ORCHESTRATOR_PART) and (path / COMMITTED).is_file()
    assert load_state(tmp_path, 4, seed=7, env_name="reverse_text", tasks_per_step=2) == _state()
    with pytest.raises(ValueError, match=r"seed = 7 but this run has 8"):
        load_state(tmp_path, 4, seed=8, env_name="reverse_text", tasks_per_step=2)
    with pytest.raises(ValueError, match=r"orchestrator.env.name = 'reverse_text'"):
        load_state(tmp_path, 4, seed=7, env_name="wordle", tasks_per_step=2)
    save_state(tmp_path, _state(step=5, next_task_index=13))  # rewriting replaces a leftover temporary folder
    (path.parent.parent / "step_6" / ".orchestrator.tmp").mkdir(parents=True)
    assert save_state(tmp_path, _state(step=6)).is_dir()
    assert not (path.parent.parent / "step_6" / ".orchestrator.tmp").exists()


def test_task_cursor_generates_unfinished_positions_again_first():
    cursor = TaskCursor(next_index=11, requeued=[10, 8])
    assert [cursor.take() for _ in range(4)] == [8, 10, 11, 12]
    assert cursor.snapshot(unfinished=[12, 11]) == (13, [11, 12])
    cursor = TaskCursor(5, [3])
    assert cursor.snapshot(unfinished=[4]) == (5, [3, 4])  # a requeued position not yet taken stays requeued


def test_multi_turn_requests_are_seeded_per_task_position_sample_and_turn(tmp_path, monkeypatch):
    server = FakeChatModel(talk_script)
    run_env(tmp_path, monkeypatch, TalkEnv(), server, seed_requests=True, spare_batches=0)
    # 2 steps x 2 groups (task positions 0..3) x 2 rollouts x 3 turns, sample i turn t seeded base + i + 2 t
    want = [request_seed(0, p) + i + 2 * t for p in range(4) for i in range(2) for t in range(3)]
    assert sorted(b["seed"] for b in server.bodies) == sorted(want) and len(set(want)) == len(want)
    unseeded = FakeChatModel(talk_script)
    run_env(tmp_path / "unseeded", monkeypatch, TalkEnv(), unseeded)
    assert not any("seed" in b for b in unseeded.bodies)
