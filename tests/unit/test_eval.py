"""Evaluation: pass@k against hand values, reward summaries, and `evaluate` / `run_eval` on the simulated server."""

import asyncio
import json
import math
import sys

import pytest

from slipstream.config.base import ConfigError
from slipstream.config.eval import EvalConfig
from slipstream.config.loader import load_config, validate_config
from slipstream.config.orchestrator import SamplingConfig
from slipstream.envs.base import RewardResult, Task
from slipstream.envs.multiturn import MultiTurnEnv
from slipstream.eval.evaluate import default_pass_ks, evaluate
from slipstream.eval.metrics import mean_pass_at_k, pass_at_k, reward_summary
from slipstream.eval.run import resolve_eval_model, run_eval
from slipstream.eval.server import SEEDED_SAMPLING_ARGS, build_eval_server_argv, wait_until_healthy
from slipstream.eval.tasks import request_seed
from slipstream.launch.plan import ProcessSpec
from slipstream.launch.supervisor import Supervisor
from slipstream.orchestrator.client import InferenceClient
from slipstream.weights.wire.published import READY, weights_dir
from slipstream_sim import SimConfig, SimServer, serve_in_thread


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (10, 3, 5, 11 / 12),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (5, 0, 3, 0.0),
        (3, 2, 2, 1.0),  # fewer than k failures: every k-subset has a success
        (8, 8, 1, 1.0),
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomial_formula():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="1 <= k <= num_samples"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 5, 1)


def test_mean_pass_at_k_uses_threshold():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.9, 0.95, 0.2, 0.1]]
    assert mean_pass_at_k(rewards, 1, threshold=1.0) == pytest.approx((0.25 + 0.0) / 2)
    assert mean_pass_at_k(rewards, 2, threshold=0.9) == pytest.approx((0.5 + 5 / 6) / 2)


def test_reward_summary_hand_values():
    summary = reward_summary([[0.0, 1.0], [0.5, 0.5]])
    assert summary["reward_mean"] == pytest.approx(0.5)
    assert summary["reward_std"] == pytest.approx(math.sqrt((0.25 + 0.25 + 0 + 0) / 4))
    assert summary["reward_stderr"] == pytest.approx(0.0)  # both task means are 0.5
    assert (summary["reward_min"], summary["reward_max"]) == (0.0, 1.0)
    assert reward_summary([[0.2], [0.6]])["reward_stderr"] == pytest.approx(math.sqrt(0.08) / math.sqrt(2))


def test_default_pass_ks_and_request_seeds():
    assert [default_pass_ks(n) for n in (1, 2, 4, 5, 8)] == [[1], [1, 2], [1, 2, 4], [1, 2, 4, 5], [1, 2, 4, 8]]
    seeds = {request_seed(s, f"eval-{i}") for s in (0, 1) for i in range(50)}
    assert len(seeds) == 100 and all(0 <= s < 2**31 for s in seeds)
    assert request_seed(3, "eval-7") == request_seed(3, "eval-7")


class LetterEnv:
    """Reward 1.0 if the completion starts with a letter before 'n' (half of the sim's letters), else its length
    fraction in [0, 0.5): rewards are in [0, 1] and about half of the samples pass the threshold 1.0."""

    name = "letters"

    def tasks(self, split):
        if split != "eval":
            raise ValueError(f"no split {split!r}")
        return [Task(id=f"eval-{i}", prompt=[{"role": "user", "content": f"task {i}"}]) for i in range(12)]

    def reward(self, task, completion_text):
        if completion_text[:1] < "n":
            return 1.0
        return min(len(completion_text), 15) / 32


def _evaluate(url, seed, num_samples=4, **kwargs):
    async def run():
        async with InferenceClient(url, "sim-model", 30.0) as client:
            return await evaluate(
                client, LetterEnv(), "eval", num_samples, SamplingConfig(max_tokens=8), seed, **kwargs
            )

    return asyncio.run(run())


def test_evaluate_on_sim_server_is_deterministic_and_in_range():
    done = []
    with serve_in_thread(SimServer(SimConfig(model_name="sim-model", stop_prob=0.2))) as url:
        first = _evaluate(url, seed=5, on_task_done=lambda t: done.append(t.task_id))
        again = _evaluate(url, seed=5)
        other = _evaluate(url, seed=6)
    assert sorted(done) == sorted(f"eval-{i}" for i in range(12))
    assert first.to_dict() | {"seconds": 0} == again.to_dict() | {"seconds": 0}
    assert [t.completions for t in other.tasks] != [t.completions for t in first.tasks]  # the seed reaches the server
    assert (first.num_tasks, first.num_samples, first.env, first.split) == (12, 4, "letters", "eval")
    assert [t.task_id for t in first.tasks] == [f"eval-{i}" for i in range(12)]  # task order, not finish order
    assert 0.0 < first.reward_mean < 1.0 and 0.0 <= first.reward_min <= first.reward_max <= 1.0
    assert list(first.pass_at_k) == [1, 2, 4]
    pass_values = list(first.pass_at_k.values())
    assert 0.0 < pass_values[0] < 1.0 and pass_values == sorted(pass_values)
    fraction_solved = sum(r == 1.0 for t in first.tasks for r in t.rewards) / 48
    assert first.pass_at_k[1] == pytest.approx(fraction_solved)
    metrics = first.metrics()
    assert metrics["eval/reward_mean"] == first.reward_mean and metrics["eval/pass@4"] == first.pass_at_k[4]


def test_evaluate_limits_tasks_and_checks_split():
    with serve_in_thread(SimServer(SimConfig(stop_prob=0.2))) as url:
        result = _evaluate(url, seed=0, num_samples=3, num_tasks=5, pass_threshold=0.2, pass_ks=[2])
        assert result.num_tasks == 5 and list(result.pass_at_k) == [2]
        with pytest.raises(ValueError, match="no split"):
            asyncio.run(_run_split(url, "test"))


async def _run_split(url, split):
    async with InferenceClient(url, "m", 30.0) as client:
        await evaluate(client, LetterEnv(), split, 1, SamplingConfig(), 0)


def _config(**fields):
    return validate_config(EvalConfig, {"model": {"name": "sim-model"}, **fields})


def test_run_eval_against_running_server_writes_json(tmp_path, capsys):
    out = tmp_path / "results" / "eval.json"
    with serve_in_thread(SimServer(SimConfig(model_name="sim-model", stop_prob=0.1))) as url:
        config = _config(
            inference_url=url, num_samples=2, num_tasks=6, seed=3, output_path=str(out),
            sampling={"temperature": 0.7, "max_tokens": 8}, env={"name": "reverse_text", "args": {"num_eval_tasks": 8}},
        )  # fmt: skip
        results = run_eval(config)
        again = run_eval(config)
    assert json.loads(out.read_text()) == again
    assert results["tasks"] == again["tasks"] and results["reward_mean"] == again["reward_mean"]
    assert results["num_tasks"] == 6 and results["pass_at_k"].keys() == {"1", "2"}
    assert 0.0 <= results["reward_mean"] <= 1.0 and results["model_path"] is None
    assert results["config"]["seed"] == 3
    captured = capsys.readouterr()
    assert "reverse_text/eval: 6 tasks x 2 samples | reward" in captured.out
    assert "6/6" in captured.err  # the progress bar


def test_config_rules():
    config = _config(seed=4)
    assert config.inference.model.name == "sim-model" and config.inference.seed == 4
    assert config.resolved_output_path is None
    run = _config(run_dir="/tmp/run", step=3)
    assert str(run.resolved_output_path) == "/tmp/run/eval/step_3.json"
    with pytest.raises(ConfigError, match="run_dir and step go together"):
        _config(step=3)
    with pytest.raises(ConfigError, match="remove inference_url"):
        _config(run_dir="/tmp/run", step=3, inference_url="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match="inference.model differs from the top-level model"):
        _config(inference={"model": {"name": "other"}})
    with pytest.raises(ConfigError, match="num_samples"):
        _config(num_samples=0)


def test_resolve_eval_model_for_run_steps(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "run"
    (run / "config").mkdir(parents=True)
    (run / "config" / "inference.toml").write_text(f'[model]\nname = "{model}"\n')
    assert resolve_eval_model(_config(model={"name": str(model)}, run_dir=str(run), step=0)) == model
    weights_dir(run, 2).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="newest published step of this run is None"):
        resolve_eval_model(_config(model={"name": str(model)}, run_dir=str(run), step=2))
    (weights_dir(run, 2) / READY).touch()
    assert resolve_eval_model(_config(model={"name": str(model)}, run_dir=str(run), step=2)) == weights_dir(run, 2)
    with pytest.raises(ValueError, match="is not the model of run"):
        resolve_eval_model(_config(model={"name": "other"}, run_dir=str(run), step=2))


def test_server_failure_shows_its_log(tmp_path):
    log = tmp_path / "inference.log"
    code = "import sys; print('model load failed: bad weights'); sys.exit(3)"
    sup = Supervisor(grace_s=1.0)
    try:
        sup.start(ProcessSpec("inference", [sys.executable, "-c", code], log))
        with pytest.raises(RuntimeError, match="(?s)exited with code 3.*model load failed: bad weights"):
            wait_until_healthy(sup, "http://127.0.0.1:9", 30.0, log)
    finally:
        sup.stop_all()


def test_unseeded_requests(tmp_path):
    with serve_in_thread(SimServer(SimConfig(model_name="sim-model", stop_prob=0.2))) as url:
        results = run_eval(_config(inference_url=url, num_tasks=3, seed_requests=False))
    assert [t["request_seed"] for t in results["tasks"]] == [None, None, None]


def test_eval_server_runs_without_chunked_prefill(tmp_path):
    config = _config().inference
    argv = build_eval_server_argv(config, tmp_path)
    assert argv[-len(SEEDED_SAMPLING_ARGS) :] == SEEDED_SAMPLING_ARGS
    assert "--served-model-name" in argv and str(tmp_path) in argv
    own = config.model_copy(update={"extra_args": ["--enable-chunked-prefill"]})
    assert build_eval_server_argv(own, tmp_path)[-1] == "--enable-chunked-prefill"


class TwoTurnEnv(MultiTurnEnv):
    """Multi-turn: the env asks once more after the first reply; reward = fraction of letters before 'n' in the
    second reply. Task eval-5 fails in setup_state (a broken environment), which must count as reward 0."""

    name = "two_turns"

    def __init__(self) -> None:
        super().__init__(max_turns=3)

    def tasks(self, split):
        return [Task(id=f"eval-{i}", prompt=[{"role": "user", "content": f"task {i}"}]) for i in range(6)]

    async def setup_state(self, task):
        if task.id == "eval-5":
            raise RuntimeError("sandbox unavailable")
        return {"replies": []}

    async def env_response(self, messages, state):
        state["replies"].append(messages[-1]["content"])
        return ([{"role": "user", "content": "again"}], False) if len(state["replies"]) < 2 else ([], True)

    async def reward(self, task, state):
        text = state["replies"][-1]
        return RewardResult(sum(c < "n" for c in text) / max(len(text), 1), {"num_replies": len(state["replies"])})


def test_evaluate_multi_turn_env_on_sim_server():
    async def run(url, seed):
        async with InferenceClient(url, "sim-model", 30.0) as client:
            return await evaluate(client, TwoTurnEnv(), "eval", 3, SamplingConfig(max_tokens=6), seed)

    with serve_in_thread(SimServer(SimConfig(stop_prob=0.1))) as url:
        first, again, other = asyncio.run(run(url, 1)), asyncio.run(run(url, 1)), asyncio.run(run(url, 2))
    assert first.to_dict() | {"seconds": 0} == again.to_dict() | {"seconds": 0}
    assert [t.completions for t in other.tasks] != [t.completions for t in first.tasks]
    assert first.num_tasks == 6 and first.num_errors == 3 and first.env_metrics == {"num_replies": 2.0}
    failed = first.tasks[5]
    assert failed.rewards == [0.0] * 3 and failed.finish_reasons == ["error:setup_state"] * 3
    assert "sandbox unavailable" in failed.errors[0]
    ok = first.tasks[0]
    assert ok.errors == [None] * 3 and ok.finish_reasons == ["env_done"] * 3
    assert [m["role"] for m in ok.completions[0]] == ["assistant", "user", "assistant"]
    assert all(0 < n <= 12 for n in ok.num_completion_tokens)
    assert 0.0 < first.reward_mean < 1.0 and first.metrics()["eval/env/num_replies"] == 2.0


def test_config_round_trips_through_toml(tmp_path):
    config = _config(seed=3, run_dir=str(tmp_path), step=2, num_samples=4, env={"args": {"num_eval_tasks": 8}})
    config.write_toml(tmp_path / "eval.toml")
    assert load_config(EvalConfig, ["-c", str(tmp_path / "eval.toml")]) == config
