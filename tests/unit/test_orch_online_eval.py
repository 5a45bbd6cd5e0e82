"""Online evaluation during training, against the simulated vLLM server (whose log-probs name the policy version
that decoded each token) and a fast fake trainer: evaluations run beside rollouts within their share of the
in-flight limit, each on one fixed policy version, land in batch metrics and eval/online.jsonl, and never in
training batches; a multi-turn evaluation whose rollouts outgrow the context window does not stop training."""

import asyncio
import json
import threading
from pathlib import Path

import pytest

import slipstream.eval.tasks
from slipstream.envs.reverse_text import ReverseTextEnv
from slipstream.orchestrator.loop import orchestrate
from slipstream.orchestrator.online_eval import OnlineEvaluator, SharedLimiter
from slipstream.rundir import ONLINE_EVAL_FILE
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream_sim import SimConfig, SimServer, serve_in_thread, sim_logprob
from tests.unit.test_async_pipeline import MODEL, config_for, publish

ENV = {"name": "reverse_text", "args": {"num_tasks": 20, "num_eval_tasks": 6}}


def run_with_fast_trainer(config, server: SimServer) -> dict[str, float]:
    """orchestrate() while a trainer publishes weights/step_n as soon as batch n exists."""
    stop = threading.Event()

    def trainer() -> None:
        for n in range(1, config.max_steps + 1):
            while not batch_path(config.output_dir, n, 0).exists():
                if stop.wait(0.005):
                    return
            publish(config.output_dir, n)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        return asyncio.run(orchestrate(config))
    finally:
        stop.set()
        thread.join(timeout=10)


def eval_config(tmp_path: Path, url: str, **eval_fields):
    fields = {"interval": 1, "num_samples": 2, "max_share": 0.25, "sampling": {"max_tokens": 10}} | eval_fields
    return config_for(
        tmp_path, url, max_steps=4, batch_size=4, env=ENV, sampling={"max_tokens": 6},
        concurrency={"mode": "fixed", "max": 8}, eval=fields,
    )  # fmt: skip


def test_online_eval_holds_its_policy_shares_concurrency_and_stays_out_of_batches(tmp_path, monkeypatch):
    evaluated: list[tuple[int, bool]] = []  # (policy version, whether the server decoded every token with it)
    sample = slipstream.eval.tasks.sample_completions

    async def recording_sample(client, task, params, n, version, chat, require_routed_experts=False):
        rollouts = await sample(client, task, params, n, version, chat, require_routed_experts)
        tokens = [
            (t, lp) for r in rollouts for t, lp in zip(r.completion_token_ids, r.completion_logprobs, strict=True)
        ]
        evaluated.append((version, all(lp == sim_logprob(version, t) for t, lp in tokens)))  # the sim's log-prob
        return rollouts

    shares: list[tuple[float, int]] = []  # (share, completions in flight) after each acquire
    acquire = SharedLimiter.acquire

    async def recording_acquire(self, units):
        got = await acquire(self, units)
        shares.append((self.share, self.in_flight))
        return got

    monkeypatch.setattr(slipstream.eval.tasks, "sample_completions", recording_sample)
    monkeypatch.setattr(SharedLimiter, "acquire", recording_acquire)
    # eval requests decode 10 tokens at 10 ms: an evaluation (6 tasks, one request at a time) takes 0.6 s while the
    # trainer publishes a new policy every few rollouts, so updates would land mid-evaluation if it were not held
    server = SimServer(SimConfig(model_name=MODEL, token_latency_s=0.01))
    with serve_in_thread(server) as url:
        config = eval_config(tmp_path, url)
        run_with_fast_trainer(config, server)

    records = [json.loads(line) for line in (tmp_path / ONLINE_EVAL_FILE).read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert steps[0] == 0 and steps[-1] == 4 and steps == sorted(set(steps))
    assert all(r["num_tasks"] == 6 and r["num_samples"] == 2 and set(r["pass_at_k"]) == {"1", "2"} for r in records)
    # every sample of an evaluation comes from the policy it is reported for (one still running when the last batch
    # is taken finishes, then the final policy is evaluated)
    assert {v for v, _ in evaluated} == set(steps)
    assert all(decoded_by_it for _, decoded_by_it in evaluated)
    # within a quarter of the in-flight limit (8 -> 2 completions: one request of 2 samples), all of it at the end
    assert all(in_flight <= 2 for share, in_flight in shares if share == 0.25)
    assert any(share == 1.0 and in_flight > 2 for share, in_flight in shares)

    metrics = [read_batch(batch_path(tmp_path, n, 0)).metrics for n in range(1, 5)]
    logged = [m for m in metrics if "eval/reward_mean" in m]
    assert logged and all(0.0 <= m["eval/reward_mean"] <= 1.0 and "eval/pass@2" in m for m in logged)
    assert [m["eval/policy_version"] for m in logged] == steps[: len(logged)]  # one evaluation per batch, in order
    assert any(m.get("timing/weight_update_held_s", 0.0) > 0.05 for m in metrics)  # updates waited for evaluations

    eval_prompts = {t.prompt[-1]["content"] for t in ReverseTextEnv(**ENV["args"]).tasks("eval")}
    for n in range(1, 5):
        for mb in read_batch(batch_path(tmp_path, n, 0)).micro_batches:
            prompt_text = bytes(t for t, m in zip(mb.input_ids, mb.loss_mask, strict=True) if not m).decode()
            assert "reverse" in prompt_text.lower() or "user:" in prompt_text
            assert not any(p in prompt_text for p in eval_prompts)


def test_an_evaluation_past_its_timeout_is_cancelled_and_counted(tmp_path, caplog):
    server = SimServer(SimConfig(model_name=MODEL, token_latency_s=0.05))  # 0.5 s per eval request
    with serve_in_thread(server) as url:
        config = eval_config(tmp_path, url, timeout_s=0.2)
        config.max_steps = 2
        run_with_fast_trainer(config, server)
    metrics = [read_batch(batch_path(tmp_path, n, 0)).metrics for n in (1, 2)]
    assert any(m.get("eval/num_timeouts", 0) >= 1 for m in metrics)
    assert not (tmp_path / ONLINE_EVAL_FILE).exists()
    assert "online evaluation of policy v0 cancelled after eval.timeout_s = 0.2s" in caplog.text


def test_due_versions():
    evaluator = OnlineEvaluator.__new__(OnlineEvaluator)
    evaluator.config = config_for(Path("/tmp"), "", eval={"interval": 2}).eval
    evaluator.last_version = None
    assert evaluator.due(0) and evaluator.due(5)
    evaluator.last_version = 0
    assert [evaluator.due(v) for v in (0, 1, 2, 3)] == [False, False, True, True]
    evaluator.last_version = 3  # the relay skipped version 2: 3 was evaluated in its place
    assert [evaluator.due(v) for v in (3, 4)] == [False, True]


def test_eval_split_without_tasks_is_refused(tmp_path):
    config = config_for(tmp_path, "", env={"name": "reverse_text", "args": {"num_eval_tasks": 0}}, eval={"interval": 1})
    with pytest.raises(ValueError, match="no tasks in split 'eval'.*num_eval_tasks"):
        OnlineEvaluator(None, ReverseTextEnv(num_eval_tasks=0), config, None, None)  # type: ignore[arg-type]
