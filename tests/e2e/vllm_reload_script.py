"""Run by tests/e2e/test_weight_buckets_vllm.py in a process of its own: the real vLLM CPU engine (in-process, one
worker) takes three versions of a model's weights by broadcast from a sender thread, through vLLM's weight-transfer
API and Slipstream's engine, in buckets small enough that vLLM's layers straddle them: the model's weights halved,
the model's own, halved again. Prints one JSON line: the prompt log-probs before and after each version, what
the engine made of its copy plan (weights/receive/copy_plan.py), and each version's seconds (start to finish).

With `--unpacked`, vLLM's linear and embedding layers keep their weights as they were loaded (vLLM's own unpacked
CPU path, `cpu_linear = F.linear`, which MLA's kv_b_proj takes) instead of repacking them for oneDNN: that is what
these layers do on the GPU build, where their post-load processing does nothing, so the copy plan applies.

With `--replan`, the third version comes in buckets twice as large: the copy plan no longer fits its first bucket,
and the engine loads it through vLLM's loaders again (and records a new plan); a fourth version, the model's own
weights in those buckets, follows.

With `--senders 2`, two sender threads (two FSDP ranks in small) each broadcast their own rows of every tensor on
their own lane (weights/wire/pieces.py), uneven splits included.

With `--moved`, vLLM gives one parameter new memory before the third version (as a reload from disk or sleep mode
may): the copy plan no longer fits, which the engine finds at that version's first bucket, before copying anything;
it loads the version through vLLM's loaders and records a new plan, which a fourth version (the model's own weights)
replays.

    python vllm_reload_script.py MODEL_DIR PORT BUCKET_BYTES [--unpacked] [--replan] [--moved] [--senders 2]
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process: collective_rpc is a call
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from slipstream.weights.wire.collective import GroupInit, open_group, open_store  # noqa: E402
from slipstream.weights.wire.stream import (  # noqa: E402
    Bucket,
    Manifest,
    TensorMeta,
    broadcast,
    plan_buckets,
    start_pieces,
)

PROMPT = list(range(5, 60))


def keep_weights_unpacked() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    def plain(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    UnquantizedLinearMethod.process_weights_after_loading = plain
    UnquantizedEmbeddingMethod.process_weights_after_loading = plain


def plan_state(worker) -> dict:
    loads = worker.weight_transfer_engine.loads
    return {
        "copies": loads.plan.num_copies if loads.plan else None,
        "refused": loads.refused,
        "replays": loads.replays,
        "wire_calls": loads.wire_calls,
    }


def move_a_parameter(worker) -> str:
    """The worker's first parameter gets new memory with the same values; returns its name."""
    name, param = next(iter(worker.weight_transfer_engine.model.named_parameters()))
    param.data = param.data.clone()
    return name


def split_rows(manifest: Manifest) -> Manifest:
    """The same buckets sent by two ranks: sender 0 holds the first third of each tensor's rows (rounded up)."""
    buckets = []
    for b in manifest.buckets:
        rows = []
        for t in b.tensors:
            n = t.shape[0] if t.shape else 1
            rows.append((-(-n // 3), n - -(-n // 3)))
        buckets.append(Bucket(b.dtype, b.tensors, tuple(rows)))
    return Manifest(manifest.step, tuple(buckets), senders=2)


def send_rows(lanes, rank: int, plan: Manifest, tensors: dict[str, torch.Tensor]) -> None:
    for bucket in plan.buckets:
        wire = torch.empty(bucket.nbytes, dtype=torch.uint8)
        for meta, (offset, nbytes), split in zip(bucket.tensors, bucket.layout.own[rank], bucket.rows, strict=True):
            t = tensors[meta.name]
            rows = t.reshape(t.shape[0] if t.dim() else 1, -1)[sum(split[:rank]) : sum(split[: rank + 1])]
            wire[offset : offset + nbytes] = rows.reshape(-1).view(torch.uint8)
        for work in start_pieces(lanes, wire, bucket.layout):
            work.wait()


def main(
    model_dir: str, port: int, bucket_bytes: int, unpacked: bool, replan: bool, senders: int, moved: bool = False
) -> None:
    from vllm import LLM, SamplingParams

    if unpacked:
        keep_weights_unpacked()

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update({n: t.float() for n, t in load_file(shard).items()})
    halved = {n: t * 0.5 for n, t in weights.items()}
    versions = [halved, weights, halved]
    metas = [TensorMeta.of(n, t) for n, t in weights.items()]
    manifest = Manifest(1, tuple(plan_buckets(metas, bucket_bytes)))
    manifests = [manifest, manifest, manifest]
    if replan:
        larger = Manifest(1, tuple(plan_buckets(metas, bucket_bytes * 2)))
        versions, manifests = [*versions, weights], [manifest, manifest, larger, larger]
    elif moved:
        versions, manifests = [*versions, weights], [manifest] * 4
    if senders == 2:
        manifests = [split_rows(m) for m in manifests]
    init = GroupInit(
        "gloo", "127.0.0.1", port, "reload", world_size=1 + senders, rank_offset=senders, timeout_s=300, senders=senders
    )

    def send(rank: int = 0) -> None:
        store = open_store(init.master_addr, init.master_port, is_master=rank == 0, timeout_s=init.timeout_s)
        group = open_group(store, init, rank, torch.device("cpu"))
        for tensors, plan in zip(versions, manifests, strict=True):
            if senders == 2:
                send_rows(group, rank, plan, tensors)
                continue
            for bucket in plan.buckets:
                flat = torch.cat([tensors[t.name].reshape(-1).view(torch.uint8) for t in bucket.tensors])
                broadcast(group, flat)

    llm = LLM(
        model_dir,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        weight_transfer_config={"backend": "slipstream"},
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)

    def logprobs() -> list[float]:
        out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
        return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]

    before = logprobs()
    threads = [threading.Thread(target=send, args=(rank,), daemon=True) for rank in range(senders)]
    for thread in threads:
        thread.start()
    llm.collective_rpc("init_weight_transfer_engine", args=(init.to_dict(),))
    after, plans, seconds = [], [], []
    for k, plan in enumerate(manifests):
        if moved and k == 2:
            llm.collective_rpc(move_a_parameter)
        start = time.perf_counter()
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", args=({"step": 1, "manifest": plan.to_dict()},))
        llm.collective_rpc("finish_weight_update")
        seconds.append(time.perf_counter() - start)
        after.append(logprobs())
        plans.append(llm.collective_rpc(plan_state)[0])
    llm.collective_rpc("shutdown_weight_transfer_engine")
    for thread in threads:
        thread.join(timeout=60)
    result = {"buckets": len(manifest.buckets), "before": before, "after": after, "plans": plans, "seconds": seconds}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    flags = sys.argv[4:]
    senders = int(flags[flags.index("--senders") + 1]) if "--senders" in flags else 1
    main(
        sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--unpacked" in flags, "--replan" in flags, senders,
        "--moved" in flags,
    )  # fmt: skip
