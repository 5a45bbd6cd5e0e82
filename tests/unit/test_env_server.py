"""Env servers (envs/server/): an environment in its own process, spoken to through the environment protocol; its
crash fails only the rollouts it held (counted), then it is restarted or the run stops, as configured."""

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from slipstream.config.orchestrator import EnvConfig
from slipstream.envs.driver_testing import ScriptedPolicy, assistant
from slipstream.envs.hosting import open_environment, runs_in_env_server
from slipstream.envs.rollout import MISSING_REWARD, RolloutError, RolloutResult, run_rollout
from slipstream.envs.server import wire
from slipstream.envs.server.client import EnvServerClient, EnvServerDown
from slipstream.envs.server.server import EnvHost

pytestmark = pytest.mark.timeout(120)

GATE_ENV = '''
import asyncio
import os

from slipstream.envs.base import RewardResult, Task
from slipstream.envs.multiturn import MultiTurnEnv


class GateEnv(MultiTurnEnv):
    """Two turns; the reply "hold" blocks env_response (a rollout in flight), "boom" raises."""

    name = "gate"

    def __init__(self, gate_dir, reward=1.0):
        super().__init__(max_turns=2, tools=[{"type": "function", "function": {"name": "noop", "parameters": {}}}])
        self.gate_dir, self.reward_value = gate_dir, reward

    def tasks(self, split):
        prompts = [[{"role": "user", "content": f"say {i}"}] for i in range(3)]
        return [Task(id=f"{split}-{i}", prompt=p, answer=str(i)) for i, p in enumerate(prompts)]

    async def setup_state(self, task):
        return {"turns": 0, "pid": os.getpid()}

    async def env_response(self, messages, state):
        state["turns"] += 1
        text = messages[-1]["content"]
        if text == "hold":
            open(os.path.join(self.gate_dir, f"held-{len(os.listdir(self.gate_dir))}"), "w").close()
            await asyncio.sleep(3600)
        if text == "boom":
            raise RuntimeError("boom in env_response")
        return ([{"role": "user", "content": "again"}], False) if state["turns"] == 1 else ([], True)

    async def reward(self, task, state):
        value = self.reward_value if messages_ok(state) else 0.0
        return RewardResult(value=value, metrics={"turns": float(state["turns"]), "pid": float(state["pid"])})


def messages_ok(state):
    return state["turns"] == 2


def load_environment(load_delay_s=0.0, **args):
    import time

    time.sleep(load_delay_s)
    return GateEnv(**args)
'''

ENV_NAME = "gate_env:load_environment"


@pytest.fixture
def gate(tmp_path, monkeypatch) -> Path:
    """The test environment as an importable module, for this process and for env servers it starts."""
    (tmp_path / "gate_env.py").write_text(GATE_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    gate_dir = tmp_path / "gate"
    gate_dir.mkdir()
    return gate_dir


def env_config(gate_dir: Path, mode: str = "process", reward: float | None = 1.0, **server) -> EnvConfig:
    args = {"gate_dir": str(gate_dir), "reward": reward}
    return EnvConfig(name=ENV_NAME, args=args, server={"mode": mode, "startup_timeout_s": 60, **server})


async def wait_for(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.02)


def two_turns(first: str = "hi") -> ScriptedPolicy:
    return ScriptedPolicy([assistant(first), assistant("bye")])


def test_an_env_server_plays_like_the_environment_in_process(gate, tmp_path):
    async def play(mode: str):
        async with open_environment(env_config(gate, mode), tmp_path / "run") as env:
            task = env.tasks("train")[1]
            result = await run_rollout(env, task, two_turns())
            return env, [t.prompt for t in env.tasks("eval")], result

    local_env, local_eval, local = asyncio.run(play("in_process"))
    remote_env, remote_eval, remote = asyncio.run(play("process"))
    assert isinstance(remote_env, EnvServerClient) and not isinstance(local_env, EnvServerClient)
    assert (remote_env.name, remote_env.max_turns, remote_env.tools) == (local_env.name, 2, local_env.tools)
    assert remote_eval == local_eval
    assert isinstance(remote, RolloutResult) and remote.messages == local.messages
    assert remote.reward.value == local.reward.value == 1.0 and remote.stop_reason == "env_done"
    assert remote.reward.metrics["pid"] != os.getpid()  # the environment ran in another process
    log = (tmp_path / "run" / "logs" / "env_server_gate_env_load_environment.log").read_text()
    assert "serving on ipc://" in log


def test_environment_errors_fail_that_rollout_only(gate, tmp_path):
    async def main():
        async with open_environment(env_config(gate), tmp_path / "run") as env:
            task = env.tasks("train")[0]
            failed, ok = await asyncio.gather(
                run_rollout(env, task, two_turns("boom")), run_rollout(env, task, two_turns())
            )
            return failed, ok, env.counters()

    failed, ok, counters = asyncio.run(main())
    assert (
        isinstance(failed, RolloutError) and failed.stage == "env_response" and "boom in env_response" in failed.error
    )
    assert isinstance(ok, RolloutResult) and ok.reward.value == 1.0
    assert counters["env_server/crashes"] == 0 and counters["env_server/lost_rollouts"] == 0


def test_a_missing_reward_from_an_env_server_fails_the_rollout(gate, tmp_path):
    async def main():
        async with open_environment(env_config(gate, reward=None), tmp_path / "run") as env:
            return await run_rollout(env, env.tasks("train")[0], two_turns())

    result = asyncio.run(main())
    assert isinstance(result, RolloutError) and result.stage == MISSING_REWARD and "no reward" in result.error


def test_the_wire_refuses_other_versions_and_unknown_methods(gate):
    host = EnvHost(ENV_NAME, {"gate_dir": str(gate)})
    with pytest.raises(ValueError, match="wire version 99"):
        asyncio.run(host.handle(wire.Request(id=0, method="info", version=99)))
    with pytest.raises(ValueError, match="unknown method 'play'"):
        asyncio.run(host.handle(wire.Request(id=1, method="play")))
    request = wire.Request(id=2, method="setup_state", args={"split": "train", "index": 1})
    assert wire.decode_request(wire.encode(request)) == request
    info = asyncio.run(host.handle(wire.Request(id=3, method="info")))
    assert wire.convert(wire.decode_reply(wire.encode(wire.Reply(id=3, ok=True, result=info))).result, wire.EnvInfo)
    with pytest.raises(TypeError, match="cannot be sent between processes"):
        wire.to_builtins({"x": object()}, "task t's info")


async def crash_while_held(env: EnvServerClient, gate: Path) -> tuple[list[asyncio.Task], asyncio.Event]:
    """Two rollouts held inside the server and one between turns (its state lives there); SIGKILL the server."""
    task = env.tasks("train")[0]
    release = asyncio.Event()

    class WaitingPolicy(ScriptedPolicy):
        waiting = False

        async def __call__(self, messages, tools):
            if len(self.seen_messages) == 1:
                self.waiting = True
                await release.wait()
            return await super().__call__(messages, tools)

    waiting = WaitingPolicy([assistant("hi"), assistant("bye")])
    rollouts = [asyncio.create_task(run_rollout(env, task, two_turns("hold"))) for _ in range(2)]
    rollouts.append(asyncio.create_task(run_rollout(env, task, waiting)))
    await wait_for(lambda: len(list(gate.iterdir())) == 2 and waiting.waiting)
    os.kill(env.process.pid, signal.SIGKILL)
    return rollouts, release


def test_a_crash_fails_only_its_rollouts_and_the_server_is_restarted(gate, tmp_path):
    async def main():
        async with open_environment(env_config(gate, on_crash="restart"), tmp_path / "run") as env:
            supervisor = asyncio.create_task(env.supervise())
            first_pid = env.process.pid
            rollouts, release = await crash_while_held(env, gate)
            held = await asyncio.gather(*rollouts[:2])
            await wait_for(lambda: env.counters()["env_server/restarts"] == 1 and env._up.is_set())
            release.set()
            between_turns = await rollouts[2]
            after = await run_rollout(env, env.tasks("train")[2], two_turns())
            supervisor.cancel()
            return held, between_turns, after, env.counters(), first_pid, env.process.pid

    held, between_turns, after, counters, first_pid, second_pid = asyncio.run(main())
    for result in [*held, between_turns]:
        assert isinstance(result, RolloutError) and result.stage == "env_response"
    assert all("killed by SIGKILL" in r.error for r in held)
    assert "died" in between_turns.error
    assert isinstance(after, RolloutResult) and after.reward.value == 1.0 and second_pid != first_pid
    assert counters == {"env_server/crashes": 1.0, "env_server/restarts": 1.0, "env_server/lost_rollouts": 3.0}


@pytest.mark.parametrize(("on_crash", "reason"), [("stop", "on_crash = 'stop'"), ("restart", "max_restarts = 0")])
def test_a_crash_stops_the_run_when_configured(on_crash, reason, gate, tmp_path):
    async def main():
        config = env_config(gate, on_crash=on_crash, max_restarts=0)
        async with open_environment(config, tmp_path / "run") as env:
            supervisor = asyncio.create_task(env.supervise())
            rollouts, release = await crash_while_held(env, gate)
            with pytest.raises(EnvServerDown) as stopped:
                await supervisor
            release.set()
            outcomes = await asyncio.gather(*rollouts)
            new = await run_rollout(env, env.tasks("train")[0], two_turns())
            return str(stopped.value), outcomes, new, env.counters()

    message, outcomes, new, counters = asyncio.run(main())
    assert "killed by SIGKILL; stopping the run" in message and reason in message and "env_server_gate" in message
    assert all(isinstance(o, RolloutError) for o in outcomes)
    assert isinstance(new, RolloutError) and new.stage == "setup_state"
    assert counters["env_server/crashes"] == 1 and counters["env_server/restarts"] == 0


def test_a_server_that_cannot_load_its_environment_says_why(tmp_path):
    async def main():
        config = EnvConfig(name="no_such_pkg.envs:load_environment", server={"mode": "process"})
        async with open_environment(config, tmp_path / "run"):
            pass

    with pytest.raises(EnvServerDown, match="exited while loading(.|\n)*cannot import 'no_such_pkg.envs'"):
        asyncio.run(main())


def test_auto_mode_runs_verifiers_in_a_process_and_builtins_in_process():
    assert runs_in_env_server(EnvConfig(name="verifiers"))
    assert not runs_in_env_server(EnvConfig(name="reverse_text"))
    assert runs_in_env_server(EnvConfig(name="reverse_text", server={"mode": "process"}))
    assert not runs_in_env_server(EnvConfig(name="verifiers", server={"mode": "in_process"}))


def test_the_orchestrator_trains_through_an_env_server(tmp_path):
    from tests.unit.test_orch_loop import FakeVLLM, make_config, run_with_trainer, step_metrics

    env = {"name": "reverse_text", "args": {"num_tasks": 5}, "server": {"mode": "process"}}
    config = make_config(tmp_path, "", max_steps=2, batch_size=4, group_size=2, num_trainer_ranks=1, env=env)
    run_with_trainer(config, FakeVLLM(), 1)
    for m in step_metrics(tmp_path, 2):
        assert m["batch/num_rollouts"] == 4 and m["env_server/crashes"] == 0 and m["pipeline/failed_rollouts"] == 0
    assert (tmp_path / "logs" / "env_server_reverse_text.log").exists()


def test_a_crash_fails_calls_in_flight_even_when_nothing_supervises(gate, tmp_path):
    async def main():
        async with open_environment(env_config(gate), tmp_path / "run") as env:
            rollouts, release = await crash_while_held(env, gate)
            async with asyncio.timeout(30):  # nothing waits on the dead server
                held = await asyncio.gather(*rollouts[:2])
            release.set()
            return held, await rollouts[2], env.counters()

    held, between_turns, counters = asyncio.run(main())
    assert all(isinstance(r, RolloutError) and "killed by SIGKILL" in r.error for r in [*held])
    assert isinstance(between_turns, RolloutError)
    assert counters["env_server/crashes"] == 1 and counters["env_server/restarts"] == 0


def test_a_server_that_does_not_come_up_in_time_is_stopped(gate, tmp_path):
    async def main():
        config = env_config(gate)
        config = config.model_copy(update={"args": {**config.args, "load_delay_s": 60}})
        config.server.startup_timeout_s = 1
        async with open_environment(config, tmp_path / "run") as env:
            return env

    with pytest.raises(EnvServerDown, match="did not answer within startup_timeout_s = 1 s"):
        asyncio.run(main())
