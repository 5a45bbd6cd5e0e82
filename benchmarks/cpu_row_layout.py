"""CPU trainer step on an RL batch of many short samples: packed row (block-diagonal mask) vs one padded row per
sample (trainer/row_layout.py, what the trainer now picks on CPU), interleaved in one process so both see the same
machine load.

    python benchmarks/cpu_row_layout.py                        # SmolLM2-135M shape, 32 samples of 52 + 6 tokens
    python benchmarks/cpu_row_layout.py --prompt-len 52 --completion-len 30 --threads 2

Runs the trainer's own step (Policy, train_step, AdamW) in float32 with random weights. Prints seconds per step of
each layout (median over --steps alternating rounds) and last `speedup: <packed / padded>`.
"""

import argparse
import statistics
import time

import torch

from slipstream.config.trainer import LossConfig
from slipstream.models.registry import build_model
from slipstream.trainer import logprobs
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch

CPU = torch.device("cpu")


def smollm2_config():
    """SmolLM2-135M's shape (llama, 30 layers, width 576, vocab 49152, tied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        tie_word_embeddings=True,
    )


def rl_batch(num_samples: int, prompt_len: int, completion_len: int, vocab_size: int) -> TrainingBatch:
    g = torch.Generator().manual_seed(0)
    ids, pos, mask, adv, lq, temps = [], [], [], [], [], []
    for i in range(num_samples):
        n = prompt_len + completion_len
        ids += torch.randint(3, vocab_size, (n,), generator=g).tolist()
        pos += list(range(n))
        mask += [False] * prompt_len + [True] * completion_len
        adv += [0.0] * prompt_len + [(-1.0) ** i] * completion_len
        lq += [0.0] * prompt_len + [-1.0] * completion_len
        temps += [1.0] * n
    num_loss_tokens = num_samples * completion_len
    return TrainingBatch(
        step=1, rank=0, num_loss_tokens=num_loss_tokens, micro_batches=[MicroBatch(ids, pos, mask, adv, lq, temps)]
    )


def timed_step(policy, optimizer, batch, padded: bool) -> float:
    chooser = logprobs.use_padded_rows
    logprobs.use_padded_rows = lambda *args: padded
    try:
        start = time.perf_counter()
        train_step(policy, optimizer, batch, LossConfig(), 1.0, CPU, torch.float32)
        return time.perf_counter() - start
    finally:
        logprobs.use_padded_rows = chooser


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=52)
    parser.add_argument("--completion-len", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured rounds (each: one step of each layout)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = smollm2_config()
    policy = Policy(build_model(cfg, "custom").float())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    batch = rl_batch(args.num_samples, args.prompt_len, args.completion_len, cfg.vocab_size)
    num_tokens = len(batch.micro_batches[0].input_ids)
    timed_step(policy, optimizer, batch, True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.steps):
        for padded in (False, True):
            times[padded].append(timed_step(policy, optimizer, batch, padded))
    packed_s, padded_s = statistics.median(times[False]), statistics.median(times[True])
    print(f"{num_tokens} tokens ({args.num_samples} samples), {args.threads} thread(s)")
    print(f"packed row : {packed_s:.2f} s/step ({num_tokens / packed_s:.0f} tokens/s)")
    print(f"padded rows: {padded_s:.2f} s/step ({num_tokens / padded_s:.0f} tokens/s)")
    print(f"speedup: {packed_s / padded_s:.2f}")


if __name__ == "__main__":
    main()
