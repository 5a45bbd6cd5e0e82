"""The receivers' layout copy (two senders' pieces of a bucket -> its tensors laid out whole, uint8 segments) and
their loads (bf16 views -> one parameter per tensor), on one GPU: `_foreach_copy_` against `torch.cat(out=)` and a
copy per large segment, next to one contiguous copy of the same bytes (the bar). Buckets: Qwen3-0.6B's largest
(the embedding and 60 MLP/attention tensors), a middle one, and a Qwen3-30B-A3B expert bucket.

    python benchmarks/layout_copy.py        # needs 1 GPU; best of 20 after a warm-up (CUDA events), host time too
"""

import sys
import time

import torch

MB = 1 << 20
BUCKETS = {
    "qwen3-0.6b largest": [3072 * 1024 * 2] * 60 + [151936 * 1024 * 2],
    "qwen3-0.6b middle": [3072 * 1024 * 2] * 30 + [1024 * 2] * 10 + [128 * 2] * 4 + [1024 * 1024 * 2] * 8,
    "qwen3-30b-a3b experts": [768 * 2048 * 2] * 170,
}
"""Tensor sizes in bytes."""
LARGE = 8 * MB


def timed(fn, repeats: int = 20) -> tuple[float, float]:
    """(best GPU ms, best host ms) of `fn`."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return min(gpu), min(host)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 1
    dev = torch.device("cuda", 0)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for label, sizes in BUCKETS.items():
        total = sum(sizes)
        wire = torch.empty(total, dtype=torch.uint8, device=dev)
        whole = torch.empty_like(wire)
        halves = [(n // 2, n - n // 2) for n in sizes]
        segments = [h for pair in halves for h in pair]  # the whole layout: tensor after tensor, sender within it
        on_wire = list(wire.split([pair[q] for q in (0, 1) for pair in halves]))  # sender 0's piece, then sender 1's
        dsts = list(whole.split(segments))
        srcs = [on_wire[q * len(sizes) + j] for j in range(len(sizes)) for q in (0, 1)]  # in the whole order
        large = [i for i, n in enumerate(segments) if n >= LARGE]
        small = [i for i, n in enumerate(segments) if n < LARGE]

        def per_large(dsts=dsts, srcs=srcs, large=large, small=small):
            if small:
                torch._foreach_copy_([dsts[i] for i in small], [srcs[i] for i in small])
            for i in large:
                dsts[i].copy_(srcs[i])

        params = [torch.empty(n // 2, dtype=torch.bfloat16, device=dev) for n in sizes]
        views = list(whole.view(torch.bfloat16).split([n // 2 for n in sizes]))
        print(f"-- {label}: {total / MB:.0f} MiB, {len(segments)} segments")
        for name, fn in (
            ("layout: _foreach_copy_", lambda d=dsts, s=srcs: torch._foreach_copy_(d, s)),
            ("layout: torch.cat(out=)", lambda s=srcs, w=whole: torch.cat(s, out=w)),
            ("layout: copy_ per large", per_large),
            ("one contiguous copy_", lambda w=whole, s=wire: w.copy_(s)),
            ("loads: _foreach_copy_", lambda p=params, v=views: torch._foreach_copy_(p, v)),
        ):
            ms, host = timed(fn)
            print(f"{name:24s} {ms:.3f} ms {total / ms / 1e6:6.0f} GB/s copied, host {host:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
