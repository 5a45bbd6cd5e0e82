"""The single-process pieces of expert and context parallelism: the dispatch permutation, the token ownership of
context-parallel shards, the shard's attention mask, the loss split over owned tokens, and the errors that say which
trainer.parallel field to change."""

import pytest
import torch

from slipstream.config.trainer import LossConfig
from slipstream.models.common.attention import ContextShard, build_packed_causal_mask, build_shard_causal_mask
from slipstream.models.registry import load_pretrained
from slipstream.parallel.cp import owned_tokens, shard_size
from slipstream.parallel.ep import expert_major_order, inverse_permutation
from slipstream.parallel.mesh import ParallelDims
from slipstream.trainer.loss import rl_loss
from slipstream.trainer.setup import check_parallel_fits_model


def test_expert_major_order_groups_each_local_expert_across_source_ranks():
    # Received from 2 source ranks for 3 local experts: rows (p, e) segments p-major.
    counts_PE = torch.tensor([[2, 0, 1], [1, 3, 0]])
    labels_R = [f"p{p}e{e}#{i}" for p in range(2) for e in range(3) for i in range(int(counts_PE[p, e]))]
    perm_R = expert_major_order(counts_PE)
    assert [labels_R[i] for i in perm_R] == [
        "p0e0#0", "p0e0#1", "p1e0#0", "p1e1#0", "p1e1#1", "p1e1#2", "p0e2#0",
    ]  # fmt: skip
    inverse_R = inverse_permutation(perm_R)
    assert torch.equal(perm_R[inverse_R], torch.arange(7)) and torch.equal(inverse_R[perm_R], torch.arange(7))
    assert expert_major_order(torch.zeros(2, 3, dtype=torch.long)).numel() == 0


@pytest.mark.parametrize(("num_tokens", "num_ranks"), [(12, 2), (13, 2), (7, 4), (3, 4)])
def test_every_token_has_one_owner_the_rank_holding_its_predecessor(num_tokens, num_ranks):
    owned_RT = torch.stack([owned_tokens(num_tokens, r, num_ranks, torch.device("cpu")) for r in range(num_ranks)])
    assert torch.equal(owned_RT.sum(0), torch.ones(num_tokens, dtype=torch.long))
    size = shard_size(num_tokens, num_ranks)
    for t in range(1, num_tokens):
        assert owned_RT[(t - 1) // size, t]
    assert owned_RT[0, 0]


def test_shard_mask_is_the_rows_of_the_full_mask():
    position_ids_BT = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 0]])
    full_B1TT = build_packed_causal_mask(position_ids_BT)
    for offset in (0, 5):
        context = ContextShard(position_ids_BT, offset, gather_kv=lambda x: x)
        assert torch.equal(build_shard_causal_mask(context, 5), full_B1TT[:, :, offset : offset + 5])


@pytest.mark.parametrize("kind", ["dppo_tv", "geo_mask"])
def test_loss_over_owned_tokens_adds_up_to_the_loss(kind):
    g = torch.Generator().manual_seed(0)
    position_ids_T = torch.tensor([*range(6), *range(5)])
    loss_mask_T = torch.tensor([False, *[True] * 5, False, False, *[True] * 3])
    lp_T, lq_T = -torch.rand(11, generator=g) * 3, -torch.rand(11, generator=g) * 3
    adv_T = torch.randn(11, generator=g)
    config = LossConfig(kind=kind)
    full, full_stats = rl_loss(lp_T, lq_T, adv_T, loss_mask_T, 8, config, position_ids_T)
    parts = [
        rl_loss(lp_T, lq_T, adv_T, loss_mask_T, 8, config, position_ids_T, owned_tokens(11, r, 2, lp_T.device))
        for r in range(2)
    ]
    assert parts[0][0] + parts[1][0] == pytest.approx(float(full), abs=1e-6)
    summed = (parts[0][1] + parts[1][1]).to_floats()
    for name, value in full_stats.to_floats().items():
        assert summed[name] == pytest.approx(value, abs=1e-6), name


def _dims(ep=1, cp=1):
    return ParallelDims(dp_replicate=1, dp_shard=4 // cp, cp=cp, ep=ep, world_size=4)


def test_parallel_dims_checked_against_the_model(tiny_model_factory):
    dense = load_pretrained(tiny_model_factory("qwen3"), impl="custom")
    moe = load_pretrained(tiny_model_factory("qwen3_moe"), impl="custom")  # 8 experts
    check_parallel_fits_model(_dims(ep=4), moe, "custom")
    check_parallel_fits_model(_dims(cp=2), dense, "custom")
    with pytest.raises(ValueError, match=r"trainer.parallel.ep = 2 needs a mixture-of-experts model .* set ep = 1"):
        check_parallel_fits_model(_dims(ep=2), dense, "custom")
    with pytest.raises(ValueError, match=r"trainer.parallel.ep = 2 needs a mixture-of-experts model"):
        check_parallel_fits_model(_dims(ep=2), moe, "hf")
    with pytest.raises(ValueError, match=r"trainer.parallel.ep = 3 must divide the number of experts \(8\)"):
        check_parallel_fits_model(ParallelDims(1, 3, 1, 3, 3), moe, "custom")
    with pytest.raises(ValueError, match=r"trainer.parallel.cp = 2 needs trainer.model_impl = 'custom'"):
        check_parallel_fits_model(_dims(cp=2), dense, "hf")
    hybrid = load_pretrained(tiny_model_factory("qwen3_5_moe_text"), impl="custom")  # recurrent linear attention
    check_parallel_fits_model(_dims(ep=2), hybrid, "custom")
    with pytest.raises(ValueError, match=r"trainer.parallel.cp = 2: Qwen35Moe has layers .* set cp = 1"):
        check_parallel_fits_model(_dims(cp=2), hybrid, "custom")
