"""The single-process pieces of expert and context parallelism: the ranks' partial expert mixtures, the token ownership of
context-parallel shards, the shard's attention mask, the loss split over owned tokens, and the errors that say which
trainer.parallel field to change."""

import pytest
import torch

from slipstream.config.trainer import LossConfig
from slipstream.models.common.attention import ContextShard, build_packed_causal_mask, build_shard_causal_mask
from slipstream.models.common.moe import GroupedExperts, mix_experts, mix_local_experts
from slipstream.models.registry import load_pretrained
from slipstream.parallel.cp import owned_tokens, shard_size
from slipstream.parallel.mesh import ParallelDims
from slipstream.trainer.loss import rl_loss
from slipstream.trainer.setup import check_parallel_fits_model


@pytest.mark.parametrize(("grouped", "dtype", "tol"), [(False, torch.float64, 1e-12), (True, torch.float32, 1e-5)])
def test_ranks_partial_expert_sums_add_up_to_the_whole_mixture(grouped, dtype, tol):
    """What expert parallelism's receivers compute: each rank mixes only its own experts' slots of the rows it got
    (other slots marked -1, weight 0); the ranks' float32 partial sums add up to the one-process mixture, values
    and gradients (x, gate weights, every expert's weights), including tokens none of whose experts a rank holds."""
    torch.manual_seed(0)
    num_experts, top_k, num_tokens, dim, hidden, num_ranks = 8, 3, 11, 8, 4, 2  # 16-byte strides: grouped_mm
    num_local = num_experts // num_ranks
    whole = GroupedExperts(dim, hidden, num_experts, use_grouped_mm=grouped).to(dtype)
    whole.init_weights(0.3)
    ids_NA = torch.rand(num_tokens, num_experts).argsort(dim=-1)[:, :top_k]
    ids_NA[0] = torch.tensor([0, 1, 2])  # every expert of token 0 on rank 0: rank 1 sees it fully masked
    x_ND = torch.randn(num_tokens, dim, dtype=dtype, requires_grad=True)
    weights_NA = torch.rand(num_tokens, top_k, dtype=dtype, requires_grad=True)
    upstream_ND = torch.randn(num_tokens, dim, dtype=dtype)

    (mix_experts(whole, x_ND, ids_NA, weights_NA) * upstream_ND).sum().backward()
    want = [x_ND.grad.clone(), weights_NA.grad.clone()] + [p.grad.clone() for p in whole.parameters()]
    want_y = mix_experts(whole, x_ND, ids_NA, weights_NA).detach()
    x_ND.grad, weights_NA.grad = None, None

    parts, total = [], 0
    for rank in range(num_ranks):
        part = GroupedExperts(dim, hidden, num_local, use_grouped_mm=grouped).to(dtype)
        for name, param in part.named_parameters():
            param.data.copy_(getattr(whole, name).data[rank * num_local : (rank + 1) * num_local])
        mine_NA = ids_NA // num_local == rank
        local_NA = torch.where(mine_NA, ids_NA - rank * num_local, -1)
        weights = torch.where(mine_NA, weights_NA, torch.zeros_like(weights_NA))
        total = total + mix_local_experts(part, x_ND, local_NA, weights, num_local, dtype)
        parts.append(part)
    torch.testing.assert_close(total.to(dtype), want_y, rtol=tol, atol=tol)
    (total * upstream_ND).sum().backward()
    got = [x_ND.grad, weights_NA.grad] + [
        torch.cat([getattr(part, name).grad for part in parts]) for name, _ in whole.named_parameters()
    ]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


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
