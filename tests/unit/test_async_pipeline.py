"""The continuous rollout pipeline against the simulated vLLM server (which reports each token's policy version).

The test plays a trainer that publishes weights as soon as a batch exists. Task prompts are picked so that the
simulator's (deterministic) completions are short or long, which fixes the order in which groups finish.
"""

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.envs.base import Task
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.concurrency import InFlightLimit
from slipstream.orchestrator.loop import orchestrate
from slipstream.orchestrator.metrics import rollout_metrics
from slipstream.orchestrator.pipeline import RolloutPipeline
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.record import Rollout
from slipstream.rundir import WEIGHT_CHECKS_FILE
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream.utils.fs import commit_dir
from slipstream.weights.wire.published import PROBE, READY, weights_dir
from slipstream_sim import SimConfig, SimServer, serve_in_thread, sim_logprob
from slipstream_sim.policy import plan_completion, request_seed, tokenize_messages

MODEL = "sim-model"
PROBE_TOKENS = [5, 17, 42, 99]
MAX_TOKENS = 40


class StubEnv:
    name = "stub"

    def reward(self, task: Task, completion_text: str) -> float:
        return float(len(completion_text) % 2)


class StubSampler:
    """Hands out the given tasks in order."""

    def __init__(self, tasks: list[Task]) -> None:
        self.tasks = tasks

    def task_at(self, index: int) -> Task:
        return self.tasks[index]


def publish(output_dir: Path, step: int) -> None:
    """The trainer's side of a weight update: probe log-probs of the simulated policy `step`, then READY."""
    tmp = Path(output_dir) / "weights" / f".tmp_step_{step}"
    tmp.mkdir(parents=True)
    probe = {"token_ids": PROBE_TOKENS, "logprobs": [sim_logprob(step, t) for t in PROBE_TOKENS[1:]]}
    (tmp / PROBE).write_text(json.dumps(probe))
    (tmp / READY).write_text("")
    commit_dir(tmp, weights_dir(output_dir, step))


def tasks_by_length(sim: SimConfig, kinds: str, group_size: int = 2) -> list[Task]:
    """One task per letter of `kinds`: s = every completion <= 2 tokens, l = every completion MAX_TOKENS long."""
    picked: list[Task] = []
    k = 0
    for kind in kinds:
        while True:
            k += 1
            prompt = [{"role": "user", "content": f"task {k}"}]
            seed = request_seed(sim.seed, None, tokenize_messages(prompt))
            lengths = [len(plan_completion(seed, i, MAX_TOKENS, sim.vocab_size, sim.stop_prob)[0]) for i in range(2)]
            if (kind == "s" and max(lengths) <= 2) or (kind == "l" and min(lengths) == MAX_TOKENS):
                picked.append(Task(id=f"{kind}{k}", prompt=prompt))
                break
    return picked


def config_for(tmp_path: Path, url: str, **overrides) -> OrchestratorConfig:
    fields = dict(
        model={"name": MODEL},
        output_dir=tmp_path,
        max_steps=3,
        inference_url=url,
        batch_size=2,
        group_size=2,
        max_async_level=1,
        spare_batches=0,  # no spare groups: the scenarios below fix which group is sent when
        concurrency={"mode": "fixed", "max": 64},
        weights_poll_s=0.01,
        sampling={"max_tokens": MAX_TOKENS},
        request_timeout_s=20,
        weights_timeout_s=20,
    )
    return OrchestratorConfig(**{**fields, **overrides})


def drive(
    config: OrchestratorConfig,
    tasks: list[Task],
    publish: Callable[[Path, int], None] = publish,
    trainer_turn: Callable[[RolloutPipeline, int], Awaitable[dict]] | None = None,
) -> tuple[list[tuple[list[Rollout], dict]], RolloutPipeline]:
    """Take every batch; publish weights/step_n right after batch n (an instant trainer), except the last.
    `trainer_turn` (colocated runs): awaited after each batch, before its version is published (then every version
    is, the last one too, and the run ends serving it); its metrics join the batch's."""

    async def main():
        async with InferenceClient(config.inference_url, config.model.name, config.request_timeout_s) as client:
            relay = WeightRelay(client, config)
            pipeline = RolloutPipeline(client, StubEnv(), StubSampler(tasks), relay, config)
            batches = []
            async with pipeline.running():
                for step in range(1, config.max_steps + 1):
                    rollouts, metrics = await pipeline.next_batch(step)
                    if trainer_turn is not None:
                        metrics |= await trainer_turn(pipeline, step)
                    batches.append((rollouts, metrics | rollout_metrics(step, rollouts, 0)))
                    if step < config.max_steps or trainer_turn is not None:
                        publish(config.output_dir, step)
            if trainer_turn is not None:
                await relay.load_final(config.max_steps)
            return batches, pipeline

    return asyncio.run(main())


def chat_records(server: SimServer) -> list:
    return [r for r in server.engine.records if r.endpoint == "chat"]


def salts(records: list) -> list[str]:
    """The records' cache salts without their scope, which must be one (the client's: one orchestrator start)."""
    scopes, unscoped = zip(*(r.cache_salt.split(":", 1) for r in records), strict=True)
    assert len(set(scopes)) == 1, scopes
    return list(unscoped)


def assert_true_logprobs(rollout: Rollout) -> None:
    """The simulator's log-prob of a token depends on the version that produced it: the stamps must match."""
    pairs = zip(rollout.token_versions, rollout.completion_token_ids, strict=True)
    assert rollout.completion_logprobs == [sim_logprob(v, t) for v, t in pairs]
    assert rollout.token_versions == sorted(rollout.token_versions)


def test_rollout_spanning_two_updates_carries_both_versions_and_nothing_restarts(tmp_path):
    sim = SimConfig(model_name=MODEL, token_latency_s=0.025, stop_prob=0.05)
    server = SimServer(sim)
    a, b, c, d = tasks_by_length(sim, "slsl")
    with serve_in_thread(server) as url:
        batches, pipeline = drive(config_for(tmp_path, url), [a, b, c, d])

    # Batch 1 = a (policy 0); weights 1 land while b decodes; batch 2 = c (sent at policy 1); weights 2 land;
    # batch 3 = b, whose tokens span both updates. d is never sent: b, in flight, is all the last batch needs.
    assert [[r.task.id for r in rollouts] for rollouts, _ in batches] == [[a.id] * 2, [c.id] * 2, [b.id] * 2]
    first, second, third = (rollouts for rollouts, _ in batches)
    assert all(r.token_versions == [0] * len(r.completion_token_ids) for r in first)
    assert all(r.request_version == 1 and set(r.token_versions) == {1} for r in second)
    assert all(r.request_version == 0 and r.finish_reason == "length" for r in third)
    assert {v for r in third for v in r.token_versions} == {0, 1, 2}
    for r in first + second + third:
        assert_true_logprobs(r)
    metrics = [m for _, m in batches]
    assert [m["policy/lag_max"] for m in metrics] == [0, 0, 2]
    assert metrics[2]["batch/multi_version_rollouts"] == 2 and metrics[2]["weights/num_updates"] == 1

    # One request per group, never re-sent; the salt follows the version served when each request was sent.
    records = chat_records(server)
    assert salts(records) == ["policy-0", "policy-0", "policy-1"]
    assert salts(records) == [f"policy-{r.version_at_arrival}" for r in records]
    assert server.engine.loads == [str(weights_dir(tmp_path.resolve(), s)) for s in (1, 2)]
    probes = [r for r in server.engine.records if r.endpoint == "completions"]
    assert salts(probes) == ["policy-1", "policy-2"] and salts(probes + records)
    ledger = pipeline.ledger
    assert (ledger.num_dispatched, ledger.num_cancelled, ledger.num_dropped, ledger.num_abandoned) == (3, 0, 0, 0)


def test_groups_older_than_max_off_policy_steps_are_cancelled_and_counted(tmp_path):
    sim = SimConfig(model_name=MODEL, token_latency_s=0.025, stop_prob=0.05)
    server = SimServer(sim)
    a, b, c, d = tasks_by_length(sim, "slss")
    with serve_in_thread(server) as url:
        config = config_for(tmp_path, url, max_off_policy_steps=1)
        batches, pipeline = drive(config, [a, b, c, d])

    # b (policy 0) is still running when batch 2 is taken; batch 3 accepts only tokens >= version 1: cancelled.
    assert [[r.task.id for r in rollouts] for rollouts, _ in batches] == [[a.id] * 2, [c.id] * 2, [d.id] * 2]
    metrics = [m for _, m in batches]
    assert [m["pipeline/cancelled_groups"] for m in metrics] == [0, 1, 1]
    assert [m["pipeline/dropped_groups"] for m in metrics] == [0, 0, 0]
    assert all(m["policy/lag_max"] <= 1 for m in metrics)
    ledger = pipeline.ledger
    assert (ledger.num_dispatched, ledger.num_cancelled, ledger.num_dropped, ledger.num_abandoned) == (4, 1, 0, 0)
    records = chat_records(server)
    assert salts(records[:3]) == ["policy-0", "policy-0", "policy-1"] and len(records) == 4
    assert salts(records) == [f"policy-{r.version_at_arrival}" for r in records]


def test_spare_groups_keep_a_slow_group_from_holding_back_a_batch(tmp_path):
    sim = SimConfig(model_name=MODEL, token_latency_s=0.05, stop_prob=0.05)
    tasks = tasks_by_length(sim, "lsssss")
    took = {}
    for spare in (0, 1):
        server = SimServer(sim)
        with serve_in_thread(server) as url:
            config = config_for(tmp_path / str(spare), url, max_steps=2, batch_size=4, spare_batches=spare)
            start = time.perf_counter()
            batches, pipeline = drive(config, tasks)
            took[spare] = time.perf_counter() - start
        ids = [{r.task.id for r in rollouts} for rollouts, _ in batches]
        long_id = tasks[0].id
        if spare:  # two batches of groups plus one spare: the first four short groups to finish make the batches
            assert all(len(i) == 2 and long_id not in i for i in ids) and len(chat_records(server)) == 6
            assert pipeline.ledger.num_abandoned == 2  # the long group, and the short one not needed
        else:  # exactly the groups of the two batches: the long one is in the second
            assert long_id in ids[1] and len(chat_records(server)) == 4
    # The long group decodes for 2 s, the short ones for 0.1 s at most. Both runs pay the same start-up and batching
    # overhead (measured 0.2 s here, 0.75 s on a loaded CI host), so compare the two runs rather than a fixed bound.
    assert took[0] >= 2.0 and took[0] - took[1] >= 1.2, took


def test_synchronous_mode_is_on_policy(tmp_path):
    sim = SimConfig(model_name=MODEL, token_latency_s=0.001, request_latency_p50_s=0.01, request_latency_tail_ratio=20)
    server = SimServer(sim)
    tasks = [Task(id=str(i), prompt=[{"role": "user", "content": f"q{i}"}]) for i in range(12)]
    with serve_in_thread(server) as url:
        config = config_for(tmp_path, url, max_steps=4, batch_size=6, max_async_level=0, max_off_policy_steps=0)
        batches, pipeline = drive(config, tasks)
    for step, (rollouts, metrics) in enumerate(batches, start=1):
        assert all(set(r.token_versions) == {step - 1} for r in rollouts)
        assert metrics["policy/lag_max"] == 0
    assert pipeline.ledger.num_dispatched == 12 and len(chat_records(server)) == 12


def test_adaptive_concurrency_grows_while_healthy_and_backs_off_on_queueing(tmp_path, monkeypatch):
    polls: list[tuple[float, int, int]] = []  # (waiting sequences, our completions in flight, new limit)
    observe = InFlightLimit.observe

    def recording_observe(self, load, saturated, in_flight):
        polls.append((load.num_waiting, in_flight, observe(self, load, saturated, in_flight)))
        return polls[-1][-1]

    monkeypatch.setattr(InFlightLimit, "observe", recording_observe)
    sim = SimConfig(model_name=MODEL, capacity=4, token_latency_s=0.006)
    server = SimServer(sim)
    tasks = [Task(id=str(i), prompt=[{"role": "user", "content": f"q{i}"}]) for i in range(40)]
    concurrency = {"mode": "adaptive", "min": 2, "max": 16, "poll_interval_s": 0.02, "waiting_polls": 1}
    with serve_in_thread(server) as url:
        config = config_for(
            tmp_path, url, max_steps=4, batch_size=8, sampling={"max_tokens": 20}, concurrency=concurrency
        )  # a batch is twice the server's capacity: it queues even when a busy host lets one batch at a time out
        _, pipeline = drive(config, tasks)
    limits = [limit for _, _, limit in polls]
    assert limits[:2] == [4, 8]  # slow start while the server does not queue (capacity: 4 sequences)
    assert pipeline.limit.num_backoffs >= 1 and not pipeline.limit.slow_start, polls  # queueing made it back off
    backoff = next(i for i in range(1, len(polls)) if limits[i] < limits[i - 1])
    assert polls[backoff][0] > 0 and limits[backoff] == limits[backoff - 1] // 2


def test_full_run_with_heavy_tails_never_trains_on_too_old_tokens(tmp_path):
    """orchestrate() end to end: a fast trainer, heavy-tailed latency, spare groups and max_off_policy_steps = 1."""
    sim = SimConfig(model_name=MODEL, request_latency_p50_s=0.01, request_latency_tail_ratio=30, stop_prob=0.1)
    server = SimServer(sim)
    max_steps, groups_per_batch = 10, 4
    stop = threading.Event()

    def trainer() -> None:
        for n in range(1, max_steps + 1):
            while not batch_path(tmp_path, n, 0).exists():
                if stop.wait(0.005):
                    return
            publish(tmp_path, n)

    thread = threading.Thread(target=trainer, daemon=True)
    with serve_in_thread(server) as url:
        config = config_for(
            tmp_path, url, max_steps=max_steps, batch_size=2 * groups_per_batch, max_off_policy_steps=1, spare_batches=1,
            env={"name": "reverse_text", "args": {"num_tasks": 50}}, sampling={"max_tokens": 8},
        )  # fmt: skip
        thread.start()
        try:
            summary = asyncio.run(orchestrate(config))
        finally:
            stop.set()
            thread.join(timeout=10)

    metrics = [read_batch(batch_path(tmp_path, n, 0)).metrics for n in range(1, max_steps + 1)]
    assert all(m["policy/lag_max"] <= 1 for m in metrics)
    assert all(m["batch/num_rollouts"] == 2 * groups_per_batch for m in metrics)
    counted = ["pipeline/cancelled_groups", "pipeline/dropped_groups", "pipeline/abandoned_groups"]
    ends = max_steps * groups_per_batch + sum(summary[k] for k in counted)
    assert summary["pipeline/dispatched_groups"] == ends  # every group ends in a batch or in exactly one counter
    # a group left over at the very end, or cancelled as too old right after it started, may not have reached the
    # server (cancelled while its request was still being sent); every other group did
    sent = len(chat_records(server))
    unsent_at_most = summary["pipeline/abandoned_groups"] + summary["pipeline/cancelled_groups"]
    assert summary["pipeline/dispatched_groups"] - unsent_at_most <= sent
    assert sent <= summary["pipeline/dispatched_groups"]
    assert metrics[-1]["pipeline/cancelled_groups"] == summary["pipeline/cancelled_groups"]
    checks = [json.loads(line) for line in (tmp_path / WEIGHT_CHECKS_FILE).read_text().splitlines()]
    assert all(c["passed"] for c in checks) and checks[-1]["step"] == max_steps
