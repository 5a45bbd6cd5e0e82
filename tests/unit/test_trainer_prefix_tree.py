"""Shared-prefix training: prefix trees read from position_ids (models/common/prefix_tree.py), their validation
(trainer/data.py), and exactness: a GRPO group trained as one tree gives the loss, metrics and gradients of its
samples trained one by one (float32, CPU, <= 1e-5)."""

import pytest
import torch

from slipstream.config.trainer import LossConfig
from slipstream.models.common.attention import ContextShard, build_packed_causal_mask, build_shard_causal_mask
from slipstream.models.common.prefix_tree import has_branches, parent_index, segment_index, tree_mask
from slipstream.models.registry import load_pretrained
from slipstream.parallel.cp import owned_tokens, shard_size
from slipstream.trainer import logprobs as logprobs_module
from slipstream.trainer.data import (
    MicroBatchError,
    build_padded_layout,
    expand_trees,
    padded_position_ids,
    shared_prefix_mask,
    to_packed,
)
from slipstream.trainer.policy import Policy
from slipstream.trainer.step import train_step
from slipstream.transport.rollouts import MicroBatch, TrainingBatch
from tests.distributed.tree_batches import group_samples, plain_micro_batch, tree_micro_batch

CPU = torch.device("cpu")
# Tree "a b c d e" + branch "f g" forked at 3 + branch "h" forked at 2, then a plain sample of 2 tokens.
POSITIONS = [0, 1, 2, 3, 4, 3, 4, 2, 0, 1]


def test_tree_structure_from_positions():
    pos_T = torch.tensor(POSITIONS)
    assert parent_index(pos_T).tolist() == [-1, 0, 1, 2, 3, 2, 5, 1, -1, 8]
    assert segment_index(pos_T).tolist() == [0, 0, 0, 0, 0, 1, 1, 2, 3, 3]
    attends = {
        0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4],
        5: [0, 1, 2, 5], 6: [0, 1, 2, 5, 6], 7: [0, 1, 7], 8: [8], 9: [8, 9],
    }  # fmt: skip
    expected_TT = torch.zeros(10, 10, dtype=torch.bool)
    for q, keys in attends.items():
        expected_TT[q, keys] = True
    assert torch.equal(build_packed_causal_mask(pos_T[None])[0, 0], expected_TT)
    assert bool(has_branches(pos_T[None])) and not bool(has_branches(torch.tensor([[0, 1, 2, 0, 1]])))
    # Without branches the mask is the block-diagonal causal one of packed samples.
    plain_TT = tree_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    assert torch.equal(plain_TT, torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                                               [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool))  # fmt: skip
    # A context-parallel shard's mask is the full mask's rows.
    for offset in (0, 4, 7):
        context = ContextShard(pos_T[None], offset, gather_kv=lambda x: x)
        assert torch.equal(build_shard_causal_mask(context, 3)[0, 0], expected_TT[offset : offset + 3])


def test_padded_layout_of_trees():
    pos_T = torch.tensor(POSITIONS)
    layout = build_padded_layout(pos_T)
    assert (layout.num_rows, layout.max_len, layout.num_branches) == (2, 8, 2)
    assert layout.row_T.tolist() == [0] * 8 + [1] * 2 and layout.col_T.tolist() == [*range(8), 0, 1]
    assert layout.parent_T.tolist() == parent_index(pos_T).tolist()
    assert layout.is_start_T.nonzero().flatten().tolist() == [0, 8]
    assert padded_position_ids(pos_T, layout).tolist() == [POSITIONS[:8], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert shared_prefix_mask(pos_T).tolist() == [True] * 3 + [False] * 7
    source_E, own_T = expand_trees(pos_T)
    assert source_E.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 0, 1, 7, 8, 9]
    assert own_T.tolist() == [0, 1, 2, 3, 4, 8, 9, 12, 13, 14]
    assert torch.equal(source_E[own_T], torch.arange(10))
    # A branch may continue the whole root (here after a branch of one token forked at 1).
    assert build_padded_layout(torch.tensor([0, 1, 2, 1, 3])).parent_T.tolist() == [-1, 0, 1, 0, 2]
    assert build_padded_layout(torch.tensor([0, 1, 2, 0, 1])).num_branches == 0


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ([1, 2, 3], "must start at 0"),
        ([0, 1, 2, 5], "token 3 is at position 5 after 2, but its tree's first sample has only 3 tokens"),
        ([0, 1, 0, 2], "token 3 is at position 2 after 0"),
        ([0, 2, 3], "token 1 is at position 2"),
    ],
)
def test_malformed_positions_are_rejected(positions, match):
    with pytest.raises(MicroBatchError, match=match):
        build_padded_layout(torch.tensor(positions))


def _mb(positions, loss_mask):
    n = len(positions)
    return MicroBatch(list(range(10, 10 + n)), positions, loss_mask, [0.0] * n, [0.0] * n, [1.0] * n)


@pytest.mark.parametrize(
    "positions", [POSITIONS, [0, 1, 2, 3, 4, 3, 4, 2], [0, 1, 2, 1, 2, 3, 2], [0, 1, 0, 1, 2], [0, 1, 2]]
)
def test_sample_tokens_count_the_trees_written_out(positions):
    """to_packed counts on the CPU the tokens the forward runs where trees are written out as their samples."""
    packed = to_packed(_mb(positions, [False] * len(positions)), CPU)
    assert packed.sample_tokens == expand_trees(torch.tensor(positions))[0].numel() >= len(positions)


def test_to_packed_keeps_loss_out_of_shared_prefixes():
    # Loss on the root's continuation and on a branch's first token: fine (the prefix's last token predicts it).
    to_packed(_mb([0, 1, 2, 3, 2, 3], [False, False, True, True, True, True]), CPU)
    with pytest.raises(MicroBatchError, match="shared prefix"):
        to_packed(_mb([0, 1, 2, 3, 2, 3], [False, True, True, True, True, True]), CPU)
    with pytest.raises(MicroBatchError, match="first token"):
        to_packed(_mb([0, 1, 2, 1], [True, False, False, True]), CPU)


@pytest.mark.parametrize(("num_tokens", "num_ranks"), [(10, 2), (10, 3), (10, 4)])
def test_cp_owner_of_a_branch_start_holds_its_parent(num_tokens, num_ranks):
    parent_T = parent_index(torch.tensor(POSITIONS))
    owned_RT = torch.stack([owned_tokens(num_tokens, r, num_ranks, CPU, parent_T) for r in range(num_ranks)])
    assert torch.equal(owned_RT.sum(0), torch.ones(num_tokens, dtype=torch.long))
    size = shard_size(num_tokens, num_ranks)
    for t in (5, 7):  # branch starts, predicted from tokens 2 and 1
        assert owned_RT[int(parent_T[t]) // size, t]


# Exactness: two GRPO groups (prompts of 9 and 6 tokens) and a lone sample, as trees vs one by one.
GROUPS = [(9, [5, 3, 7, 4]), (6, [4, 6, 2]), (5, [3])]
LOSSES = {
    "dppo_tv": LossConfig(kind="dppo_tv", dp_threshold=0.002),
    "geo_mask": LossConfig(kind="geo_mask", geo_low=0.03, geo_high=1.5),
    "tis": LossConfig(kind="tis", tis_cap=0.1),
    "icepop": LossConfig(kind="icepop", icepop_low=0.05, icepop_high=5.0),
}


def _groups(replay: bool = False):
    return [group_samples(p, c, seed=i, replay=replay) for i, (p, c) in enumerate(GROUPS)]


def _train(model, micro_batches, loss_config):
    """One train_step on `micro_batches` (lr 0): metrics and the gradients before the optimizer step."""
    policy = Policy(model, chunk_size=16)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    grads = {}
    optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    )
    num_loss = sum(sum(mb.loss_mask) for mb in micro_batches)
    batch = TrainingBatch(step=1, rank=0, num_loss_tokens=num_loss, micro_batches=micro_batches)
    metrics = train_step(policy, optimizer, batch, loss_config, 1e9, CPU)
    return metrics, grads


def _assert_same_training(got, want, loss_kind):
    (got_metrics, got_grads), (want_metrics, want_grads) = got, want
    for key in ["loss", "mismatch_kl", "masked_fraction", "entropy", "grad_norm", "num_loss_tokens"]:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=0, abs=1e-5), key
    if loss_kind == "geo_mask":
        assert 0 < want_metrics["masked_fraction"] < 1  # some samples masked as a whole, some not
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 5
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=1e-5, msg=name)
    assert max(g.abs().max().item() for g in want_grads.values()) > 1e-3  # gradients are not trivially zero


def _tree_vs_one_by_one(model, loss_config, replay=False):
    groups = _groups(replay)
    samples = [s for g in groups for s in g]
    tree = tree_micro_batch(groups)
    assert len(tree.input_ids) == sum(p + sum(c) for p, c in GROUPS) < sum(s.num_tokens for s in samples)
    one_by_one = [plain_micro_batch([[s]]) for s in samples]
    return _train(model, [tree], loss_config), _train(model, one_by_one, loss_config)


@pytest.mark.parametrize("padded_rows", [False, True])
@pytest.mark.parametrize("loss_kind", list(LOSSES))
def test_tree_equals_one_by_one_dense(tiny_model_factory, monkeypatch, loss_kind, padded_rows):
    model = load_pretrained(tiny_model_factory("qwen3"), impl="custom")
    monkeypatch.setattr(logprobs_module, "use_padded_rows", lambda *args: padded_rows)
    got, want = _tree_vs_one_by_one(model, LOSSES[loss_kind])
    _assert_same_training(got, want, loss_kind)
    assert got[0]["num_model_tokens"] == got[0]["num_tokens"] < want[0]["num_tokens"]  # each prefix ran once


@pytest.mark.parametrize(("loss_kind", "replay"), [("dppo_tv", False), ("geo_mask", False), ("dppo_tv", True)])
def test_tree_equals_one_by_one_moe(tiny_model_factory, loss_kind, replay):
    model = load_pretrained(tiny_model_factory("qwen3_moe"), impl="custom")
    got, want = _tree_vs_one_by_one(model, LOSSES[loss_kind], replay=replay)
    _assert_same_training(got, want, loss_kind)
    if replay:
        assert all(0 < m["router/replayed_fraction"] <= 1 for m in (got[0], want[0]))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_trees_written_out_as_samples_train_the_same(tiny_model_factory, monkeypatch, family):
    """Where our models run trees as their samples (CUDA: EXPAND_TREES_ON), training is unchanged (with replay)."""
    monkeypatch.setattr(logprobs_module, "EXPAND_TREES_ON", ("cpu",))
    calls = []
    expand = logprobs_module.expand_trees
    monkeypatch.setattr(logprobs_module, "expand_trees", lambda p: calls.append(1) or expand(p))
    model = load_pretrained(tiny_model_factory(family), impl="custom")
    got, want = _tree_vs_one_by_one(model, LOSSES["geo_mask"], replay=family == "qwen3_moe")
    _assert_same_training(got, want, "geo_mask")
    assert calls  # the trees were written out
    # the tokens the forward ran: the samples written out, as many as one by one; the packed tokens stay fewer
    assert got[0]["num_model_tokens"] == want[0]["num_model_tokens"] == want[0]["num_tokens"] > got[0]["num_tokens"]
    if family == "qwen3_moe":  # the replay counters are over the tokens run: a prefix written out counts per sample
        for key in ("router/replayed_fraction", "router/agreement"):
            assert got[0][key] == pytest.approx(want[0][key], rel=1e-9), key
        assert 0 < got[0]["router/replayed_fraction"] <= 1


def test_tree_equals_one_by_one_transformers_model(tiny_model_factory):
    """transformers models take no tree mask: the trainer writes trees out as their samples (expand_trees)."""
    model = load_pretrained(tiny_model_factory("qwen3"), impl="hf")
    got, want = _tree_vs_one_by_one(model, LOSSES["geo_mask"])
    _assert_same_training(got, want, "geo_mask")


def test_every_token_gets_its_samples_log_prob(tiny_model_factory):
    """Token by token: a tree's log-probs and entropies are those of the token in its own sample alone; loss tokens
    are the same tokens, once each."""
    model = load_pretrained(tiny_model_factory("qwen3"), impl="custom")
    groups = _groups()
    tree, plain = tree_micro_batch(groups), plain_micro_batch(groups)
    policy = Policy(model, chunk_size=16)
    with torch.no_grad():
        tree_lp, tree_ent = policy(*[torch.tensor(x) for x in (tree.input_ids, tree.position_ids, tree.temperatures)])
        plain_lp, plain_ent = policy(
            *[torch.tensor(x) for x in (plain.input_ids, plain.position_ids, plain.temperatures)]
        )
    tree_loss, plain_loss = torch.tensor(tree.loss_mask), torch.tensor(plain.loss_mask)
    assert tree_loss.sum() == plain_loss.sum() == sum(sum(c) for _, c in GROUPS)
    # The tree orders its samples by length: match tokens by their (distinct, random) inference log-probs.
    tree_order = torch.tensor(tree.inference_logprobs)[tree_loss].argsort()
    plain_order = torch.tensor(plain.inference_logprobs)[plain_loss].argsort()
    assert torch.equal(
        torch.tensor(tree.inference_logprobs)[tree_loss][tree_order],
        torch.tensor(plain.inference_logprobs)[plain_loss][plain_order],
    )
    torch.testing.assert_close(tree_lp[tree_loss][tree_order], plain_lp[plain_loss][plain_order], rtol=0, atol=1e-5)
    torch.testing.assert_close(tree_ent[tree_loss][tree_order], plain_ent[plain_loss][plain_order], rtol=0, atol=1e-5)
    assert (tree_lp[tree_loss] != 0).all()
    # The prefix matters: the same row without the tree's attention rule (branches alone) gives other log-probs.
    segments_T = segment_index(torch.tensor(tree.position_ids))
    alone = [
        p - tree.position_ids[segments_T.tolist().index(s)]
        for p, s in zip(tree.position_ids, segments_T.tolist(), strict=True)
    ]
    with torch.no_grad():
        alone_lp, _ = policy(torch.tensor(tree.input_ids), torch.tensor(alone), torch.tensor(tree.temperatures))
    assert (alone_lp[tree_loss] - tree_lp[tree_loss]).abs().max() > 1e-3


def test_trees_take_padded_rows_where_plain_rows_would_run_varlen(tiny_model_factory, monkeypatch):
    """Trees run the masked reference on CUDA too: one padded row per tree keeps its mask small."""
    from slipstream.trainer import row_layout

    monkeypatch.setattr(row_layout, "varlen_attn", object())  # as if torch had the fused varlen kernel
    model = load_pretrained(tiny_model_factory("qwen3"), impl="custom")
    groups = [group_samples(40, [6] * 8, seed=i) for i in range(6)]
    trees = build_padded_layout(torch.tensor(tree_micro_batch(groups).position_ids))
    plain = build_padded_layout(torch.tensor(plain_micro_batch(groups).position_ids))
    cuda = torch.device("cuda")
    assert trees.num_rows == 6 and row_layout.use_padded_rows(model, trees, cuda, torch.bfloat16)
    assert not row_layout.use_padded_rows(model, plain, cuda, torch.bfloat16)


def test_models_without_tree_support_train_trees_as_their_samples(tiny_model_factory):
    """A hybrid linear-attention model (recurrent state: no tree mask applies) gets prefix trees written out as their
    samples on every device, and trains exactly as one by one."""
    model = load_pretrained(tiny_model_factory("qwen3_5_moe_text"), impl="custom")
    assert model.supports_prefix_trees is False
    (got_metrics, got_grads), (want_metrics, want_grads) = _tree_vs_one_by_one(model, LOSSES["geo_mask"])
    # float32 sums in another order (the samples run as one packed row instead of one by one): relative tolerances
    for key in ["loss", "mismatch_kl", "entropy", "grad_norm", "num_loss_tokens"]:
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 5
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["tree", "plain"])
def test_layout_built_while_validating_is_the_one_the_forward_would_build(tiny_model_factory, monkeypatch, kind):
    """to_packed keeps the layout it validated with; the policy takes it instead of rebuilding it from the positions
    (on a GPU that rebuild is a host sync), with the same log-probs bit for bit."""
    groups = _groups()
    mb = tree_micro_batch(groups) if kind == "tree" else plain_micro_batch(groups)
    packed = to_packed(mb, CPU)
    want = build_padded_layout(packed.position_ids_T)
    for name in ("row_T", "col_T", "is_start_T", "parent_T"):
        assert torch.equal(getattr(packed.layout, name), getattr(want, name)), name
    assert (packed.layout.num_rows, packed.layout.max_len, packed.layout.num_branches) == (
        want.num_rows,
        want.max_len,
        want.num_branches,
    )
    assert (packed.layout.num_branches > 0) == (kind == "tree")
    policy = Policy(load_pretrained(tiny_model_factory("qwen3"), impl="custom"), chunk_size=16)
    args = (packed.input_ids_T, packed.position_ids_T, packed.temperatures_T, packed.loss_mask_T)
    with torch.no_grad():
        rebuilt = policy(*args)
        rebuilds = []
        monkeypatch.setattr(logprobs_module, "build_padded_layout", lambda *a: rebuilds.append(a) or want)
        given = policy(*args, layout=packed.layout)
    assert rebuilds == []
    assert torch.equal(given[0], rebuilt[0]) and torch.equal(given[1], rebuilt[1])
