"""The trainer's LM head on the CPU (forward + backward of `lm_head_logprobs`): keeping the float32 probabilities for
backward (`_CpuLMHead`, what `chunked_lm_head_logprobs` takes within CPU_SAVED_PROBS_BYTES) against recomputing the
logits in backward (`_FusedLMHead`, the path before it and the one beyond the budget), alternating, same operands.

    python benchmarks/cpu_lm_head.py                      # SmolLM2-135M's head (576 x 49,152), 1,000 loss tokens
    python benchmarks/cpu_lm_head.py --tokens 500 --threads 2

Prints each repeat's seconds, then `recompute_s: <median> keep_s: <median> speedup: <ratio>`, and checks that both
paths give the same log-probs and gradients.
"""

import argparse
import statistics
import time

import torch

from slipstream.trainer.lm_head import lm_head_logprobs


def operands(tokens: int, hidden: int, vocab: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(tokens, hidden, generator=g),
        torch.randn(vocab, hidden, generator=g) * 0.05,
        torch.randint(0, vocab, (tokens,), generator=g),
        torch.ones(tokens),
        torch.randn(tokens, generator=g),  # the loss's per-token factors
    )


def head_step(keep_probs: bool, hidden, weight, tokens, temperatures, factors) -> tuple[float, tuple]:
    """Seconds of one forward + backward, and (log-probs, hidden grad, weight grad)."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    start = time.perf_counter()
    logprobs, _ = lm_head_logprobs(h, w, None, tokens, temperatures, None, keep_probs)
    (logprobs * factors).sum().backward()
    return time.perf_counter() - start, (logprobs.detach(), h.grad, w.grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="loss tokens through the head")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the CPU demo's trainer uses 1)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = operands(args.tokens, args.hidden, args.vocab)
    head_step(False, *ops), head_step(True, *ops)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.repeats):
        for keep in (False, True):
            seconds, results = head_step(keep, *ops)
            times[keep].append(seconds)
            print(f"repeat {i}: {'keep' if keep else 'recompute'} {seconds:.4g} s", flush=True)
    _, recomputed = head_step(False, *ops)
    _, kept = head_step(True, *ops)
    for name, a, b in zip(("logprobs", "hidden grad", "weight grad"), recomputed, kept, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    recompute_s, keep_s = statistics.median(times[False]), statistics.median(times[True])
    # 4 significant digits, not 3 decimals: a tiny head's sub-millisecond median must not print as 0.000
    print(f"recompute_s: {recompute_s:.4g} keep_s: {keep_s:.4g} speedup: {recompute_s / keep_s:.3g}")


if __name__ == "__main__":
    main()
