"""Shared-prefix training under FSDP and context parallelism (CPU ranks, gloo): batches of GRPO groups as prefix
trees on 2 ranks give the loss, metrics and gradients (<= 1e-5) and weights after 3 steps (<= 1e-4) of the same
samples one by one in one process. cp=2 cuts rows inside trees, so a branch's first token is often predicted by the
other rank's prefix token."""

import pytest
import torch

from slipstream.config.shared import ModelConfig
from slipstream.config.trainer import LossConfig, OptimConfig, ParallelConfig, TrainerConfig
from slipstream.transport.rollouts import TrainingBatch, write_batch
from tests.distributed.helpers import BatchedRanks, selected_params, train_and_record
from tests.distributed.tree_batches import group_samples, plain_micro_batch, tree_micro_batch

NUM_STEPS = 3
CASES = {
    # name: (family, world size, data-parallel ranks (batch files), parallel config, loss kind, router replay)
    "qwen3-fsdp2": ("qwen3", 2, 2, ParallelConfig(), "dppo_tv", False),
    "qwen3-cp2-geo": ("qwen3", 2, 1, ParallelConfig(cp=2), "geo_mask", False),
    "qwen3_moe-cp2-replay": ("qwen3_moe", 2, 1, ParallelConfig(cp=2), "dppo_tv", True),
}


def _step_groups(step: int, num_data_ranks: int, replay: bool):
    """Per rank, its micro-batches, each a list of groups; rank 0 has one more (exercises padding passes)."""
    per_rank = []
    for rank in range(num_data_ranks):
        seed = 100 * step + 10 * rank
        count = 2 if rank == 0 else 1
        per_rank.append(
            [
                [
                    group_samples(7 + j, [4 + j, 6, 3 + rank, 5], seed=seed + 2 * j, replay=replay),
                    group_samples(5, [3, 7 - j], seed=seed + 2 * j + 1, replay=replay),
                ]
                for j in range(count)
            ]
        )
    return per_rank


def _write(output_dir, num_data_ranks, replay, as_trees):
    for step in range(1, NUM_STEPS + 1):
        per_rank = _step_groups(step, num_data_ranks, replay)
        build = tree_micro_batch if as_trees else plain_micro_batch
        per_rank = [[build(groups) for groups in mbs] for mbs in per_rank]
        num_loss = sum(sum(mb.loss_mask) for mbs in per_rank for mb in mbs)
        if not as_trees:  # the reference: every sample on its own, one process
            per_rank = [[mb for mbs in per_rank for mb in mbs]]
        for rank, mbs in enumerate(per_rank):
            write_batch(output_dir, TrainingBatch(step, rank, num_loss, mbs))


def _config(model_dir, output_dir, parallel, loss_kind):
    return TrainerConfig(
        model=ModelConfig(name=str(model_dir)),
        model_impl="custom",
        output_dir=output_dir,
        max_steps=NUM_STEPS,
        optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
        loss=LossConfig(kind=loss_kind, geo_low=0.03, geo_high=1.5),
        parallel=parallel,
        device="cpu",
        num_threads=1,
    )


@pytest.fixture(scope="module")
def multi_rank_runs(request, tiny_model_factory, tmp_path_factory):
    """The 2-rank runs of the selected cases, in one spawn (see BatchedRanks)."""

    def make_job(case, folder):
        family, world_size, num_data_ranks, parallel, loss_kind, replay = CASES[case]
        _write(folder / "multi", num_data_ranks, replay, as_trees=True)
        config = _config(tiny_model_factory(family), folder / "multi", parallel, loss_kind)
        return world_size, train_and_record, (config, folder / "multi.pt", NUM_STEPS)

    return BatchedRanks(tmp_path_factory.mktemp("tree_parity"), selected_params(request, "case"), make_job)


@pytest.mark.parametrize("case", list(CASES))
def test_trees_on_two_ranks_match_one_by_one(tiny_model_factory, tmp_path, case, multi_rank_runs):
    family, world_size, num_data_ranks, parallel, loss_kind, replay = CASES[case]
    model_dir = tiny_model_factory(family)
    single = tmp_path / "single"
    _write(single, num_data_ranks, replay, as_trees=False)

    multi_pt = multi_rank_runs.run(case) / "multi.pt"
    train_and_record(_config(model_dir, single, ParallelConfig(), loss_kind), tmp_path / "single.pt", NUM_STEPS)
    got, want = torch.load(multi_pt), torch.load(tmp_path / "single.pt")

    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=1e-5, msg=name)
    first_got, first_want = got["metrics"][0], want["metrics"][0]
    keys = ["loss", "mismatch_kl", "entropy", "masked_fraction", "grad_norm", "num_loss_tokens"]
    if replay:  # router statistics count token-layers: a tree counts its prompt's once
        assert 0 < first_got["router/replayed_fraction"] < 1
    for key in keys:
        assert first_got[key] == pytest.approx(first_want[key], rel=0, abs=1e-5), key
    assert first_got["num_tokens"] < first_want["num_tokens"]  # the prompts were computed once per group
    assert first_want["grad_norm"] > 0.05  # the clip acted
    if loss_kind == "geo_mask":
        assert 0 < first_want["masked_fraction"] < 1
    largest_mismatch = max((got["state"][k] - want["state"][k]).abs().max().item() for k in want["state"])
    assert largest_mismatch <= 1e-4
