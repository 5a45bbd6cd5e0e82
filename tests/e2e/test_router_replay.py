"""Router replay end to end on CPU: the simulated server returns routed experts in vLLM's response format (base64
.npy per choice), the orchestrator carries them through the batch files, and the trainer (a tiny Qwen3-MoE, expert
parallel over 2 gloo ranks) routes every replayed token to inference's experts. The simulator routes at random, so
the trainer's own top-2 rarely agrees: agreement stays far below 1 while every routed token-layer is replayed."""

import itertools
import json
import subprocess
import sys

import msgspec
import numpy as np

from slipstream.transport.rollouts import TrainingBatch
from slipstream_sim.policy import sim_routing
from tests.e2e.helpers import free_port, running_sim, write_config

MAX_STEPS = 3
LAYERS, TOP_K, EXPERTS = 2, 2, 8  # the tiny qwen3_moe (models/tiny.py)


def test_router_replay_through_orchestrator_batches_and_an_ep2_trainer(tiny_model_factory, tmp_path):
    model_dir = tiny_model_factory("qwen3_moe")
    out, port = tmp_path / "run", free_port()
    sim_args = ["--vocab-size", "256", "--model-name", str(model_dir), "--default-max-tokens", "12", "--seed", "3"]
    sim_args += ["--routed-experts-layers", str(LAYERS), "--routed-experts-top-k", str(TOP_K)]
    sim_args += ["--routed-experts-num-experts", str(EXPERTS)]
    with running_sim(port, tmp_path / "sim.log", *sim_args):
        config = {
            "max_steps": MAX_STEPS,
            "output_dir": str(out),
            "seed": 7,
            "model": {"name": str(model_dir)},
            "deployment": {"run": ["trainer", "orchestrator"]},
            "weights": {"transport": "filesystem"},
            "orchestrator": {
                "inference_url": f"http://127.0.0.1:{port}",
                "batch_size": 8,
                "group_size": 4,
                "micro_batch_tokens": 512,
                "router_replay": True,
                "sampling": {"temperature": 1.0, "max_tokens": 12},
                "env": {"name": "reverse_text", "args": {"num_tasks": 64}},
                "weight_check": {"enabled": False},  # the simulator's log-probs are not the model's
            },
            "trainer": {"parallel": {"ep": 2}, "num_threads": 1, "optim": {"lr": 1e-3}},
            "launch": {"num_trainer_procs": 2, "health_timeout_s": 120, "shutdown_grace_s": 5},
            "checkpoint": {"interval": 1, "keep_last": 1},
        }
        cmd = [sys.executable, "-m", "slipstream", "rl", "-c", str(write_config(tmp_path / "rl.toml", config))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log"))) if out.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
    for m in metrics:
        # Every token but each sample's last carries routing for both layers; all of it is replayed.
        assert 0.8 < m["router/replayed_fraction"] < 1.0, m
        assert m["router/agreement"] < 0.5, m  # random routing vs the trainer's own: C(8,2) = 28 possible pairs

    # The batch files hold the simulator's routing for each sample, aligned with its tokens.
    batch_file = sorted((out / "rollouts").rglob("rank_*.msgpack"))[-1]
    batch = msgspec.msgpack.decode(batch_file.read_bytes(), type=TrainingBatch)
    mb = batch.micro_batches[0]
    assert mb.routing is not None and (mb.routing.num_layers, mb.routing.top_k, mb.routing.dtype) == (2, 2, "uint8")
    routing = np.frombuffer(mb.routing.data, dtype=np.uint8).reshape(len(mb.input_ids), LAYERS, TOP_K)
    starts = [i for i, p in enumerate(mb.position_ids) if p == 0] + [len(mb.input_ids)]
    for start, end in itertools.pairwise(starts):
        tokens = mb.input_ids[start:end]
        expected = sim_routing(tokens, LAYERS, TOP_K, EXPERTS, seed=3)
        assert np.array_equal(routing[start : end - 1], expected)
        assert (routing[end - 1] == 255).all()  # the last token was never forwarded: no routing
