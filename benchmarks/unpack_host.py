"""Host time of `weights.wire.stream.unpack` (the receiving side's views of a bucket, on every version: the vLLM engine,
the simulated server and the transfer benchmark run it) for one MoE layer's experts in Hugging Face names (128
experts x gate/up/down of the Qwen3-30B-A3B shape: 384 tensors). No data moves: the figure is per-tensor host work.

    python benchmarks/unpack_host.py [--experts 128] [--calls 100] [--repeats 5]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from slipstream.weights.wire.stream import Bucket, TensorMeta, unpack  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    shapes = {"gate_proj": (768, 2048), "up_proj": (768, 2048), "down_proj": (2048, 768)}
    metas = tuple(
        TensorMeta(f"model.layers.0.mlp.experts.{e}.{p}.weight", "bfloat16", shape)
        for e in range(args.experts)
        for p, shape in shapes.items()
    )
    bucket = Bucket("bfloat16", metas)
    flat = torch.empty(bucket.nbytes, dtype=torch.uint8)
    for _ in range(args.calls // 2):
        unpack(flat, bucket)
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.calls):
            unpack(flat, bucket)
        best = min(best, (time.perf_counter() - start) / args.calls)
    print(f"unpack of {len(metas)} tensors: {best * 1e3:.3f} ms ({best * 1e6 / len(metas):.2f} us per tensor)")


if __name__ == "__main__":
    main()
