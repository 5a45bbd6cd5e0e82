"""GRPO-like groups of samples (one prompt, several completions) as prefix trees (the orchestrator's batching) and as
the same samples one by one, for the shared-prefix exactness tests."""

import numpy as np
import torch

from slipstream.orchestrator.batching import Sample, build_trees, to_micro_batch
from slipstream.transport.rollouts import MicroBatch

REPLAY_SHAPE = (2, 2, 8)
"""(MoE layers, top-k, experts) of the tiny qwen3_moe."""


def group_samples(
    prompt_len: int, completion_lens: list[int], seed: int, vocab_size: int = 500, replay: bool = False
) -> list[Sample]:
    """One group: a random prompt, then each sample's completion (loss tokens) with its advantage, temperature and
    noisy inference log-probs. With `replay`: routing equal across the group on the prompt (one prefill), random
    on completions, the last token of each sample not routed (as from vLLM)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist()
    layers, top_k, experts = REPLAY_SHAPE
    prompt_routing = torch.rand(prompt_len, layers, experts, generator=g).argsort(-1)[..., :top_k]
    samples = []
    for i, n in enumerate(completion_lens):
        completion = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        lq = (-(2.0 + 3.0 * torch.rand(n, generator=g))).tolist()
        routed = None
        if replay:
            completion_routing = torch.rand(n, layers, experts, generator=g).argsort(-1)[..., :top_k]
            routed = torch.cat([prompt_routing, completion_routing]).to(torch.uint8).numpy()
            routed[-1] = np.iinfo(np.uint8).max
        samples.append(
            Sample(
                input_ids=prompt + completion,
                loss_mask=[False] * prompt_len + [True] * n,
                advantages=[0.0] * prompt_len + [(-1.0) ** (i + seed) * (0.5 + 0.3 * i)] * n,
                inference_logprobs=[0.0] * prompt_len + lq,
                temperatures=[1.0] * prompt_len + [0.7 + 0.1 * i] * n,
                routed_experts=routed,
            )
        )
    return samples


def tree_micro_batch(groups: list[list[Sample]]) -> MicroBatch:
    """Every group as one prefix tree (all in one micro-batch)."""
    units = build_trees(groups, micro_batch_tokens=1 << 20, min_prefix_tokens=2)
    assert sum(len(getattr(u, "samples", [u])) for u in units) == sum(len(g) for g in groups)
    return to_micro_batch(units)


def plain_micro_batch(groups: list[list[Sample]]) -> MicroBatch:
    """The same samples packed one after another, each with its own copy of the prompt (no trees)."""
    return to_micro_batch([s for group in groups for s in group])
