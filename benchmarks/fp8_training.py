"""FP8 block-scaled training (trainer.fp8, models/common/fp8.py) against the bf16 trainer, in one process: RL-step
tokens/s, and mismatch KL of each against an FP8 block-quantized inference reference with the same weights.

    python benchmarks/fp8_training.py --model qwen3-0.6b --seq-len 16384
    python benchmarks/fp8_training.py --model qwen3-30b-a3b-8l --seq-len 8192 --state-dtype bfloat16
    python benchmarks/fp8_training.py --model tiny-moe --device cpu --seq-len 256   # smoke run of the script

Needs an SM90 GPU (H100/H200) and a CUDA >= 12.9 build of torch for the FP8 path (anything else raises, as the
trainer does); `--device cpu` runs the tiny shapes only, where the FP8 trainer is the reference itself (KL 0).

Mismatch KL: exact KL(reference || trainer) per token over the whole vocabulary, averaged over the batch's tokens
(the expectation of the trainer's `mismatch_kl` metric, exp(r) - r - 1 with r = trainer - inference log-prob, when
tokens are sampled from inference). The reference is the same random weights run like an FP8 block-quantized
inference engine (DeepSeek-V3 / vLLM block FP8: weights in 128x128 blocks, activations in dynamic 1x128 tiles,
everything else in bf16): the FP8 model with its GEMMs computed by `block_matmul_reference` (dequantize, float32
matmul) instead of cuBLAS, so it shares the quantization but not the kernels with the FP8 trainer. The trainers
run their training forward (bf16 autocast over float32 masters). Random weights give near-uniform distributions,
so absolute KLs are small; the ratio is the figure. Throughput: the trainer's RL step (benchmarks/
trainer_throughput.py's fake packed batch, train_step, AdamW) for bf16 then FP8, each on a fresh model.
"""

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from slipstream.config.trainer import ParallelConfig
from slipstream.models.common import fp8
from slipstream.models.registry import build_model
from slipstream.parallel.fsdp import parallelize_model
from slipstream.trainer.optim import AdamWBf16Moments
from slipstream.trainer.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling script, whatever the working directory
from throughput_shapes import MODELS, build_hf_config  # noqa: E402
from trainer_throughput import fake_batch, time_steps  # noqa: E402

KL_CHUNK = 1024
"""Tokens per chunk of the full-vocabulary KL (bounds the [tokens, V] float32 logits)."""


def build_random_model(cfg, device: torch.device, use_fp8: bool) -> torch.nn.Module:
    """Our float32 model with the seed-0 random weights (the same for every call), FP8 layers swapped in or not."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(cfg, "custom").float()
    if use_fp8:
        fp8.apply_fp8(model, device)
    return model


def _reference_gemm(q_NI, scale_NB, q_OI, scale_BB, out_dtype):
    return fp8.block_matmul_reference(q_NI, scale_NB, q_OI, scale_BB).to(out_dtype)


@torch.no_grad()
def hidden_states(model, input_ids_T, position_ids_T, device, reference: bool = False) -> torch.Tensor:
    """h_TD of one packed row under bf16 autocast (float32 on CPU); `reference` runs the FP8 GEMMs by the
    dequantize-then-float32 reference (the inference stand-in) instead of the trainer's kernels."""
    original = fp8.scaled_block_matmul
    if reference:
        fp8.scaled_block_matmul = _reference_gemm
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            return model.forward_hidden(input_ids_T[None], position_ids_T[None])[0]
    finally:
        fp8.scaled_block_matmul = original


@torch.no_grad()
def mean_kl(head_VD: torch.Tensor, h_ref_TD: torch.Tensor, h_TD: torch.Tensor) -> float:
    """Mean over tokens of KL(softmax(ref logits) || softmax(logits)), float32 logits, in chunks of tokens."""
    total = 0.0
    for start in range(0, h_TD.shape[0], KL_CHUNK):
        chunk = slice(start, start + KL_CHUNK)
        logp_ref = (h_ref_TD[chunk].float() @ head_VD.float().T).log_softmax(-1)
        logp = (h_TD[chunk].float() @ head_VD.float().T).log_softmax(-1)
        total += (logp_ref.exp() * (logp_ref - logp)).sum().item()
    return total / h_TD.shape[0]


def measure_kl(cfg, args, device) -> dict[str, float]:
    """Mismatch KL of the bf16 and FP8 trainers' forwards against the FP8 inference reference (one model)."""
    batch, _ = fake_batch(args.seq_len, args.num_samples, cfg.vocab_size)
    mb = batch.micro_batches[0]
    input_ids_T = torch.tensor(mb.input_ids, device=device)
    position_ids_T = torch.tensor(mb.position_ids, device=device)
    model = build_random_model(cfg, device, use_fp8=False)
    h_bf16 = hidden_states(model, input_ids_T, position_ids_T, device)
    fp8.apply_fp8(model, device)
    h_fp8 = hidden_states(model, input_ids_T, position_ids_T, device)
    h_ref = hidden_states(model, input_ids_T, position_ids_T, device, reference=True)
    kl = {"bf16": mean_kl(model.lm_head_weight, h_ref, h_bf16), "fp8": mean_kl(model.lm_head_weight, h_ref, h_fp8)}
    del model, h_bf16, h_fp8, h_ref
    _free(device)
    return kl


def measure_throughput(cfg, args, device, use_fp8: bool) -> tuple[float, float]:
    """(tokens/s, peak GiB) of the trainer's RL step on a fresh model."""
    model = build_random_model(cfg, device, use_fp8)
    compile = args.compile and device.type == "cuda"
    policy = parallelize_model(Policy(model), None, ParallelConfig(activation_checkpointing=args.ac), compile=compile)
    if args.state_dtype == "bfloat16":
        optimizer = AdamWBf16Moments(policy.parameters(), lr=1e-6)
    else:
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=True if device.type == "cuda" else None)
    batch, _ = fake_batch(args.seq_len, args.num_samples, cfg.vocab_size)
    compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    step_s, _ = time_steps(policy, optimizer, batch, device, compute_dtype, args.warmup, args.steps)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    del policy, model, optimizer
    _free(device)
    return args.seq_len / step_s, peak


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=MODELS)
    parser.add_argument("--seq-len", type=int, default=16384, help="tokens per micro-batch (one per step)")
    parser.add_argument("--num-samples", type=int, default=1, help="samples packed into the micro-batch")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=5, help="measured steps")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    parser.add_argument("--ac", action=argparse.BooleanOptionalAction, default=True, help="activation checkpointing")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True, help="per block, CUDA only")
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16"], help="AdamW moments")
    parser.add_argument("--skip-throughput", action="store_true", help="measure the mismatch KL only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU; the FP8 path needs an SM90 GPU (--device cpu: tiny only)")
    if args.device == "cpu" and not args.model.startswith("tiny"):
        parser.error("--device cpu runs the tiny shapes only (tiny, tiny-moe): the FP8 reference is float32 maths")
    if args.steps < 1 or args.num_samples < 1 or args.seq_len < 2 * args.num_samples:
        parser.error("need --steps >= 1, --num-samples >= 1 and --seq-len >= 2 x --num-samples")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    fp8.check_fp8_support(device)  # an unsupported GPU fails here, before any heavy work
    cfg = build_hf_config(args.model)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{args.model} | seq {args.seq_len} in {args.num_samples} sample(s) | {name} | torch {torch.__version__}")
    start = time.perf_counter()
    kl = measure_kl(cfg, args, device)
    print(f"mismatch KL vs FP8 inference reference: bf16 trainer {kl['bf16']:.3e} | fp8 trainer {kl['fp8']:.3e}")
    line = f"kl_bf16: {kl['bf16']:.3e} kl_fp8: {kl['fp8']:.3e} kl_ratio: {kl['fp8'] / max(kl['bf16'], 1e-30):.3f}"
    if not args.skip_throughput:
        results = {p: measure_throughput(cfg, args, device, use_fp8=p == "fp8") for p in ("bf16", "fp8")}
        for precision, (tokens_per_s, peak) in results.items():
            print(f"{precision:>5}: {tokens_per_s:,.0f} tokens/s | peak memory {peak:.2f} GiB", flush=True)
        line += f" tokens_per_s_bf16: {results['bf16'][0]:.1f} tokens_per_s_fp8: {results['fp8'][0]:.1f}"
        line += f" speedup: {results['fp8'][0] / results['bf16'][0]:.3f}"
    print(f"({time.perf_counter() - start:.0f} s)")
    print(line, flush=True)


if __name__ == "__main__":
    main()
