"""CPU trainer step on the reverse_text demo's batch: every sample with its own copy of the prompt (one by one,
orchestrator.shared_prefix = false, the path before) vs each GRPO group as one prefix tree (the prompt computed once,
models/common/prefix_tree.py), interleaved in one process so both see the same machine load.

    python benchmarks/cpu_shared_prefix.py                         # 4 groups x 8 samples of 52 + 6 tokens
    python benchmarks/cpu_shared_prefix.py --completion-len 35     # the demo's completions before training

The batch is built by the orchestrator's own batching (examples/reverse_text/rl.toml: batch_size 32, group_size 8,
micro_batch_tokens 1024) and trained by the trainer's own step (Policy, train_step, AdamW) in float32 with random
weights of SmolLM2-135M's shape; each path takes the row layout the trainer picks (trainer/row_layout.py). Prints
seconds per step of each (median over --steps alternating rounds) and last `speedup: <one by one / trees>`.
"""

import argparse
import random
import statistics
import time

import torch
from cpu_row_layout import smollm2_config  # benchmarks/cpu_row_layout.py, beside this script

from slipstream.config.trainer import LossConfig
from slipstream.envs.base import Task
from slipstream.models.registry import build_model
from slipstream.orchestrator.batching import build_training_batches
from slipstream.rollout.record import Rollout
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import TrainingBatch

CPU = torch.device("cpu")


def demo_rollouts(num_groups: int, group_size: int, prompt_len: int, completion_len: int, vocab_size: int):
    """GRPO groups: one random prompt per group, `group_size` random completions with advantages and log-probs."""
    rng = random.Random(0)
    rollouts = []
    for g in range(num_groups):
        prompt = [rng.randrange(3, vocab_size) for _ in range(prompt_len)]
        for k in range(group_size):
            completion = [rng.randrange(3, vocab_size) for _ in range(completion_len)]
            rollouts.append(
                Rollout(
                    task=Task(id=f"t{g}", prompt=[]),
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=[-1.0] * completion_len,
                    completion_text="",
                    token_versions=[0] * completion_len,
                    request_version=0,
                    advantage=(-1.0) ** k,
                    group_index=g,
                )
            )
    return rollouts


def timed_step(policy, optimizer, batch: TrainingBatch) -> float:
    start = time.perf_counter()
    train_step(policy, optimizer, batch, LossConfig(), 1.0, CPU, torch.float32)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=52)
    parser.add_argument("--completion-len", type=int, default=6)
    parser.add_argument("--micro-batch-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="measured rounds (each: one step of each path)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = smollm2_config()
    policy = Policy(build_model(cfg, "custom").float())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-7)
    rollouts = demo_rollouts(args.num_groups, args.group_size, args.prompt_len, args.completion_len, cfg.vocab_size)
    batches = {
        shared: build_training_batches(1, rollouts, 1.0, args.micro_batch_tokens, 1, {}, shared_prefix=shared)[0]
        for shared in (False, True)
    }
    for shared in (False, True):
        timed_step(policy, optimizer, batches[shared])  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.steps):
        for shared in (False, True):
            times[shared].append(timed_step(policy, optimizer, batches[shared]))
    n = len(rollouts)
    print(f"{n} samples ({args.num_groups} groups of {args.group_size}), {args.prompt_len} prompt + "
          f"{args.completion_len} completion tokens, {args.threads} thread(s)")  # fmt: skip
    for shared, name in ((False, "one by one"), (True, "trees     ")):
        tokens = sum(len(mb.input_ids) for mb in batches[shared].micro_batches)
        seconds = statistics.median(times[shared])
        print(
            f"{name}: {seconds:.2f} s/step, {tokens} tokens in {len(batches[shared].micro_batches)} micro-batch(es) "
            f"({n * (args.prompt_len + args.completion_len) / seconds:.0f} sample tokens/s)"
        )
    print(f"speedup: {statistics.median(times[False]) / statistics.median(times[True]):.2f}")


if __name__ == "__main__":
    main()
