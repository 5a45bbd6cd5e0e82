"""The RL loop measured on 2 GPUs with real vLLM: `slipstream rl` (vLLM on GPU 0, the trainer on GPU 1, NCCL weight
updates) on reverse-text at prime-rl's shape (128 rollouts of at most 128 tokens a step), figures from the run's own
metrics.jsonl; and the generation baseline: the same requests sent to Slipstream's vLLM server (plugin, middleware,
flags) and to a bare vLLM server of the same model and engine flags.

    python benchmarks/gpu_loop.py --model DIR --name smollm2 --steps 20 --async-levels 1 0 --baseline
    python benchmarks/gpu_loop.py --model DIR --name smollm2 --steps 10 --async-levels 0 --colocate   # 1 GPU

`--colocate` runs vLLM and the trainer on GPU 0 (`--gpu`) taking turns (deployment.colocate; vLLM sleeps at
`--sleep-level` while the trainer steps, weights through CUDA IPC) and adds the turns' medians (`colocate_ms`: draining requests,
sleeping, waking, the trainer's turn) and the memory each process held at its peak (nvidia-smi, sampled).

Per run it prints the medians over the steps after the first two (warm-up: CUDA graphs, first updates):
- `gen_tok_s`: completion tokens of the step's batch over the time the orchestrator spent generating it;
- `pause_ms`: the time vLLM held in-flight requests for a weight update (pause to resume), per update, as the
  orchestrator sees it; `engine_paused_ms`: the same as vLLM's server sees it (from /pause's arrival to /resume's
  reply), the time vLLM did not generate: the pause less the way to the server and /pause's wait in the server's
  event loop, while vLLM's engine still generated;
- `update_ms`: the whole update seen by the orchestrator (calibration, pause, load, probe check);
- `send_gbps`: the trainer's weight send (bytes over `weights/send_s`, which leaves out `accept_wait_s`, the time the
  trainer waited for the orchestrator to take the version, and `receiver_wait_ms`, the wait for vLLM's workers to be
  about to receive); `wire_gbps`: over the sends alone (`weights/wire_s`), and per update (`wire_gbps_each`, with
  `receiver_wait_ms_each`); `receives_ms`: each version as vLLM's worker received it, from its log (`seconds`, its
  set-up before the mark `marked_s`, and `host_s`, from the mark until its host had queued the last loads: close to
  the receive's time after the mark when the worker's host sets the pace);
- with `--no-stall` the pause is the swap alone (`pause_phases_ms`' `swap`: the server's handled time of
  /finish_weight_update, which includes the wait for the engine step in progress, generating), and `stage` the
  transfer vLLM generated through; `engine_swap_ms` is the engine's own swap (median, max and count over every staged
  version, warm-up included), from vLLM's log: the time from /finish_weight_update's start in the worker until the
  staged weights are live on the GPU, the time vLLM did not generate;
- with `--delta` each version after the first goes as the elements that changed (weights.delta over NCCL):
  `delta_ratio` per version (bytes on the wire over a full send's), `changed_fraction`, and the buckets a receiver's
  checksum sent back for a full resend (`delta_resent_buckets`; every bucket loaded is checked against the checksum of
  the full new bytes);
- `pause_phases_ms`: where the pause went, per vLLM admin call (`timing/weight_pause/<call>_s`; `<call>_server`: the
  server's own part of it);
- `loop_lag_max_ms`: the orchestrator's event loop, its worst lateness in a step (utils/loop_lag.py);
- `train_tok_s`: the trainer's tokens/s (loss, backward, optimizer step), of the packed tokens (a group's prompt
  once); `train_model_tok_s`: of the tokens its model ran (on CUDA each sample with its own prompt: compare this one
  with `trainer_throughput.py` on samples of the same length);
- `steps_per_hour`: from the median interval between steps' records;
- the weight checks: how many passed, the floor and the worst margin.
The baseline prints `tokens_per_s` of both servers (best of 3 waves of the same 128 requests, every request forced to
its full length with `min_tokens`) and their ratio. Records go to OUT/<name>.json.
"""

import argparse
import ast
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import tomli_w

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def rl_config(model: str, out: Path, steps: int, async_level: int, args: argparse.Namespace) -> dict:
    inference = {"max_model_len": 1024, "max_num_seqs": 256, "enforce_eager": args.eager, "port": args.port}
    if args.router_replay:  # MoE: the trainer takes the experts vLLM routed each token to (returned with completions)
        inference["enable_return_routed_experts"] = True
    if args.gpu_memory_utilization is not None:
        inference["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.stream_interval > 1:
        inference["stream_interval"] = args.stream_interval
    return {
        "max_steps": steps,
        "output_dir": str(out),
        "seed": 0,
        "model": {"name": model, "dtype": "bfloat16", "head_dtype": args.head_dtype},
        "deployment": (
            {"gpus": [args.gpu], "colocate": True, "sleep_level": args.sleep_level}
            if args.colocate
            else {"gpus": args.gpus}
        ),
        "inference": inference,
        "orchestrator": {
            "batch_size": args.batch_size,
            "group_size": args.group_size,
            "max_async_level": async_level,
            "micro_batch_tokens": args.micro_batch_tokens,
            "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
            "env": {"name": "reverse_text", "args": {"num_tasks": 4000, "min_words": 2, "max_words": 20}},
            "router_replay": args.router_replay,
            "weight_check": {"max_floor": args.max_floor},
        },
        "trainer": {
            "optim": {"lr": args.lr, "max_grad_norm": 1.0, "state_dtype": args.state_dtype},
            "compile": args.compile,
            "packed_attention": args.packed_attention,
            "profile_steps": args.profile_steps,
        },
        "checkpoint": {"interval": 0},  # a measurement: no checkpoint at the last step (12 bytes per parameter)
        **weights_config(args),
        "launch": {"health_timeout_s": 900},
    }


def weights_config(args: argparse.Namespace) -> dict:
    """`[weights]` for --no-stall, --delta and --receive-buffers (over nccl); {} for the default transport."""
    weights: dict = {}
    if args.receive_buffers is not None:
        weights["receive_buffers"] = args.receive_buffers
    if args.no_stall:
        weights["no_stall"] = True
    if args.delta:
        weights["delta"] = {"enabled": True}
    return {"weights": {"transport": "nccl"} | weights} if weights else {}


def run_loop(model: str, out: Path, steps: int, async_level: int, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rl.toml"
    path.write_text(tomli_w.dumps(rl_config(model, out / "run", steps, async_level, args)))
    start = time.perf_counter()
    with GpuMemorySampler() as memory:
        proc = subprocess.run(
            [sys.executable, "-m", "slipstream", "rl", "-c", str(path)], capture_output=True, text=True
        )
    wall = time.perf_counter() - start
    (out / "launcher.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"slipstream rl failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return summarize(out / "run", wall) | {"gpu_peak_gib": memory.peaks()}


class GpuMemorySampler:
    """Samples nvidia-smi's per-process GPU memory every 0.5 s in a thread; `peaks()`: each process's largest, named
    by its role (vLLM's engine, the trainer, ...) from its command line."""

    def __init__(self) -> None:
        self.peak: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        """Each pid's role, read while it runs (its /proc entry is gone once the run ends)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GpuMemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.splitlines():
                pid, _, mib = line.partition(",")
                if pid.strip().isdigit() and mib.strip().isdigit():
                    self.peak[int(pid)] = max(self.peak.get(int(pid), 0.0), int(mib) / 1024)
                    if int(pid) not in self.roles:
                        self.roles[int(pid)] = _role(int(pid))

    def peaks(self) -> dict[str, float]:
        named: dict[str, float] = {}
        for pid, gib in self.peak.items():
            role = self.roles.get(pid) or _role(pid)
            named[role] = max(named.get(role, 0.0), round(gib, 2))
        return named


def _role(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"pid {pid} (gone)"
    for needle, role in (("trainer", "trainer"), ("inference", "vllm"), ("VLLM", "vllm"), ("vllm", "vllm")):
        if needle in cmd:
            return role
    return f"pid {pid}"


def _median(records: list[dict], key: str, scale: float = 1.0) -> float | None:
    values = [r[key] * scale for r in records if isinstance(r.get(key), int | float)]
    return statistics.median(values) if values else None


SWAP_LINE = re.compile(r"swapped in version \d+ in ([0-9.]+) s")
"""The engine's log line for a staged version's swap (weights/receive/engine.py finish_weight_update)."""


def engine_swaps(run: Path) -> dict | None:
    """The engines' own swap times (ms) from the run's vLLM logs: median, max and count; None without a swap."""
    values = [
        float(m.group(1)) * 1e3
        for log in sorted((run / "logs").glob("inference*.log"))
        for m in SWAP_LINE.finditer(log.read_text(errors="replace"))
    ]
    if not values:
        return None
    return {"median": statistics.median(values), "max": max(values), "n": len(values)}


RECEIVE_LINE = re.compile(r"slipstream weight transfer: (?:staged )?(\{.*\})\s*$", re.MULTILINE)
"""The worker's log line for a version received (weights/receive/engine.py: the ReceiveStats of weights/receive/
receiver.py, a dict's repr)."""


def receives(run: Path) -> list[dict]:
    """Each broadcast version the run's vLLM workers received, in log order: step, `seconds` (the whole receive, the
    GPU's wait included), `marked_s` (the worker's set-up before its mark) and `host_s` (from the mark until its host
    had queued the last bucket's loads; `load_s`, the part of it in the loader's calls), in ms."""
    found = []
    for log in sorted((run / "logs").glob("inference*.log")):
        for m in RECEIVE_LINE.finditer(log.read_text(errors="replace")):
            try:
                stats = ast.literal_eval(m.group(1))
            except (ValueError, SyntaxError):
                continue
            if isinstance(stats, dict) and "host_s" in stats:
                keys = [k for k in ("seconds", "marked_s", "host_s", "load_s") if k in stats]
                found.append({"step": stats["step"]} | {k: stats[k] * 1e3 for k in keys})
    return found


def summarize(run: Path, wall: float) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = metrics[2:] or metrics
    updates = [m for m in steady if m.get("weights/num_updates")]
    gen = [
        {"rate": m["batch/completion_tokens"] / m["timing/generate_s"]}
        for m in steady
        if m.get("timing/generate_s", 0) > 0 and "batch/completion_tokens" in m
    ]
    times = [m["time"] for m in metrics]
    intervals = [b - a for a, b in zip(times[2:], times[3:], strict=False)] or [wall / max(len(metrics), 1)]
    checks = [json.loads(line) for line in (run / "weight_checks.jsonl").read_text().splitlines()]
    loads = [c for c in checks if c.get("kind") == "update"]
    floor = next((c["max_abs_diff"] for c in checks if c.get("kind") == "calibration"), None)
    per_update = [{k: m[k] / m["weights/num_updates"] for k in m if k.startswith("timing/weight")} for m in updates]
    phases = sorted({k for u in per_update for k in u if k.startswith("timing/weight_pause/")})
    return {
        "steps": len(metrics),
        "wall_s": round(wall, 1),
        "gen_tok_s": _median(gen, "rate"),
        "pause_ms": _median(per_update, "timing/weight_pause_s", 1e3),
        "engine_paused_ms": _median(per_update, "timing/weight_pause/engine_paused_s", 1e3),
        "update_ms": _median(per_update, "timing/weight_update_s", 1e3),
        "send_s": _median(steady, "weights/send_s"),
        "send_gbps": _median(steady, "weights/send_gbps"),
        "wire_gbps": _median(steady, "weights/wire_gbps"),
        "wire_gbps_each": [m.get("weights/wire_gbps") for m in steady if "weights/wire_gbps" in m],
        "receiver_wait_ms_each": [m["weights/receiver_wait_s"] * 1e3 for m in steady if "weights/receiver_wait_s" in m],
        "receives_ms": receives(run),
        "accept_wait_s": _median(steady, "weights/accept_wait_s"),
        "receiver_wait_ms": _median(steady, "weights/receiver_wait_s", 1e3),
        "pause_phases_ms": {k.split("/")[-1][:-2]: _median(per_update, k, 1e3) for k in phases},
        "engine_swap_ms": engine_swaps(run),
        "loop_lag_max_ms": _median(steady, "orchestrator/loop_lag_max_ms"),
        "weight_bytes": steady[-1].get("weights/bytes"),
        "delta_ratio": [m.get("weights/delta_ratio") for m in metrics if "weights/delta_ratio" in m],
        "changed_fraction": [m.get("weights/changed_fraction") for m in metrics if "weights/changed_fraction" in m],
        "delta_resent_buckets": sum(m.get("weights/delta_resent_buckets", 0) for m in metrics),
        "train_tok_s": _median(steady, "tokens_per_s"),
        "train_model_tok_s": _median(steady, "model_tokens_per_s"),
        "steps_per_hour": 3600.0 / statistics.median(intervals),
        "mismatch_kl_step1": metrics[0].get("mismatch_kl"),
        "mismatch_kl_median": _median(metrics, "mismatch_kl"),
        "reward_first": metrics[0].get("reward/mean"),
        "reward_last": metrics[-1].get("reward/mean"),
        "colocate_ms": {
            k.split("/")[-1][:-2]: _median(steady, k, 1e3)
            for k in ("colocate/drain_s", "colocate/sleep_s", "colocate/wake_s", "colocate/trainer_turn_s")
            if any(k in m for m in steady)
        },
        "trainer_peak_reserved_gib": _median(steady, "memory/peak_reserved_gib"),
        "checks_passed": f"{sum(c['passed'] for c in loads)}/{len(loads)}",
        "floor": floor,
        "min_margin": min((c["margin"] for c in loads), default=None),
    }


def bare_argv(argv: list[str]) -> list[str]:
    """Slipstream's vLLM command line without what Slipstream adds (weight-transfer backend, middleware)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--weight-transfer-config", "--middleware"):
            skip = True
            continue
        out.append(arg)
    return out


async def wave(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    body = {"model": model, "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 1.0, "logprobs": 0}
    body |= {"return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        replies = await asyncio.gather(*(client.post("/v1/completions", json=body | {"prompt": p}) for p in prompts))
        seconds = time.perf_counter() - start
    tokens = sum(r.json()["usage"]["completion_tokens"] for r in replies)
    return tokens, seconds


def serve_and_measure(argv: list[str], env: dict, url: str, model: str, prompts: list[list[int]], args) -> float:
    log = open(args.out / f"server_{len(argv)}.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None:
                raise SystemExit(f"vLLM exited: see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("vLLM never became healthy")
            time.sleep(1)
        asyncio.run(wave(url, model, prompts[:8], 8))  # warm-up
        best = max(t / s for t, s in (asyncio.run(wave(url, model, prompts, args.max_tokens)) for _ in range(3)))
        return best
    finally:
        os.killpg(server.pid, 15)
        server.wait(60)
        log.close()


def baseline(model: str, args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from slipstream.config.inference import InferenceConfig
    from slipstream.config.shared import ModelConfig
    from slipstream.envs.reverse_text import ReverseTextEnv
    from slipstream.inference.server import build_vllm_argv, build_vllm_env
    from slipstream.utils.net import free_port

    tokenizer = AutoTokenizer.from_pretrained(model)
    tasks = ReverseTextEnv(num_tasks=args.batch_size, min_words=2, max_words=20).tasks("train")
    prompts = [tokenizer.apply_chat_template(t.prompt, add_generation_prompt=True, tokenize=True) for t in tasks]
    prompts = [list(p["input_ids"] if isinstance(p, dict) else p) for p in prompts]
    port = free_port()
    config = InferenceConfig(
        model=ModelConfig(name=model, dtype="bfloat16"), port=port, max_model_len=1024, max_num_seqs=256,
        enforce_eager=False, device="cuda", stream_interval=args.stream_interval,
    )  # fmt: skip
    env = build_vllm_env(config) | {"CUDA_VISIBLE_DEVICES": "0", "SLIPSTREAM_ADMIN_TOKEN": "benchmark"}
    argv = build_vllm_argv(config, Path(model))
    url = f"http://127.0.0.1:{port}"
    rates = {
        "slipstream": serve_and_measure(argv, env, url, model, prompts, args),
        "bare": serve_and_measure(bare_argv(argv), env, url, model, prompts, args),
    }
    return rates | {"ratio": rates["slipstream"] / rates["bare"], "requests": len(prompts)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a Hugging Face model folder")
    p.add_argument("--name", default="model")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--async-levels", type=int, nargs="*", default=[1])
    p.add_argument("--baseline", action="store_true", help="also measure generation on Slipstream's and bare vLLM")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--router-replay", action="store_true", help="MoE: train on the experts vLLM routed to")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, help="vLLM's share of GPU 0")
    p.add_argument("--stream-interval", type=int, default=1, help="inference.stream_interval (tokens per chunk)")
    p.add_argument("--colocate", action="store_true", help="vLLM and the trainer share GPU 0, taking turns")
    p.add_argument("--sleep-level", type=int, default=1, choices=(0, 1, 2), help="deployment.sleep_level")
    p.add_argument("--max-floor", type=float, default=1.0, help="orchestrator.weight_check.max_floor")
    p.add_argument("--gpu", type=int, default=0, help="--colocate: the GPU (its index on the node)")
    p.add_argument(
        "--gpus",
        type=int,
        nargs=2,
        default=[0, 1],
        help="vLLM's GPU and the trainer's (two runs on one node need four)",
    )
    p.add_argument("--compile", action="store_true", help="trainer.compile (torch.compile each block)")
    p.add_argument(
        "--packed-attention",
        choices=("varlen", "flex"),
        default="varlen",
        help="trainer.packed_attention: flex keeps each group's prompt shared (a prefix tree); varlen runs it per sample",
    )
    p.add_argument(
        "--no-stall",
        action="store_true",
        help="weights.no_stall over nccl: versions staged while vLLM generates, swapped in between two engine steps",
    )
    p.add_argument(
        "--receive-buffers",
        type=int,
        default=None,
        help="weights.receive_buffers over nccl: bucket buffers per vLLM worker (its receives posted that far ahead)",
    )
    p.add_argument(
        "--delta",
        action="store_true",
        help="weights.delta over nccl: each version sent as the elements that changed (or whole, when smaller)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        nargs="*",
        default=[],
        help="trainer.profile_steps: these steps' training under torch.profiler (OUT/<name>_async<N>/run/profiles/)",
    )
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=16384,
        help="orchestrator.micro_batch_tokens (above a step's ~17.4k tokens: one micro-batch, as trainer_throughput.py)",
    )
    p.add_argument(
        "--state-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="trainer.optim.state_dtype (AdamW's moments; bfloat16 for the 8-layer 30B-A3B shape on one GPU)",
    )
    p.add_argument("--port", type=int, default=8000, help="vLLM's port (two runs on one node need two)")
    p.add_argument(
        "--head-dtype", default="float32", choices=("model", "float32"), help="model.head_dtype (the logits' dtype)"
    )
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (vLLM starts sooner; for correctness runs)")
    p.add_argument("--out", type=Path, default=Path("outputs/gpu_loop"))
    return p


def main() -> None:
    args = build_parser().parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"model": args.name}
    if args.baseline:
        results["generation"] = baseline(args.model, args)
        print(f"{args.name} generation: {json.dumps(results['generation'])}", flush=True)
    for level in args.async_levels:
        where = f"{args.name}_async{level}" + (f"_colocated{args.sleep_level}" if args.colocate else "")
        results[f"async_{level}"] = run_loop(args.model, args.out / where, args.steps, level, args)
        print(f"{args.name} max_async_level={level}: {json.dumps(results[f'async_{level}'])}", flush=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
