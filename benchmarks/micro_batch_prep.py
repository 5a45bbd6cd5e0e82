"""Host time to turn one micro-batch from the wire into validated tensors (trainer/data.py's `to_packed`) and its
parts, with torch's default intra-op thread count and with one thread: the GPU waits for this at a step's start.

    python benchmarks/micro_batch_prep.py [--tokens 16384] [--samples 8]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_throughput import fake_batch  # noqa: E402

from slipstream.trainer import data  # noqa: E402


def mean_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    batch, _ = fake_batch(args.tokens, args.samples, vocab_size=151_936)
    mb = batch.micro_batches[0]
    cpu = torch.device("cpu")
    default = torch.get_num_threads()
    print(f"# {args.tokens} tokens in {args.samples} samples, torch {torch.__version__}, {default} intra-op threads")
    for threads in dict.fromkeys((default, 1)):
        torch.set_num_threads(threads)
        packed = data.to_packed(mb, cpu)
        layout = mean_ms(lambda p=packed: data.build_padded_layout(p.position_ids_T), args.repeats)
        validate = mean_ms(lambda p=packed: data.validate_packed(p), args.repeats)
        print(f"threads {threads:3d}: layout {layout:.2f} ms, validation {validate:.2f} ms (parts, on these threads)")
    torch.set_num_threads(default)
    total = mean_ms(lambda: data.to_packed(mb, cpu), args.repeats)
    print(f"to_packed (runs on one thread itself): {total:.2f} ms")


if __name__ == "__main__":
    main()
