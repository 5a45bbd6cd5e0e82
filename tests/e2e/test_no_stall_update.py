"""No-stall weight updates (`weights.no_stall`) on the real vLLM CPU build, one server for both tests: its workers
fingerprint the model's parameters at the start and end of every engine step (tests/e2e/step_fingerprint_ext.py).

- The orchestrator's WeightRelay loads version 1 (a new transfer session: paused, declared) and then version 2 while
  streamed requests run, from a sender (this test, as the trainer) that pauses between buckets: tokens keep streaming
  while the version is staged, no engine step sees its parameters change, steps of both versions ran, the swap loads
  the model's own weights back bit for bit (the fingerprint vLLM started with), and the relay reports the swap's
  seconds (the time vLLM did not generate) and the staging's.
- `slipstream rl` trains 3 steps with `weights.no_stall = true` and delta updates over gloo against that server (the
  delta mirror is the staging memory), every version verified by the probe."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from slipstream.config.orchestrator import OrchestratorConfig
from slipstream.inference.admin_token import TOKEN_ENV, admin_headers
from slipstream.orchestrator.client import InferenceClient
from slipstream.orchestrator.weights import WeightRelay
from slipstream.rollout.record import cache_salt
from slipstream.utils.fs import atomic_write_text
from slipstream.weights.wire.collective import GroupInit, close_group, open_group, open_store
from slipstream.weights.wire.offers import MANIFEST, OFFER, is_offered, mark_delivered, wait_for_accept
from slipstream.weights.wire.published import weights_dir
from slipstream.weights.wire.stream import Manifest, TensorMeta, broadcast, plan_buckets
from tests.e2e.helpers import free_port, shared_inference, tiny_rl_config, write_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
REPO_ROOT = Path(__file__).resolve().parents[2]
EXTENSION = ["--worker-extension-cls", "tests.e2e.step_fingerprint_ext.StepFingerprints"]
BUCKET_BYTES = 120_000
"""Buckets smaller than a layer: the tiny model goes in about forty."""
PAUSE_S = 0.1
"""The sender's pause before each bucket: the staging window lasts seconds, a few hundred engine steps."""
MESSAGES = [{"role": "user", "content": "Count slowly from one to one hundred, one number per line."}]


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    """A vLLM server (the tiny Qwen3, `tiny_rl_config`'s flags) whose workers fingerprint every engine step."""
    root = tmp_path_factory.mktemp("no_stall_inference")
    config = tiny_rl_config(tiny_qwen3_dir, root / "unused", max_steps=1)
    config["inference"]["extra_args"] = EXTENSION
    env = {"PYTHONPATH": f"{REPO_ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    with shared_inference(config, root, env) as shared:
        yield shared


def _rpc(url: str, token: str, method: str):
    reply = httpx.post(f"{url}/collective_rpc", json={"method": method}, headers=admin_headers(token), timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["results"][0]


def _offer(out: Path, manifest: Manifest) -> None:
    folder = weights_dir(out, manifest.step)
    folder.mkdir(parents=True)
    atomic_write_text(folder / MANIFEST, manifest.to_json())
    atomic_write_text(folder / OFFER, json.dumps({"step": manifest.step, "backend": "gloo", "senders": 1}))


def _trainer(out: Path, port: int, versions: list[dict[str, torch.Tensor]], plan, sent: dict) -> None:
    """Trainer rank 0 of this test: offers versions 1, 2, ... in turn, each sent once accepted (with PAUSE_S before
    every bucket of version 2 on), then marked DELIVERED. `sent[step]`: when its first and last bucket went."""
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=120)
    group, session = None, None
    try:
        for step, tensors in enumerate(versions, start=1):
            _offer(out, Manifest(step, plan))
            accept = wait_for_accept(out, step, set(), timeout_s=120)
            if accept.session != session:
                close_group(group)
                init = GroupInit("gloo", "127.0.0.1", port, accept.session, accept.world_size, 1, timeout_s=120)
                group, session = open_group(store, init, 0, torch.device("cpu")), accept.session
            times = []
            for bucket in plan:
                if step > 1:
                    time.sleep(PAUSE_S)
                times.append(time.monotonic())
                broadcast(group, torch.cat([tensors[m.name].reshape(-1).view(torch.uint8) for m in bucket.tensors]))
            sent[step] = (times[0], times[-1])
            mark_delivered(out, step, session)
    finally:
        close_group(group)


async def _stream_across(relay: WeightRelay, chunks: list[float]) -> None:
    """Streamed requests one after another (2 choices each) while the relay loads version 2: `chunks` gets each
    chunk's arrival time. Stops once the update is done and one more request finished."""
    client = relay.client
    sampling = {"temperature": 1.0, "max_completion_tokens": 200, "ignore_eos": True}
    updated = asyncio.Event()

    async def stream() -> None:
        while True:
            async for _ in client.stream_chat(MESSAGES, sampling, 2, cache_salt(relay.served_version)):
                chunks.append(time.monotonic())
            if updated.is_set():
                return

    streaming = asyncio.create_task(stream())
    while len(chunks) < 20:  # the requests run before the update starts
        assert not streaming.done()
        await asyncio.sleep(0.05)
    await relay.update(2)
    updated.set()
    await streaming


def test_a_no_stall_update_swaps_between_engine_steps_while_tokens_stream(
    tiny_qwen3_dir, tmp_path, server, monkeypatch
):
    monkeypatch.setenv(TOKEN_ENV, server.token)
    out, port = tmp_path / "run", free_port()
    own = {}
    for shard in sorted(Path(tiny_qwen3_dir).glob("*.safetensors")):
        own.update({n: t.float() for n, t in load_file(shard).items()})
    halved = {n: t * 0.5 for n, t in own.items()}
    plan = tuple(plan_buckets([TensorMeta.of(n, t) for n, t in own.items()], BUCKET_BYTES))
    assert len(plan) >= 6
    config = OrchestratorConfig(
        model={"name": str(tiny_qwen3_dir)}, output_dir=out, max_steps=2, inference_url=server.url,
        weights={"transport": "gloo", "no_stall": True, "master_port": port}, weight_check={"enabled": False},
    )  # fmt: skip
    initial = float(_rpc(server.url, server.token, "install_fingerprints"))
    sent: dict[int, tuple[float, float]] = {}
    trainer = threading.Thread(target=_trainer, args=(out, port, [halved, own], plan, sent), daemon=True)
    trainer.start()
    chunks: list[float] = []

    async def run() -> tuple[dict, dict]:
        async with InferenceClient(server.url, config.model.name, request_timeout_s=300) as client:
            await client.wait_healthy(60)
            relay = WeightRelay(client, config)
            while not is_offered(out, 1):  # the trainer thread writes its offer when it gets there
                await asyncio.sleep(0.05)
            await relay.update(1)  # a new session: paused
            first = relay.take_metrics()
            _rpc(server.url, server.token, "take_fingerprints")  # the steps of version 2's update from here
            while not is_offered(out, 2):
                await asyncio.sleep(0.05)
            await _stream_across(relay, chunks)
            return first, relay.take_metrics()

    first, second = asyncio.run(run())
    trainer.join(timeout=60)
    steps = _rpc(server.url, server.token, "take_fingerprints")
    after = float(_rpc(server.url, server.token, "install_fingerprints"))  # now: version 2, the model's own
    assert first["weights/num_paused_updates"] == 1 and "weights/num_staged_updates" not in first

    # (a) tokens streamed while version 2 was being sent (PAUSE_S before each of its buckets)
    begin, end = sent[2]
    assert end - begin >= (len(plan) - 1) * PAUSE_S
    during = [t for t in chunks if begin <= t <= end]
    assert len(during) >= 20, f"{len(during)} chunks in the {end - begin:.1f} s staging window"
    # (b) no engine step saw its parameters change; steps of version 1 ran, then steps of version 2
    assert steps and all(b == e for b, e in steps), [s for s in steps if s[0] != s[1]][:5]
    served = [b for b, _ in steps]
    switch = next(i for i, fp in enumerate(served) if fp != served[0])
    assert served[0] != initial and set(served[:switch]) == {served[0]} and set(served[switch:]) == {initial}
    # (c) the swap loaded version 2, the model's own weights, bit for bit as vLLM first loaded them
    assert after == initial
    # (d) what the relay reports: the swap (vLLM not generating) and the staging (vLLM generating)
    assert second["weights/num_staged_updates"] == 1 and "weights/num_paused_updates" not in second
    assert 0 < second["timing/weight_pause_s"] == second["timing/weight_pause/swap_server_s"]
    assert second["timing/weight_stage_s"] >= (len(plan) - 1) * PAUSE_S
    assert second["timing/weight_pause_s"] < second["timing/weight_stage_s"]
    print(
        f"no-stall update: {len(during)} chunks streamed in the {end - begin:.2f} s staging window, {len(steps)} engine "
        f"steps, none mixed; swap {second['timing/weight_pause_s'] * 1e3:.1f} ms (vLLM not generating), stage "
        f"{second['timing/weight_stage_s']:.2f} s"
    )


def test_rl_with_no_stall_updates_passes_its_probe_checks(tiny_qwen3_dir, tmp_path, run_env, server):
    _, env = run_env
    out = tmp_path / "run"
    # synchronous (max_async_level = 0): batch 3 waits for version 2, so that update's metrics go into its record
    config = server.run_config(tiny_rl_config(tiny_qwen3_dir, out, max_steps=3, orchestrator={"max_async_level": 0}))
    config["weights"] = {"transport": "gloo", "master_port": free_port(), "bucket_mb": 1, "no_stall": True}
    config["weights"]["delta"] = {"enabled": True}  # staged in the workers' mirrors (the first test: plain buffers)
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "rl", "-c", str(write_config(tmp_path / "rl.toml", config))],
        env=server.env(env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-5000:]}\nstderr:\n{proc.stderr[-5000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # version 1 opens the transfer session (paused, declared); version 2 is staged and swapped in
    by_step: dict[int, dict] = {}
    for record in records:  # the orchestrator's and the trainer's records of a step, merged
        by_step.setdefault(record["step"], {}).update(record)
    assert by_step[2].get("weights/num_paused_updates") == 1 and "weights/num_staged_updates" not in by_step[2]
    assert by_step[3]["weights/num_staged_updates"] == 1 and by_step[3]["timing/weight_stage_s"] > 0, by_step[3]
    assert all("weights/delta_bytes_sent" in by_step[step] for step in (1, 2, 3)), by_step
    checks = [json.loads(line) for line in (out / "weight_checks.jsonl").read_text().splitlines() if line.strip()]
    updates = [c for c in checks if c["kind"] == "update"]
    assert [c["step"] for c in updates][-1] == 3 and all(c["passed"] for c in updates), updates
