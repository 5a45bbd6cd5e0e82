"""Router replay in our MoE model: replaying the trainer's own choices changes nothing, replaying other experts routes
the tokens there with gate weights from the trainer's router at those experts (gradients reach the router), tokens
without routing (-1) keep the trainer's own top-k, and the agreement counts say how many replayed tokens matched."""

import pytest
import torch

from slipstream.models.common.moe import MoE, TopKRouter
from slipstream.models.registry import load_pretrained
from tests.unit.moe_family_helpers import run_with_replay


def _router(seed: int = 0) -> TopKRouter:
    torch.manual_seed(seed)
    router = TopKRouter(dim=16, num_experts=8, top_k=2, norm_topk_prob=True)
    torch.nn.init.normal_(router.weight)
    return router


def test_replayed_experts_take_the_trainers_gate_weights_and_unrouted_tokens_fall_back():
    router = _router()
    x_ND = torch.randn(5, 16)
    probs_NE, own_NA, own_w_NA = router(x_ND)
    replay_NA = torch.tensor([[3, 5], [0, 1], [-1, -1], [7, 6], [-1, -1]])
    probs2_NE, ids_NA, w_NA = router(x_ND, replay_NA)
    assert torch.equal(probs2_NE, probs_NE)
    assert torch.equal(ids_NA[[0, 1, 3]], replay_NA[[0, 1, 3]])
    assert torch.equal(ids_NA[[2, 4]], own_NA[[2, 4]])  # no routing from inference: the trainer's own top-k
    picked = probs_NE[[0, 1, 3]].gather(-1, replay_NA[[0, 1, 3]])
    assert torch.allclose(w_NA[[0, 1, 3]], picked / picked.sum(-1, keepdim=True), atol=1e-6)
    assert torch.equal(w_NA[[2, 4]], own_w_NA[[2, 4]])
    replay_NA[1] = own_NA[1].flip(0)  # the same set in another order agrees
    router(x_ND, replay_NA)
    agreeing = sum(set(own_NA[i].tolist()) == set(replay_NA[i].tolist()) for i in (0, 1, 3))
    assert router.replay_counts.tolist() == [5, 3, agreeing] and agreeing >= 1


def test_replay_gradient_reaches_the_router():
    router = _router()
    x_ND = torch.randn(4, 16)
    _, _, w_NA = router(x_ND, torch.tensor([[1, 2]] * 4))
    w_NA[:, 0].sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("replay_own", [True, False])
def test_model_replays_per_moe_block(tiny_model_factory, replay_own):
    model = load_pretrained(tiny_model_factory("qwen3_moe"), impl="custom")
    model.eval()
    torch.manual_seed(0)
    input_ids_BT = torch.randint(0, 500, (1, 12))
    position_ids_BT = torch.arange(12)[None]
    moes, h_plain, h_replay = run_with_replay(model, MoE, input_ids_BT, position_ids_BT, replay_own)
    assert model.num_moe_blocks == len(moes) == 2
    if replay_own:
        assert torch.equal(h_replay, h_plain)
        assert all(m.router.replay_counts.tolist() == [12, 12, 12] for m in moes)
    else:
        assert not torch.allclose(h_replay, h_plain, atol=1e-3)
        assert all(m.router.replay_counts[:2].tolist() == [12, 12] for m in moes)
    with pytest.raises(ValueError, match="MoE blocks"):
        model.forward_hidden(input_ids_BT, position_ids_BT, replay_BTRA=torch.zeros(1, 12, 1, 2, dtype=torch.long))
