"""Multi-turn and tool-using rollouts through run_orchestrator, against a fake vLLM that renders chat messages into
tokens (ChatML-like, content stripped like real templates), streams tool calls as vLLM's deltas, and a fake trainer.

Checks training samples (only model tokens carry loss; environment and tool tokens are masked; prefix breaks split
samples), the tool-call round trip, environment failures (one rollout, or a whole group), and the context limit.
"""

import asyncio
import importlib
import json
import re
from pathlib import Path

import pytest
import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from slipstream.config.inference import InferenceConfig
from slipstream.envs.base import RewardResult, Task
from slipstream.envs.calculator import CALCULATE
from slipstream.envs.multiturn import MultiTurnEnv
from slipstream.envs.tools import ToolEnv
from slipstream.inference.server import build_vllm_argv
from slipstream.orchestrator.batching import build_training_batches
from slipstream.orchestrator.loop import assign_advantages
from slipstream.rollout.record import Rollout
from slipstream.rollout.turns import CONTEXT_LENGTH
from slipstream.rundir import ONLINE_EVAL_FILE
from slipstream.trainer.data import expand_trees
from slipstream.transport.rollouts import batch_path, read_batch
from slipstream.utils.net import free_port
from slipstream_sim import SimConfig, SimServer, serve_in_thread, sim_logprob
from tests.unit.test_async_pipeline import MODEL as SIM_MODEL
from tests.unit.test_async_pipeline import config_for, salts
from tests.unit.test_orch_loop import MODEL, FakeVLLM, fake_logprob, make_config, run_with_trainer
from tests.unit.test_orch_online_eval import run_with_fast_trainer

END = 256
"""End-of-turn token (outside the byte range): closes every rendered message and every completion."""
TOOL_CALL = "<tool_call>{}</tool_call>"


def render_tool_call(name: str, arguments: dict) -> str:
    return TOOL_CALL.format(json.dumps({"name": name, "arguments": arguments}))


def render(messages: list[dict]) -> list[int]:
    """The fake chat template: `<|role|>` + stripped content (+ tool calls) + END per message, then the generation
    prompt. Byte tokens, so a turn's prompt extends the last one exactly unless stripping changed a reply."""
    ids: list[int] = []
    for m in messages:
        text = (m.get("content") or "").strip()
        for call in m.get("tool_calls") or []:
            text += render_tool_call(call["function"]["name"], json.loads(call["function"]["arguments"]))
        ids += list(f"<|{m['role']}|>{text}".encode()) + [END]
    return ids + list(b"<|assistant|>")


class FakeChatModel(FakeVLLM):
    """A scripted model behind vLLM's streaming chat: `script(messages, tools) -> (content, (tool, arguments) | None)`.
    Requests whose prompt exceeds `max_prompt_tokens` get vLLM's context-length error."""

    def __init__(self, script, max_prompt_tokens: int = 100_000) -> None:
        super().__init__()
        self.script = script
        self.max_prompt_tokens = max_prompt_tokens
        self.bodies: list[dict] = []

    async def chat(self, request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        assert body["n"] == 1 and body["stream"] and body["return_token_ids"] and body["logprobs"]
        self.bodies.append(body)
        prompt_ids = render(body["messages"])
        if len(prompt_ids) > self.max_prompt_tokens:
            message = (
                f"This model's maximum context length is {self.max_prompt_tokens} tokens. However, your prompt ..."
            )
            error = {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        request_id = f"chatcmpl-{len(self.calls)}"
        self.calls.append(f"chat:{body['cache_salt']}")
        content, call = self.script(body["messages"], body.get("tools"))
        call_text = render_tool_call(*call) if call else ""
        stream = self._stream_turn(request_id, prompt_ids, content, call_text, call)
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _stream_turn(self, request_id, prompt_ids, content, call_text, call):
        """vLLM's chunks for one choice: role chunk, one chunk per token (content deltas, then tool-call deltas:
        id/type/name on the call's first token, the JSON arguments on its last), usage, DONE."""
        ids = list((content + call_text).encode()) + [END]
        num_content = len(content.encode())

        def chunk(**fields) -> str:
            return f"data: {json.dumps({'id': request_id, 'object': 'chat.completion.chunk', **fields})}\n\n"

        yield chunk(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}}], prompt_token_ids=prompt_ids)
        for t, token in enumerate(ids):
            while self.paused:
                await asyncio.sleep(0.005)
            delta: dict = {}
            if t < num_content:
                delta = {"content": chr(token)}
            elif call and t == num_content:
                delta = {"tool_calls": [{"index": 0, "id": f"call_{request_id}", "type": "function",
                                         "function": {"name": call[0]}}]}  # fmt: skip
            elif call and t == len(ids) - 2:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": json.dumps(call[1])}}]}
            entry = {"token": "x", "logprob": fake_logprob(self.version, token), "top_logprobs": []}
            finish = None if token != END else ("tool_calls" if call else "stop")
            choice = {"index": 0, "delta": delta, "logprobs": {"content": [entry]}, "token_ids": [token]}
            yield chunk(choices=[choice | {"finish_reason": finish}])
        yield chunk(choices=[], usage={"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)})
        yield "data: [DONE]\n\n"


class TalkEnv(MultiTurnEnv):
    """Three model turns, the environment answering `ack <n>` in between. Reward: 1 if the first reply is "yes", plus
    0.5 for odd-numbered rollouts (a group's rollouts start one after the other, so groups mix rewards).
    `fail_setup(k)` / `fail_response(k)` make the k-th rollout started (from 0) fail in that stage; `sleep_s(k)` is
    how long its env_response takes."""

    name = "talk"

    def __init__(self, fail_setup=lambda k: False, fail_response=lambda k: False, sleep_s=lambda k: 0.0) -> None:
        super().__init__(max_turns=3)
        self.fail_setup, self.fail_response, self.sleep_s = fail_setup, fail_response, sleep_s
        self.num_started = 0
        self._tasks = [Task(id=f"t{i}", prompt=[{"role": "user", "content": f"hello {i}"}]) for i in range(8)]

    def tasks(self, split):
        return self._tasks

    async def setup_state(self, task):
        k, self.num_started = self.num_started, self.num_started + 1
        if self.fail_setup(k):
            raise RuntimeError(f"setup of rollout {k} broke")
        return {"k": k, "replies": []}

    async def env_response(self, messages, state):
        await asyncio.sleep(self.sleep_s(state["k"]))
        if self.fail_response(state["k"]):
            raise KeyError("env bug")
        state["replies"].append(messages[-1]["content"])
        done = len(state["replies"]) == 3
        return ([] if done else [{"role": "user", "content": f"ack {len(state['replies'])}"}]), done

    async def reward(self, task, state):
        first = state["replies"][0] if state["replies"] else ""
        reward = float(first == "yes") + 0.5 * (state["k"] % 2)
        return RewardResult(reward, metrics={"num_replies": float(len(state["replies"]))})


def talk_script(messages, tools):
    """Turn 1: "yes" for even tasks, "no" for odd ones; turn 2: "maybe " (the template strips its trailing space, so
    turn 3's prompt breaks the prefix); turn 3: "bye"."""
    turn = sum(m["role"] == "assistant" for m in messages)
    if turn == 0:
        task = int(re.fullmatch(r"hello (\d+)", messages[0]["content"]).group(1))
        return ("yes" if task % 2 == 0 else "no"), None
    return ("maybe " if turn == 1 else "bye"), None


def run_env(tmp_path, monkeypatch, env, server, **overrides):
    monkeypatch.setattr("slipstream.envs.hosting.build_env", lambda name, **args: env)
    fields = dict(max_steps=2, batch_size=4, group_size=2, num_trainer_ranks=1, max_async_level=1)
    config = make_config(tmp_path, "", **{**fields, **overrides})
    run_with_trainer(config, server, 1)
    return config


def split_samples(mb) -> list[dict[str, list]]:
    """The samples packed in a micro-batch (positions restart at 0 for each; prefix trees of samples sharing their
    prompt written out as their samples)."""
    source = expand_trees(torch.tensor(mb.position_ids))[0].tolist()
    starts = [e for e, t in enumerate(source) if mb.position_ids[t] == 0] + [len(source)]
    fields = ("input_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")
    return [
        {f: [getattr(mb, f)[t] for t in source[a:b]] for f in fields} for a, b in zip(starts, starts[1:], strict=False)
    ]


def runs(sample: dict, loss: bool) -> list[str]:
    """Decoded maximal runs of tokens with loss_mask == `loss` (END shown as |)."""
    out, current = [], []
    for token, m in zip(sample["input_ids"], sample["loss_mask"], strict=True):
        if m == loss:
            current.append("|" if token == END else chr(token))
        elif current:
            out, current = out + ["".join(current)], []
    return out + (["".join(current)] if current else [])


def all_samples(output_dir: Path, steps: int) -> list[dict]:
    return [s for n in range(1, steps + 1) for mb in read_batch(batch_path(output_dir, n, 0)).micro_batches
            for s in split_samples(mb)]  # fmt: skip


def metrics_of(output_dir: Path, steps: int) -> list[dict]:
    return [read_batch(batch_path(output_dir, n, 0)).metrics for n in range(1, steps + 1)]


def test_multi_turn_samples_train_only_model_tokens(tmp_path, monkeypatch):
    server = FakeChatModel(talk_script)
    run_env(tmp_path, monkeypatch, TalkEnv(), server, sampling={"temperature": 0.7, "max_tokens": 64})

    samples = all_samples(tmp_path, 2)
    assert len(samples) == 2 * 4 * 2  # 4 rollouts a step, each split once (turn 3's prompt breaks the prefix)
    for s in samples:
        mask = s["loss_mask"]
        assert len({a for a, m in zip(s["advantages"], mask, strict=True) if m}) == 1
        masked = zip(s["advantages"], s["inference_logprobs"], mask, strict=True)
        assert all(a == lp == 0.0 for a, lp, m in masked if not m)
        assert all(t == (0.7 if m else 1.0) for t, m in zip(s["temperatures"], mask, strict=True))
        # two steps at async level 1: tokens of policy 0 or 1, each with that policy's log-prob
        pairs = [(lp, t) for lp, t, m in zip(s["inference_logprobs"], s["input_ids"], mask, strict=True) if m]
        assert all(lp in (fake_logprob(0, t), fake_logprob(1, t)) for lp, t in pairs)
    assert {abs(a) for s in samples for a in s["advantages"]} == {0.0, 0.25}  # +-0.25 on model tokens only
    turns_1_2 = [s for s in samples if len(runs(s, loss=True)) == 2]
    turn_3 = [s for s in samples if len(runs(s, loss=True)) == 1]
    assert len(turns_1_2) == len(turn_3) == 8
    for s in turns_1_2:  # the environment's `ack 1` between the model's turns is masked
        assert runs(s, loss=True) in (["yes|", "maybe |"], ["no|", "maybe |"])
        prompt, between = runs(s, loss=False)
        assert re.fullmatch(r"<\|user\|>hello \d\|<\|assistant\|>", prompt)
        assert between == "<|user|>ack 1|<|assistant|>"
    for s in turn_3:  # a new sample: the whole re-rendered conversation is its (masked) prompt
        assert runs(s, loss=True) == ["bye|"]
        assert runs(s, loss=False)[0].endswith("<|assistant|>maybe|<|user|>ack 2|<|assistant|>")

    for m in metrics_of(tmp_path, 2):
        assert m["rollout/num_turns_mean"] == 3 and m["rollout/num_prefix_breaks"] == 4
        assert m["batch/num_samples"] == 8 and m["rollout/stop/env_done"] == 4
        assert m["env/num_replies"] == 3.0 and m["pipeline/failed_rollouts"] == 0
        assert len("no|maybe |bye|") <= m["completion_len/mean"] <= len("yes|maybe |bye|") < m["seq_len/mean"]
    # later turns carry the conversation with the model's replies as streamed; no tools offered
    later = [b["messages"] for b in server.bodies if len(b["messages"]) > 1]
    assert later and all(m[1] in ({"role": "assistant", "content": "yes"}, {"role": "assistant", "content": "no"})
                         for m in later)  # fmt: skip
    assert all("tools" not in b and "tool_choice" not in b for b in server.bodies)


class CalcEnv(ToolEnv):
    """`What is <expr>?` with the calculator's `calculate` tool; reward 1 for <answer>42</answer> (every expression
    here is 42)."""

    name = "calc"

    def __init__(self) -> None:
        super().__init__([CALCULATE], max_turns=3)
        exprs = ["6*7", "12+30", "100-58", "2**5+10"]
        self._tasks = [
            Task(id=f"c{i}", prompt=[{"role": "user", "content": f"What is {e}?"}]) for i, e in enumerate(exprs)
        ]

    def tasks(self, split):
        return self._tasks

    async def reward(self, task, state):
        final = (state.get("final_message") or {}).get("content") or ""
        return RewardResult(
            float(final == "<answer>42</answer>"), {"tool_calls": float(state.get("num_tool_calls", 0))}
        )


def calc_script(messages, tools):
    """Calls `calculate` on the question's expression, then answers with the tool's result (off by one for task
    `12+30`, so rewards differ). Checks that the follow-up request carries the call and its result."""
    assert tools == [CALCULATE.schema]
    expression = re.fullmatch(r"What is (.+)\?", messages[0]["content"]).group(1)
    last = messages[-1]
    if last["role"] == "tool":
        (call,) = messages[-2]["tool_calls"]
        assert last["tool_call_id"] == call["id"] and call["type"] == "function"
        assert call["function"] == {"name": "calculate", "arguments": json.dumps({"expression": expression})}
        result = int(last["content"]) - (expression == "12+30")
        return f"<answer>{result}</answer>", None
    return "Let me compute.", ("calculate", {"expression": expression})


def test_tool_calls_round_trip_and_tool_tokens_are_masked(tmp_path, monkeypatch):
    server = FakeChatModel(calc_script)
    run_env(tmp_path, monkeypatch, CalcEnv(), server)

    assert server.bodies and all(b["tools"] == [CALCULATE.schema] and b["tool_choice"] == "auto" for b in server.bodies)
    samples = all_samples(tmp_path, 2)
    assert len(samples) == 8  # the template re-renders tool calls exactly: no prefix break
    for s in samples:
        prompt, tool_result = runs(s, loss=False)
        expression = re.fullmatch(r"<\|user\|>What is (.+)\?\|<\|assistant\|>", prompt).group(1)
        call = "Let me compute." + render_tool_call("calculate", {"expression": expression}) + "|"
        answer = "<answer>41</answer>|" if expression == "12+30" else "<answer>42</answer>|"
        assert runs(s, loss=True) == [call, answer]
        assert tool_result == "<|tool|>42|<|assistant|>"  # the tool's result is masked
    for m in metrics_of(tmp_path, 2):
        assert m["env/tool_calls"] == 1.0 and m["rollout/num_turns_mean"] == 2 and m["rollout/num_prefix_breaks"] == 0


def test_env_exception_fails_only_its_rollout(tmp_path, monkeypatch, capsys):
    # Groups of 3 start their rollouts one after the other: the 3rd of every group breaks in env_response.
    env = TalkEnv(fail_response=lambda k: k % 3 == 2)
    run_env(tmp_path, monkeypatch, env, FakeChatModel(talk_script), batch_size=6, group_size=3)

    for m in metrics_of(tmp_path, 2):
        assert m["batch/num_rollouts"] == 4  # two groups of two survivors
        assert m["pipeline/failed_rollouts"] == m["pipeline/failed_rollouts/env_response"] >= 2
        assert m["pipeline/failed_groups"] == 0 and m["rollout/num_turns_mean"] == 3
    out = capsys.readouterr().out
    assert "failed in env_response after 1 turns: KeyError: 'env bug' (excluded from training)" in out
    assert out.count("first env_response failure, traceback:") == 1


def test_rollout_over_its_time_budget_fails_as_timeout(tmp_path, monkeypatch):
    env = TalkEnv(sleep_s=lambda k: 30.0 if k % 3 == 2 else 0.0)  # the 3rd rollout of every group hangs
    run_env(tmp_path, monkeypatch, env, FakeChatModel(talk_script), batch_size=6, group_size=3, rollout_timeout_s=0.5)
    for m in metrics_of(tmp_path, 2):
        assert m["batch/num_rollouts"] == 4 and m["pipeline/failed_rollouts/timeout"] >= 2


def test_group_with_fewer_than_two_survivors_is_dropped(tmp_path, monkeypatch, capsys):
    env = TalkEnv(fail_setup=lambda k: k % 4 in (0, 1))  # every other group loses both rollouts in setup_state
    run_env(tmp_path, monkeypatch, env, FakeChatModel(talk_script), max_steps=3)

    metrics = metrics_of(tmp_path, 3)
    assert all(m["batch/num_rollouts"] == 4 for m in metrics)  # the run goes on with the other groups
    assert metrics[-1]["pipeline/failed_groups"] >= 3 and metrics[-1]["pipeline/failed_rollouts/setup_state"] >= 6
    assert "rollouts survived (at least 2 needed)" in capsys.readouterr().out


def test_context_limit_ends_rollouts_normally(tmp_path, monkeypatch):
    server = FakeChatModel(talk_script, max_prompt_tokens=80)  # room for turns 1 and 2, not for turn 3
    run_env(tmp_path, monkeypatch, TalkEnv(), server)
    for m in metrics_of(tmp_path, 2):
        assert m["rollout/stop/context_length"] == 4 and m["rollout/num_turns_mean"] == 2
        assert m["batch/num_rollouts"] == 4 and m["pipeline/failed_rollouts"] == 0


def test_online_multi_turn_eval_past_the_context_window_does_not_stop_training(tmp_path, monkeypatch):
    """Issue 14: online evaluation shares the training rollouts' model-turn path, so its rollouts that outgrow the
    context window (HTTP 400 from their third turn on) end normally, are scored, and training goes on."""
    evaluation = importlib.import_module("slipstream.eval.evaluate")  # the package exports a function of that name
    evaluated = []
    evaluate_task = evaluation.evaluate_multi_turn_task

    async def recording(*args, **kwargs):
        evaluated.append(result := await evaluate_task(*args, **kwargs))
        return result

    monkeypatch.setattr(evaluation, "evaluate_multi_turn_task", recording)
    server = FakeChatModel(talk_script, max_prompt_tokens=80)  # room for turns 1 and 2, not for turn 3
    online_eval = {"interval": 1, "num_samples": 2, "num_tasks": 2, "max_share": 0.5}
    run_env(tmp_path, monkeypatch, TalkEnv(), server, max_steps=3, eval=online_eval)

    metrics = metrics_of(tmp_path, 3)  # all three steps trained
    assert all(m["rollout/stop/context_length"] == 4 for m in metrics)
    logged = [m for m in metrics if "eval/reward_mean" in m]
    assert logged and all(m["eval/num_errors"] == 0 for m in logged)
    assert len(evaluated) >= 2 and all(r.finish_reasons == [CONTEXT_LENGTH] * 2 for r in evaluated)
    assert all(r.errors == [None, None] for r in evaluated)
    records = [json.loads(line) for line in (tmp_path / ONLINE_EVAL_FILE).read_text().splitlines()]
    assert records[0]["step"] == 0 and records[-1]["step"] == 3 and all(r["num_errors"] == 0 for r in records)


def test_advantages_are_computed_within_each_group_of_survivors():
    task = Task(id="t", prompt=[])
    rewards = {5: [1.0, 0.0], 7: [1.0, 1.0, 0.0]}  # group 7 kept 3 rollouts, group 5 only 2
    rollouts = [
        Rollout(task, [1], [2], [-1.0], "", [0], 0, reward=r, group_index=g) for g, rs in rewards.items() for r in rs
    ]
    metrics = assign_advantages(1, rollouts, make_config(Path("/tmp"), ""))
    assert [r.advantage for r in rollouts] == pytest.approx([0.5, -0.5, 1 / 3, 1 / 3, -2 / 3])
    assert metrics["batch/zero_adv_groups"] == 0 and metrics["batch/num_rollouts"] == 5


def test_tool_call_parser_flags(monkeypatch):
    monkeypatch.setattr("slipstream.inference.server._has_cuda", lambda: False)  # no torch import
    base = InferenceConfig(model={"name": MODEL})
    assert "--enable-auto-tool-choice" not in build_vllm_argv(base, Path("/m"))
    argv = build_vllm_argv(base.model_copy(update={"tool_call_parser": "hermes"}), Path("/m"))
    i = argv.index("--enable-auto-tool-choice")
    assert argv[i + 1 : i + 3] == ["--tool-call-parser", "hermes"]


def test_multi_turn_against_the_streaming_simulator(tmp_path, monkeypatch):
    """The simulator streams each turn like vLLM, each token stamped with the version served when it arrived.
    The simulator re-renders replies as text, so every later turn breaks the prefix and starts a sample."""
    monkeypatch.setattr("slipstream.envs.hosting.build_env", lambda name, **args: TalkEnv())
    server = SimServer(SimConfig(model_name=SIM_MODEL, token_latency_s=0.001))
    with serve_in_thread(server) as url:
        config = config_for(tmp_path, url, max_steps=3, batch_size=4, sampling={"max_tokens": 5})
        run_with_fast_trainer(config, server)
    for n in (1, 2, 3):
        batch = read_batch(batch_path(tmp_path, n, 0))
        m = batch.metrics
        assert (
            m["rollout/num_turns_mean"] == 3 and m["rollout/num_prefix_breaks"] == 2 * 4 == m["batch/num_samples"] - 4
        )
        assert m["policy/lag_max"] <= 2  # async level 1, and a slow group of policy 0 may land in batch 3
        for mb in batch.micro_batches:
            tokens = [(t, lp) for t, lp, m in zip(mb.input_ids, mb.inference_logprobs, mb.loss_mask, strict=True) if m]
            assert tokens and all(lp in {sim_logprob(v, t) for v in range(n)} for t, lp in tokens)
    chats = [r for r in server.engine.records if r.endpoint == "chat"]
    assert all(r.n == 1 for r in chats) and salts(chats) == [f"policy-{r.version_at_arrival}" for r in chats]


def test_a_batch_without_model_tokens_is_a_clear_error():
    rollout = Rollout(Task(id="t", prompt=[]), [], [], [], "", [], 0, samples=[], stop_reason="context_length")
    with pytest.raises(ValueError, match="step 3: no tokens to train on.*max_model_len"):
        build_training_batches(3, [rollout], 1.0, 512, 1, {})


def test_an_environment_that_fails_every_rollout_stops_the_run(tmp_path, monkeypatch):
    """No batch can fill when every rollout fails: the run stops with the cause instead of waiting forever."""
    from slipstream.orchestrator.multiturn import MAX_GROUPS_WITHOUT_SURVIVORS, EnvironmentBroken

    env = TalkEnv(fail_setup=lambda k: True)
    with pytest.raises(EnvironmentBroken, match=f"last {MAX_GROUPS_WITHOUT_SURVIVORS} groups.*setup of rollout"):
        run_env(tmp_path, monkeypatch, env, FakeChatModel(talk_script))


@pytest.mark.parametrize("value", [float("nan"), None, float("inf")])
def test_a_missing_or_non_finite_reward_fails_its_rollout(value):
    from slipstream.envs.rollout import ModelTurn, RolloutError, run_rollout

    class NoReward(TalkEnv):
        async def reward(self, task, state):
            return RewardResult(value)

    async def model(messages, tools):
        return ModelTurn({"role": "assistant", "content": "yes"})

    env = NoReward()
    outcome = asyncio.run(run_rollout(env, env.tasks("train")[0], model))
    assert isinstance(outcome, RolloutError) and outcome.stage == "missing_reward" and "finite number" in str(outcome)


def test_orchestrator_serves_its_metrics_to_prometheus(tmp_path, monkeypatch):
    """monitor.prometheus_port: the orchestrator serves its step metrics and counters on the next port."""

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from slipstream.monitor.prometheus import PrometheusExporter

    exporters = []
    monkeypatch.setattr(PrometheusExporter, "close", lambda self: exporters.append(self))  # scraped after the run
    port = free_port(count=2)  # the orchestrator takes monitor.prometheus_port + 1
    run_env(tmp_path, monkeypatch, TalkEnv(), FakeChatModel(talk_script), monitor={"prometheus_port": port})
    (exporter,) = exporters
    try:
        text = httpx.get(f"http://127.0.0.1:{port + 1}/metrics", timeout=5).text
    finally:
        exporter.server.shutdown()
        exporter.server.server_close()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.labels}
    assert got["slipstream_step"] == 2 and got["slipstream_batch_num_rollouts"] == 4
    assert "slipstream_pipeline_dispatched_groups" in got
