"""Streaming (the real-vLLM path) across in-flight weight updates: every token is stamped with the version that
produced it, as the fake server knows it; a cancelled group's stream is closed (vLLM aborts on disconnect)."""

import time

from slipstream.envs.base import Task
from tests.unit.test_async_pipeline import config_for, drive
from tests.unit.test_orch_loop import MODEL, FakeVLLM, ServerThread, publish_weights


def task(name: str, text: str) -> Task:
    return Task(id=name, prompt=[{"role": "user", "content": text}])


# FakeVLLM streams "<reversed_text>...</reversed_text>" and the text itself, one token per character.
SHORT, LONG = "ab", "the quick brown fox jumps over the lazy dog " * 2


def stream_config(tmp_path, url, **overrides):
    fields = dict(sampling={"max_tokens": 200})
    return config_for(tmp_path, url, **{"model": {"name": MODEL}, **fields, **overrides})


def test_streamed_tokens_carry_the_version_that_produced_them(tmp_path):
    server = FakeVLLM(token_delay_s=0.004)
    a, b, c = task("a", SHORT), task("b", LONG), task("c", SHORT[::-1])  # distinct texts name the requests
    with ServerThread(server.app) as srv:
        batches, pipeline = drive(stream_config(tmp_path, srv.url), [a, b, c], publish=publish_weights)

    assert [[r.task.id for r in rollouts] for rollouts, _ in batches] == [["a", "a"], ["c", "c"], ["b", "b"]]
    assert len(server.true_versions) == 3  # one request per group: nothing restarted
    truth = {server.request_texts[request_id]: versions for request_id, versions in server.true_versions.items()}
    for rollouts, _ in batches:
        assert [r.token_versions for r in rollouts] == truth[rollouts[0].task.prompt[-1]["content"]]
    spanning = batches[2][0]
    assert {v for r in spanning for v in r.token_versions} == {0, 1, 2}  # b decoded across two updates
    assert all(r.request_version == 0 and r.finish_reason == "stop" for r in spanning)
    chats = [call for call in server.calls if call.startswith("chat:")]
    assert chats == ["chat:policy-0", "chat:policy-0", "chat:policy-1"]
    assert server.closed_streams == []


def test_cancelled_group_closes_its_stream(tmp_path):
    server = FakeVLLM(token_delay_s=0.004)
    tasks = [task("a", SHORT), task("b", LONG), task("c", SHORT), task("d", SHORT)]
    with ServerThread(server.app) as srv:
        config = stream_config(tmp_path, srv.url, max_off_policy_steps=1)
        batches, pipeline = drive(config, tasks, publish=publish_weights)
        deadline = time.monotonic() + 5
        while not server.closed_streams and time.monotonic() < deadline:
            time.sleep(0.01)

    assert [[r.task.id for r in rollouts] for rollouts, _ in batches] == [["a", "a"], ["c", "c"], ["d", "d"]]
    assert (pipeline.ledger.num_cancelled, pipeline.ledger.num_dropped, pipeline.ledger.num_abandoned) == (1, 0, 0)
    assert len(server.closed_streams) == 1  # b's connection was closed mid-stream
    closed = server.true_versions[server.closed_streams[0]]
    assert 0 < sum(map(len, closed)) < 2 * len(LONG) + 30
