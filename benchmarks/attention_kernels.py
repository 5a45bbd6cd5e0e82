"""Causal attention over packed samples (the trainer's packed rows): every GPU kernel that can run it, timed forward +
backward on the same inputs and checked against a float32 reference, to choose the packed-row path of
models/common/attention.py from measurements.

    python benchmarks/attention_kernels.py                                   # Qwen3-0.6B heads, 8 x 2048
    python benchmarks/attention_kernels.py --heads 32 --kv-heads 4           # Qwen3-30B-A3B heads
    python benchmarks/attention_kernels.py --lengths 5000,3000,2500,2000,1500,1200,700,484

Kernels (each where this torch and GPU have it; a kernel that fails is reported with its error, not dropped):
- `flash_varlen`: torch.nn.attention.varlen.varlen_attn (flash attention 2 over cu_seqlens, GQA native): the
  trainer's packed path until now;
- `cudnn_ragged`: cuDNN's fused attention over the same cu_seqlens (`aten._cudnn_attention_forward`, the op behind
  nested-tensor SDPA; autograd through its own backward), with grouped K/V heads as given, and `cudnn_ragged_rep`
  with K/V heads repeated to the query heads (the ragged path is only documented for equal head counts);
- `flex`: compiled flex_attention with a block mask of the samples (what torchtitan runs for documents);
- `cudnn_padded`: SDPA is_causal over one row per sample (the samples padded to the longest: exact only when all
  have the same length, which is the only case it runs).

Figures: milliseconds for forward + backward (median of `--iters` after warm-up, CUDA events), the attention
TFLOP/s that implies (forward 4 x sum(L^2) / 2 x H x K, backward 2.5 x forward), and the relative error norm of
the output and of dq/dk/dv against float32 SDPA run one sample at a time. Prints `best: <kernel>` last.
"""

import argparse
import inspect
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=16, help="query heads (H)")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads (G, divides H)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--lengths", default="2048x8", help="sample lengths: 'LxS' (S samples of L) or a comma-separated list"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if "x" in args.lengths:
        length, count = args.lengths.split("x")
        args.sample_lengths = [int(length)] * int(count)
    else:
        args.sample_lengths = [int(x) for x in args.lengths.split(",")]
    if args.heads % args.kv_heads or min(args.sample_lengths) < 1:
        parser.error("--kv-heads must divide --heads and every length must be >= 1")
    return args


def flash_varlen(q, k, v, cu, max_len):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def cudnn_ragged(q, k, v, cu, max_len):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)[0]


def cudnn_ragged_rep(q, k, v, cu, max_len):
    groups = q.shape[1] // k.shape[1]
    return cudnn_ragged(q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), cu, max_len)


def make_flex(cu: torch.Tensor, num_tokens: int) -> Callable:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    sample_N = torch.searchsorted(cu[1:], torch.arange(num_tokens, device=cu.device), right=True)

    def mask_mod(b, h, q_idx, kv_idx):
        return (sample_N[q_idx] == sample_N[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(mask_mod, None, None, num_tokens, num_tokens, device=cu.device)
    compiled = torch.compile(flex_attention)

    def flex(q, k, v, cu, max_len):
        o = compiled(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
                     enable_gqa=True)  # fmt: skip
        return o[0].transpose(0, 1)

    return flex


def make_padded(lengths: list[int]) -> Callable | None:
    if len(set(lengths)) != 1:
        return None
    S, L = len(lengths), lengths[0]

    def cudnn_padded(q, k, v, cu, max_len):
        def rows(t):
            return t.view(S, L, t.shape[1], t.shape[2]).transpose(1, 2)

        o = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(S * L, q.shape[1], q.shape[2])

    return cudnn_padded


def reference(q, k, v, lengths, grad_out):
    """(o, dq, dk, dv) in float32, one sample at a time (plain causal SDPA)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(
            q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1), is_causal=True, enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
        start += n
    o = torch.cat(outs)
    o.backward(grad_out.float())
    return o.detach(), q.grad, k.grad, v.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def run_kernel(fn, q, k, v, cu, max_len, grad_out, iters, warmup):
    """(ms per forward + backward, (o, dq, dk, dv) of the last run)."""
    qkv = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    times = []
    for i in range(warmup + iters):
        for t in qkv:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        o = fn(*qkv, cu, max_len)
        o.backward(grad_out)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times), (o.detach(), *(t.grad for t in qkv))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda")
    lengths, H, G, K = args.sample_lengths, args.heads, args.kv_heads, args.head_dim
    N = sum(lengths)
    g = torch.Generator(device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(N, h, K, device=device, generator=g, dtype=torch.bfloat16) for h in (H, G, G, H))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    max_len = max(lengths)
    want = reference(q, k, v, lengths, grad_out)
    flops = 4 * sum(n * n for n in lengths) / 2 * H * K * 3.5
    print(
        f"{torch.cuda.get_device_name(device)} | torch {torch.__version__} | {len(lengths)} samples, {N} tokens "
        f"(max {max_len}) | H {H}, G {G}, K {K} | bf16 | forward + backward",
        flush=True,
    )
    kernels: dict[str, Callable | None] = {
        "flash_varlen": flash_varlen,
        "cudnn_ragged": cudnn_ragged,
        "cudnn_ragged_rep": cudnn_ragged_rep if G != H else None,
        "flex": None,
        "cudnn_padded": make_padded(lengths),
    }
    try:
        kernels["flex"] = make_flex(cu, N)
    except Exception as e:  # reported, not hidden: the table says why flex has no figure
        print(f"{'flex':>17}: unavailable ({type(e).__name__}: {str(e)[:200]})", flush=True)
    best = None
    for name, fn in kernels.items():
        if fn is None:
            continue
        try:
            ms, got = run_kernel(fn, q, k, v, cu, max_len, grad_out, args.iters, args.warmup)
        except Exception as e:
            print(f"{name:>17}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
            continue
        errors = [rel(a, b) for a, b in zip(got, want, strict=True)]
        ok = max(errors) < 2e-2
        print(
            f"{name:>17}: {ms:7.3f} ms | {flops / ms / 1e9:6.0f} TFLOP/s | rel err o {errors[0]:.1e} "
            f"dq {errors[1]:.1e} dk {errors[2]:.1e} dv {errors[3]:.1e}{'' if ok else ' | WRONG (> 2e-2)'}",
            flush=True,
        )
        if ok and (best is None or ms < best[1]):
            best = (name, ms)
    print(f"best: {best[0] if best else 'none'}", flush=True)


if __name__ == "__main__":
    main()
