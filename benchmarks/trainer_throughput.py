"""Throughput of the trainer's RL step (loss + backward + optimizer step) on fake packed data with random weights.

    python benchmarks/trainer_throughput.py --model qwen3-0.6b --seq-len 16384 --impl custom --compare-hf
    python benchmarks/trainer_throughput.py --model tiny --device cpu --seq-len 512 --compare-hf
    python benchmarks/trainer_throughput.py --model qwen3-30b-a3b-4l --compare-hf \
        --compare-anchor $HF_MOE_ANCHOR
    python benchmarks/trainer_throughput.py --model qwen3-30b-a3b-8l --state-dtype bfloat16
    python benchmarks/trainer_throughput.py --model qwen3.5-moe-cut --seq-len 8192 --compare-hf
    python benchmarks/trainer_throughput.py --model tiny-qwen3.5-moe --device cpu --seq-len 256 --compare-hf
    python benchmarks/trainer_throughput.py --lm-head-memory --head-tokens 65536

Runs the trainer's own code (Policy, train_step, fused AdamW on float32 masters, bf16 autocast on GPUs) on one
device. Prints tokens/s, MFU and peak memory per implementation, and last `tokens_per_s: <x> mfu: <y>` for
`--impl` (plus `vs_hf: <ratio>` with --compare-hf). MFU uses the usual FLOPs/token: 6 x active matmul
parameters + 12 x layers x heads x head_dim x context, where context is the attended length per token (the mean
sample length weighted by tokens, as packed samples never attend to each other), over the dense bf16 peak of an
H100/H200 SXM (989e12 FLOP/s); n/a on CPU. For the MoE shapes (Qwen3-30B-A3B cut to 4 or 8 layers, every layer
MoE: 128 experts, top-8) the active MLP parameters are the top-8 experts' plus the router. GLM-5 (`glm5-cut`) and
Qwen3.5-MoE (`qwen3.5-moe-cut`, `tiny-qwen3.5-moe`) count their own layers: `dsa_matmul_params`, and
`qwen35_moe_matmul_params` + `gated_delta_rule_flops` (Gated DeltaNet layers: their projections and a sequence cost
linear in context; gated full-attention layers: the quadratic term above, over the full-attention layers only). The
shapes and this accounting live in throughput_shapes.py.

MoE options: `--expert-loop` runs our experts one by one (the reference) instead of the default grouped GEMMs;
`--state-dtype bfloat16` keeps AdamW's moments in bf16 (trainer/optim.py): the 8-layer cut's float32 masters,
gradients and float32 moments alone take 83.6 GiB, more than one H100. `--compare-anchor PATH` also runs the
plain-transformers pure-bf16 anchor script (e.g. $HF_MOE_ANCHOR: bf16 weights and
optimizer states, transformers' grouped_mm experts; MoE shapes on CUDA only) in its own process and prints
`vs_hf_pure_bf16: <ratio>`; with `--num-samples N` > 1 pass benchmarks/moe_anchor_rows.py instead (the anchor's
step on N batch rows, one sample each).

`--impl custom` runs with torch.compile per block on CUDA (`--no-compile` to disable); the `hf` baseline is always
plain transformers (sdpa attention, eager), with the same activation checkpointing, trainer LM head and optimizer,
and with --compare-hf it runs first, in its own process.
`--lm-head-memory` instead measures the peak memory of the trainer's fused LM head (forward + backward) against
the unfused one (full [tokens, V] logits) at `--head-tokens` x vocab 151,936 (`measure_lm_head_memory`).
"""

import argparse
import gc
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.config.trainer import LossConfig, ParallelConfig
from slipstream.models.common.attention import build_attention_layout
from slipstream.models.common.moe import find_grouped_experts
from slipstream.models.registry import build_model, export_hf_state_dict
from slipstream.parallel.dist import init_distributed, rank_device, read_rank_info
from slipstream.parallel.fsdp import parallelize_model
from slipstream.parallel.mesh import build_mesh, resolve_parallel_dims
from slipstream.trainer.logprobs import DEFAULT_CHUNK_SIZE, chunked_lm_head_logprobs
from slipstream.trainer.optim import AdamWBf16Moments
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, whatever the working directory
from throughput_shapes import (  # noqa: E402
    DSA_MODELS,
    MODELS,
    MOE_MODELS,
    PEAK_FLOPS,
    QWEN35_MOE_MODELS,
    build_hf_config,
    flops_per_token,
)

PROMPT_FRACTION = 0.2
"""Share of each fake sample that is prompt (no loss)."""


def varied_lengths(seq_len: int, num_samples: int, seed: int) -> list[int]:
    """Sample lengths of one RL-like micro-batch: `num_samples` samples of random lengths (each at least 1/4 of an
    even share) filling between 3/4 of `seq_len` and all of it, different for every seed."""
    g = torch.Generator().manual_seed(10_000 + seed)
    total = int(seq_len * (0.75 + 0.25 * torch.rand((), generator=g).item()))
    weights = 0.25 + torch.rand(num_samples, generator=g)
    lengths = [max(1, int(total * w / weights.sum())) for w in weights.tolist()]
    lengths[-1] += total - sum(lengths)
    return lengths


def fake_batch(
    seq_len: int, num_samples: int, vocab_size: int, seed: int = 0, lengths: list[int] | None = None
) -> tuple[TrainingBatch, float]:
    """One micro-batch of `seq_len` tokens packing `num_samples` samples of equal length (or of `lengths`, whose sum
    is then the micro-batch's length); returns it and the attended context."""
    g = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = [seq_len // num_samples] * num_samples
        lengths[-1] += seq_len - sum(lengths)
    seq_len = sum(lengths)
    ids, pos, mask = torch.randint(0, vocab_size, (seq_len,), generator=g).tolist(), [], []
    for n in lengths:
        num_prompt = max(1, int(PROMPT_FRACTION * n))
        pos += list(range(n))
        mask += [False] * num_prompt + [True] * (n - num_prompt)
    sign = (torch.randint(0, 2, (seq_len,), generator=g) * 2 - 1).tolist()
    lq = (-torch.rand(seq_len, generator=g) * 3).tolist()
    mb = MicroBatch(
        input_ids=ids,
        position_ids=pos,
        loss_mask=mask,
        advantages=[float(s) if m else 0.0 for s, m in zip(sign, mask, strict=True)],
        inference_logprobs=[x if m else 0.0 for x, m in zip(lq, mask, strict=True)],
        temperatures=[1.0] * seq_len,
    )
    context = sum(n * n for n in lengths) / seq_len
    return TrainingBatch(step=1, rank=0, num_loss_tokens=sum(mask), micro_batches=[mb]), context


def build_random_model(cfg, impl: str, device: torch.device, hf_experts: str = "grouped_mm") -> torch.nn.Module:
    """A float32 model of `impl` on `device` with the same random weights for both impls (ours, seed 0); a
    transformers MoE runs its experts with `hf_experts` (transformers' `experts_implementation`)."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = build_model(cfg, "custom").float()
    if impl == "custom":
        return ours
    with torch.device(device):
        model = build_hf_model(cfg, hf_experts).float()
    missing, unexpected = model.load_state_dict(fuse_experts(export_hf_state_dict(ours), model), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()):
        raise RuntimeError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    return model


def build_hf_model(cfg, hf_experts: str = "grouped_mm") -> torch.nn.Module:
    """transformers' model for `cfg` as the baseline runs it (SDPA attention, MoE experts by `hf_experts`), on the
    current default device (`with torch.device("meta"):` checks a config without allocating it)."""
    cfg._attn_implementation = "sdpa"  # the transformers baseline: SDPA attention
    if getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None):
        cfg._experts_implementation = hf_experts  # transformers' own choice of MoE kernel
    return build_model(cfg, "hf")


def fuse_experts(hf_sd: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert MoE weights (`mlp.experts.{e}.{gate,up,down}_proj.weight`) stacked into the
    fused layout transformers 5 holds in memory (`gate_up_proj` [E, 2F, D] gate rows first, `down_proj` [E, D, F])
    where `model` has it; other keys unchanged."""
    fused_prefixes = [k.removesuffix("gate_up_proj") for k in model.state_dict() if k.endswith("experts.gate_up_proj")]
    for prefix in fused_prefixes:
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys = sorted((k for k in hf_sd if k.startswith(prefix) and k.endswith(f".{proj}.weight")),
                          key=lambda k: int(k.removeprefix(prefix).split(".")[0]))  # fmt: skip
            stacked[proj] = torch.stack([hf_sd.pop(k) for k in keys])
        hf_sd[prefix + "gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        hf_sd[prefix + "down_proj"] = stacked["down_proj"]
    return hf_sd


@dataclass
class Result:
    impl: str
    tokens_per_s: float
    mfu: float | None
    peak_memory_gib: float
    step_s: float


def run_impl(args: argparse.Namespace, impl: str, device: torch.device) -> Result:
    """Build a fresh random model of `impl`, run warmup + measured steps, return the figures."""
    cfg = build_hf_config(args.model)
    model = build_random_model(cfg, impl, device, args.hf_experts)
    compile = args.compile and impl == "custom"
    if args.expert_loop and impl == "custom" and hasattr(model, "set_grouped_mm"):
        model.set_grouped_mm(False)
    if impl == "custom":
        model.packed_attention = args.packed_attention
    parallel = ParallelConfig(
        ep=args.ep, activation_checkpointing=args.ac, activation_checkpointing_keep_attention=args.keep_attention
    )
    mesh = None
    if args.world_size > 1:  # torchrun: FSDP over every rank, the experts sharded over `--ep` of them
        mesh = build_mesh(resolve_parallel_dims(parallel, args.world_size), device.type)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    experts = find_grouped_experts(model) if impl == "custom" else []
    head_dtype = torch.float32 if args.head_dtype == "float32" else None  # model.head_dtype
    policy = parallelize_model(
        Policy(model, head_dtype=head_dtype), mesh, parallel, compute_dtype, compile=compile, experts=experts
    )
    if args.state_dtype == "bfloat16":
        optimizer = AdamWBf16Moments(policy.parameters(), lr=1e-6)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True if device.type == "cuda" else None)
    if args.vary_lengths:  # a new packing every step, warm-up included: lengths never seen before are measured
        batches = [
            fake_batch(0, 0, cfg.vocab_size, args.rank, varied_lengths(args.seq_len, args.num_samples, s))
            for s in range(args.warmup + args.steps)
        ]
    else:
        batches = [fake_batch(args.seq_len, args.num_samples, cfg.vocab_size, seed=args.rank)]
    # Under FSDP the parameters arrive in bf16 already (its mixed-precision policy), as in the trainer's setup.
    autocast_dtype = torch.float32 if mesh is not None and device.type == "cuda" else compute_dtype
    step_s, metrics = time_steps(
        policy, optimizer, [b for b, _ in batches], device, autocast_dtype, args.warmup, args.steps
    )
    if args.profile is not None and impl == args.impl:
        # every rank runs the step (its collectives), rank 0 writes the profile
        profile_step(policy, optimizer, batches[-1][0], device, compute_dtype, args.profile if args.rank == 0 else None)
    measured = batches[-args.steps :] if args.vary_lengths else batches
    tokens = sum(len(b.micro_batches[0].input_ids) for b, _ in measured) / len(measured)
    context = sum(c * len(b.micro_batches[0].input_ids) for b, c in measured) / (tokens * len(measured))
    tokens_per_s = tokens / step_s
    mfu = flops_per_token(cfg, context) * tokens_per_s / PEAK_FLOPS if device.type == "cuda" else None
    peak = _peak_memory_gib(device)
    per_gpu = f" per GPU ({args.world_size} ranks, ep {args.ep})" if args.world_size > 1 else ""
    _print0(
        args,
        f"{impl:>6}: {tokens_per_s:,.0f} tokens/s{per_gpu} | MFU {_fmt_mfu(mfu)} | peak memory {peak:.2f} GiB | "
        f"{step_s:.3f} s/step | loss {metrics['loss']:.4f}",
    )
    del policy, model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Result(impl, tokens_per_s, mfu, peak, step_s)


def _print0(args: argparse.Namespace, line: str) -> None:
    if args.rank == 0:
        print(line, flush=True)


def time_steps(policy, optimizer, batches, device, compute_dtype, num_warmup: int, num_steps: int):
    """(seconds per measured step, metrics of the last step); peak GPU memory is reset after the warmup. `batches`:
    one TrainingBatch for every step, or a list that step i takes entry i of (cycling)."""
    batches = batches if isinstance(batches, list) else [batches]
    for i in range(num_warmup):
        train_step(policy, optimizer, batches[i % len(batches)], LossConfig(), 1.0, device, compute_dtype)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for i in range(num_warmup, num_warmup + num_steps):
        metrics = train_step(policy, optimizer, batches[i % len(batches)], LossConfig(), 1.0, device, compute_dtype)
    _sync(device)
    return (time.perf_counter() - start) / num_steps, metrics


def profile_step(policy, optimizer, batch, device, compute_dtype, path: Path | None) -> None:
    """Two more steps under torch.profiler (the second shows the GPU's idle time between steps); writes their
    operators sorted by self device time (the kernels that take the steps) to `path`, and the same trace as Chrome
    JSON next to it (`path` + .json)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        for _ in range(2):
            train_step(policy, optimizer, batch, LossConfig(), 1.0, device, compute_dtype)
        _sync(device)
    if path is None:
        return
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=45, max_name_column_width=90)
    path.write_text(table)
    prof.export_chrome_trace(str(path) + ".json")
    print(f"profile of two steps: {path}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_gib(device: torch.device) -> float:
    """Peak allocated GPU memory of the measured steps; on CPU the process's peak resident set size so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _fmt_mfu(mfu: float | None) -> str:
    return "n/a" if mfu is None else f"{100 * mfu:.1f}%"


HEAD_VOCAB, HEAD_DIM = 151936, 1024
"""Qwen3-0.6B's LM head shape for --lm-head-memory."""


def unfused_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N):
    """The head without chunking or fusion, same maths: full [N, V] logits and a float32 log-softmax."""
    logits_NV = F.linear(hidden_ND, weight_VD)
    logp_NV = F.log_softmax(logits_NV.float() / temperatures_N.unsqueeze(-1), dim=-1)
    logprobs_N = logp_NV.gather(-1, token_ids_N.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return logprobs_N, entropy_N


def fused_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N):
    """The trainer's head (trainer/logprobs.py + trainer/lm_head.py) at its default chunk size."""
    return chunked_lm_head_logprobs(weight_VD, hidden_ND, token_ids_N, temperatures_N, DEFAULT_CHUNK_SIZE)


def head_peak_gib(head, num_tokens: int, device: torch.device) -> float | None:
    """Peak GPU memory of head's forward + backward above its inputs (float32 W [V, D] and hidden [N, D], as the
    trainer holds them), in GiB; gradients of W and hidden included. None when it runs out of memory."""
    g = torch.Generator(device).manual_seed(0)
    weight_VD = (torch.randn(HEAD_VOCAB, HEAD_DIM, device=device, generator=g) * 0.02).requires_grad_()
    hidden_ND = torch.randn(num_tokens, HEAD_DIM, device=device, generator=g).requires_grad_()
    token_ids_N = torch.randint(0, HEAD_VOCAB, (num_tokens,), device=device, generator=g)
    temperatures_N = torch.rand(num_tokens, device=device, generator=g) + 0.5
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logprobs_N, _ = head(weight_VD, hidden_ND, token_ids_N, temperatures_N)
        logprobs_N.sum().backward()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2**30
    except torch.OutOfMemoryError:
        return None
    finally:
        del weight_VD, hidden_ND
        gc.collect()
        torch.cuda.empty_cache()


def measure_lm_head_memory(device: torch.device, num_tokens: int) -> dict[str, float | str | None]:
    """Fused vs unfused peak at num_tokens. When the unfused head does not fit, its peak is extrapolated linearly
    from num_tokens / 8 and / 4 (the unfused peak is affine in tokens: every [N, V] tensor scales with N)."""
    head_peak_gib(fused_lm_head_logprobs, num_tokens, device)  # compiles the fused kernels first
    fused = head_peak_gib(fused_lm_head_logprobs, num_tokens, device)
    unfused = head_peak_gib(unfused_lm_head_logprobs, num_tokens, device)
    figures: dict[str, float | str | None] = {"fused_gib": round(fused, 2)}
    if unfused is not None:
        figures |= {"unfused_gib": round(unfused, 2), "unfused_source": "measured"}
    else:
        small, large = num_tokens // 8, num_tokens // 4
        peak_small, peak_large = (head_peak_gib(unfused_lm_head_logprobs, n, device) for n in (small, large))
        unfused = peak_large + (peak_large - peak_small) / (large - small) * (num_tokens - large)
        figures |= {
            "unfused_gib": round(unfused, 2),
            "unfused_source": f"out of memory; extrapolated from {small}: {peak_small:.2f} and {large}: {peak_large:.2f}",
        }
    figures["fused_over_unfused"] = round(fused / unfused, 4)
    return figures


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=MODELS)
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per micro-batch (one per step)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples packed into the micro-batch")
    parser.add_argument("--impl", default="custom", choices=["custom", "hf"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing")
    parser.add_argument(
        "--keep-attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --ac, keep attention outputs instead of recomputing them (trainer.parallel."
        "activation_checkpointing_keep_attention); --no-keep-attention = full recomputation",
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="under torchrun (several ranks, one GPU each): expert parallelism over this many ranks, FSDP over all; "
        "figures are per GPU, each rank training its own micro-batch",
    )
    parser.add_argument(
        "--packed-attention",
        default="varlen",
        choices=["varlen", "flex"],
        help="kernel for packed rows of --impl custom (trainer.packed_attention; flex: GPUs only)",
    )
    parser.add_argument(
        "--head-dtype", default="float32", choices=["model", "float32"], help="model.head_dtype: the logits' dtype"
    )
    parser.add_argument("--compare-hf", action="store_true", help="also run --impl hf and print the ratio")
    parser.add_argument(
        "--compare-anchor",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run the pure-bf16 transformers MoE anchor script at PATH (CUDA, MoE shapes) and print the ratio",
    )
    parser.add_argument("--expert-loop", action="store_true", help="MoE: loop over experts instead of grouped GEMMs")
    parser.add_argument(
        "--hf-experts",
        default="grouped_mm",
        choices=["eager", "grouped_mm", "batched_mm"],
        help="MoE: transformers' experts implementation for --impl hf",
    )
    parser.add_argument(
        "--state-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of AdamW's moments (trainer.optim.state_dtype); float32 masters either way",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each block of --impl custom (default: on CUDA only); never the hf baseline",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="PATH",
        help="after timing, profile two more steps of --impl and write their top operators to PATH (+ PATH.json trace)",
    )
    parser.add_argument(
        "--compare-torchtitan",
        type=Path,
        default=None,
        metavar="PATH",
        help="also run torchtitan's trainer through the anchor driver at PATH (tt_bench.py: the same dense shape, "
        "seq and documents per row) and print the ratio",
    )
    parser.add_argument(
        "--rows",
        default="auto",
        choices=["auto", "packed"],
        help="custom dense models, several samples: 'auto' lets the trainer choose between the packed row and one "
        "padded row per sample (trainer/row_layout.py: padded where no fused varlen kernel runs, e.g. on CPU); "
        "'packed' keeps the packed row",
    )
    parser.add_argument(
        "--vary-lengths",
        action="store_true",
        help="a new packing every step, as RL micro-batches have: --num-samples samples of random lengths filling "
        "3/4 to all of --seq-len (warm-up steps included, so measured steps see lengths never seen before); "
        "tokens/s counts the measured steps' tokens. The baselines (--compare-*) run their fixed shapes: no ratio",
    )
    parser.add_argument("--lm-head-memory", action="store_true", help="measure the LM head's memory instead")
    parser.add_argument("--head-tokens", type=int, default=65536, help="tokens for --lm-head-memory")
    args = parser.parse_args(argv)
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU; use --device cpu (with --model tiny)")
    if args.steps < 1 or args.num_samples < 1 or args.seq_len < 2 * args.num_samples:
        parser.error("need --steps >= 1, --num-samples >= 1 and --seq-len >= 2 x --num-samples")
    if args.vary_lengths and (args.compare_hf or args.compare_anchor or args.compare_torchtitan):
        parser.error("--vary-lengths measures Slipstream alone: the baselines run fixed shapes, drop --compare-*")
    if args.compare_anchor is not None and (args.model not in MOE_MODELS or args.device != "cuda"):
        parser.error(
            f"--compare-anchor runs the MoE anchor on CUDA: use --device cuda and --model {' or '.join(MOE_MODELS)}"
        )
    if args.compare_torchtitan is not None and (args.model != "qwen3-0.6b" or args.device != "cuda"):
        parser.error("--compare-torchtitan runs torchtitan's Qwen3 0.6B flavor on CUDA: use --model qwen3-0.6b")
    if args.compare_torchtitan is not None and not args.compare_torchtitan.is_file():
        parser.error(f"--compare-torchtitan {args.compare_torchtitan}: no such file")
    if args.compare_anchor is not None and not args.compare_anchor.is_file():
        parser.error(f"--compare-anchor {args.compare_anchor}: no such file")
    if args.compare_anchor is not None and args.num_samples > 1 and args.compare_anchor.name != "moe_anchor_rows.py":
        parser.error(
            "--compare-anchor with --num-samples > 1: the shared anchor runs one sequence; pass "
            "benchmarks/moe_anchor_rows.py (the same step on one batch row per sample)"
        )
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = read_rank_info()
    args.rank, args.world_size = info.rank, info.world_size
    device = rank_device(args.device, info)
    if info.world_size > 1 and (args.compare_hf or args.compare_anchor or args.compare_torchtitan):
        raise SystemExit("under torchrun only our trainer runs: drop --compare-* (run them on one GPU)")
    if info.world_size == 1 and args.ep > 1:
        raise SystemExit(f"--ep {args.ep} needs torchrun with a multiple of {args.ep} ranks")
    owns_group = init_distributed(info, device)
    try:
        _main(args, device)
    finally:
        if owns_group:
            torch.distributed.destroy_process_group()


def _main(args: argparse.Namespace, device: torch.device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if args.lm_head_memory:
        figures = measure_lm_head_memory(device, args.head_tokens)
        print(f"LM head, {args.head_tokens} tokens x vocab {HEAD_VOCAB} | {name} | bf16 autocast | forward + backward")
        print(f"peak above inputs: {figures}", flush=True)
        return
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    position_ids = torch.tensor(fake_batch(args.seq_len, args.num_samples, 2)[0].micro_batches[0].position_ids)
    attention = build_attention_layout(position_ids[None].to(device), compute_dtype).backend
    if args.packed_attention == "flex" and args.num_samples > 1:
        attention = "flex"  # the layout names the default kernel; the model's packed_attention overrides it
    is_moe = args.model == "tiny-moe" or args.model in (*MOE_MODELS, *DSA_MODELS, *QWEN35_MOE_MODELS)
    ac_mode = (" (keeps attention)" if args.keep_attention else " (full)") if args.ac else ""
    experts = f", experts {'loop' if args.expert_loop else 'grouped_mm'}" if is_moe else ""
    _print0(
        args,
        f"{args.model} | seq {args.seq_len} in {args.num_samples} sample(s) | {name} | torch {torch.__version__} | "
        f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'} | activation checkpointing {args.ac}{ac_mode} | "
        f"custom: attention {attention}, compile {args.compile}{experts} | AdamW moments {args.state_dtype}",
    )
    anchor = run_anchor_in_subprocess(args) if args.compare_anchor is not None else None
    titan = run_torchtitan_in_subprocess(args) if args.compare_torchtitan is not None else None
    baseline = run_baseline_in_subprocess(args) if args.compare_hf and args.impl != "hf" else None
    row_choices = record_row_choices(args.rows)
    result = run_impl(args, args.impl, device)
    if row_choices:
        _print0(args, f"rows: {'padded, one per sample' if all(row_choices) else 'packed'} ({len(row_choices)} calls)")
    line = f"tokens_per_s: {result.tokens_per_s:.1f} mfu: {_fmt_mfu(result.mfu)}"
    if baseline is not None:
        tokens_per_s, report = baseline
        print(report, flush=True)
        line += f" vs_hf: {result.tokens_per_s / tokens_per_s:.3f}"
    if anchor is not None:
        tokens_per_s, report = anchor
        print(f"anchor: {report}", flush=True)
        line += f" vs_hf_pure_bf16: {result.tokens_per_s / tokens_per_s:.3f}"
    if titan is not None:
        tokens_per_s, report = titan
        print(f"torchtitan: {report}", flush=True)
        line += f" vs_torchtitan: {result.tokens_per_s / tokens_per_s:.3f}"
    _print0(args, line)


def record_row_choices(rows: str) -> list[bool]:
    """The trainer's row-layout decisions (True: padded rows) of this run, in a list filled as it runs; with
    `rows = "packed"` every decision is the packed row."""
    from slipstream.trainer import logprobs

    choices: list[bool] = []
    choose = getattr(logprobs.use_padded_rows, "__wrapped__", logprobs.use_padded_rows)  # not a wrapper's wrapper

    def recorded(*args) -> bool:
        choices.append(rows == "auto" and choose(*args))
        return choices[-1]

    recorded.__wrapped__ = choose
    logprobs.use_padded_rows = recorded
    return choices


def run_anchor_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(tokens/s, its report line) of the pure-bf16 transformers anchor (`SEQ LAYERS grouped_mm`: its own random
    single-sample batch, full activation checkpointing, fused bf16 AdamW), run first in a fresh process."""
    cmd = [sys.executable, str(args.compare_anchor), str(args.seq_len), str(MOE_MODELS[args.model]), "grouped_mm"]
    if args.num_samples > 1:  # moe_anchor_rows.py: one batch row per sample
        cmd.append(str(args.num_samples))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if "tokens_per_s=" in line]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the anchor failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    tokens_per_s = float(lines[-1].split("tokens_per_s=")[1].split()[0])
    return tokens_per_s, lines[-1]


TITAN_STEPS, TITAN_MEASURED = 16, 10
"""torchtitan steps run, and how many of the last ones are averaged (its first steps compile and warm up)."""


def run_torchtitan_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(mean tokens/s of torchtitan's last TITAN_MEASURED steps, a report line): torchtitan's own Trainer on its
    Qwen3 0.6B flavor through the anchor driver, one GPU, with `--seq-len` tokens per row in `--num-samples`
    documents, full activation checkpointing and compile (the driver's settings), in a fresh process first."""
    import os
    import re
    import tempfile

    with tempfile.TemporaryDirectory() as dump:
        env = dict(os.environ, TT_SEQ=str(args.seq_len), TT_DOCS=str(args.num_samples), TT_STEPS=str(TITAN_STEPS))
        env |= {"TT_LOSS": "plain", "TT_CUDAGRAPHS": "0", "TT_DUMP": dump}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
        proc = subprocess.run([*cmd, str(args.compare_torchtitan)], capture_output=True, text=True, env=env)
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    rows = re.findall(r"step:\s*(\d+)\s+loss:.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%", text)
    if proc.returncode != 0 or len(rows) < TITAN_MEASURED:
        raise RuntimeError(f"torchtitan failed ({proc.returncode}, {len(rows)} steps logged):\n{text[-4000:]}")
    tail = rows[-TITAN_MEASURED:]
    tokens_per_s = sum(float(r[2].replace(",", "")) for r in tail) / len(tail)
    mfu = sum(float(r[3]) for r in tail) / len(tail)
    report = (
        f"{tokens_per_s:,.0f} tokens/s (mean of steps {tail[0][0]}-{tail[-1][0]}), its MFU {mfu:.1f}%, "
        f"reserved {tail[-1][1]} GiB"
    )
    return tokens_per_s, report


def run_baseline_in_subprocess(args: argparse.Namespace) -> tuple[float, str]:
    """(tokens/s, its report line) of `--impl hf` with the same settings, run first and in a fresh process: one run
    in a process slowed the next there (seen on an H100: hf at 18.1k tokens/s after our model, 23.2k alone)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--impl", "hf", "--model", args.model]
    cmd += ["--seq-len", str(args.seq_len), "--num-samples", str(args.num_samples), "--device", args.device]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--ac" if args.ac else "--no-ac"]
    cmd += ["--keep-attention" if args.keep_attention else "--no-keep-attention"]
    cmd += ["--state-dtype", args.state_dtype, "--hf-experts", args.hf_experts]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("tokens_per_s: "):
        raise RuntimeError(f"the hf baseline failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    report = next(line for line in lines if line.lstrip().startswith("hf:"))
    return float(lines[-1].split()[1]), report


if __name__ == "__main__":
    main()
