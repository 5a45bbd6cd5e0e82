"""SFT prefix trees (SFTConfig.shared_prefix): conversations sharing a prefix are packed as trees that count the prefix
once, hold every conversation token for token, never share a loss token, stay within the budget and are
deterministic; an SFT step's loss and every parameter gradient equal those of the conversations packed whole."""

import pytest
import torch

from slipstream.trainer.data import expand_trees
from slipstream.trainer.setup import setup_trainer
from slipstream.trainer.sft_data import pack_micro_batches, packed_micro_batch
from slipstream.trainer.sft_render import SFTSample, load_samples
from slipstream.trainer.sft_step import prefix_sharing, run_passes
from slipstream.trainer.sft_trees import PrefixSharing, SFTTree, TreeCost, build_trees
from slipstream.transport.shared_prefix import shared_prefix_len
from tests.unit.test_sft_loop import _config

CPU = torch.device("cpu")
TOKENS = PrefixSharing(min_prefix_tokens=2)
"""Trees wherever they remove tokens (the cost model of packed rows)."""


def _conv(system: list[int], user: list[int], answer: list[int], where: str) -> SFTSample:
    ids = system + user + answer
    return SFTSample(input_ids=ids, loss_mask=[False] * (len(system) + len(user)) + [True] * len(answer), where=where)


def _conversations(num: int, system: list[int], first_user_token: int = 100) -> list[SFTSample]:
    """`num` conversations with the same system prompt, then user tokens that differ from the first one on."""
    return [
        _conv(system, [first_user_token + i, 7, 8][: 1 + i % 3], [50 + i] * (2 + i % 4), f"c{first_user_token + i}")
        for i in range(num)
    ]


def _samples_of(units) -> list[tuple[list[int], list[int], list[bool]]]:
    """Every conversation of packed micro-batches as (token ids, positions, loss mask), read back from the row."""
    out = []
    for units_of_mb in units:
        packed = packed_micro_batch(units_of_mb, CPU)
        source_E, _ = expand_trees(packed.position_ids_T)
        ids, pos, mask = (t[source_E].tolist() for t in (packed.input_ids_T, packed.position_ids_T, packed.loss_mask_T))
        starts = [e for e, p in enumerate(pos) if p == 0] + [len(pos)]
        out += [(ids[a:b], pos[a:b], mask[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
    return out


def test_a_tree_holds_the_shared_prefix_once_and_every_conversation():
    system = list(range(1, 11))  # 10 tokens without loss, then each conversation's own first user token
    samples = _conversations(6, system)
    bins = pack_micro_batches(samples, 1000, TOKENS)
    assert len(bins) == 1 and len(bins[0]) == 1 and isinstance(bins[0][0], SFTTree)
    tree = bins[0][0]
    assert tree.prefix_len == 10 and len(tree.samples) == 6
    packed = packed_micro_batch(bins[0], CPU)
    plain = packed_micro_batch(pack_micro_batches(samples, 1000)[0], CPU)
    assert plain.num_tokens - packed.num_tokens == 10 * (6 - 1)
    assert packed.loss_mask_T.sum() == plain.loss_mask_T.sum() == sum(s.num_loss_tokens for s in samples)
    expected = sorted((s.input_ids, list(range(s.num_tokens)), s.loss_mask) for s in samples)
    assert sorted(_samples_of(bins)) == expected


def test_a_prefix_with_a_loss_token_is_not_shared():
    samples = _conversations(4, list(range(1, 11)))
    lossy = SFTSample(samples[2].input_ids, [i == 4 or m for i, m in enumerate(samples[2].loss_mask)], "lossy")
    with_lossy = [samples[0], samples[1], lossy, samples[3]]
    assert shared_prefix_len([s.input_ids for s in samples], [s.loss_mask for s in samples]) == 10
    assert shared_prefix_len([s.input_ids for s in with_lossy], [s.loss_mask for s in with_lossy]) == 4
    # At least 5 shared tokens: the lossy conversation shares nothing, the others their 10 tokens.
    units = build_trees(with_lossy, 1000, PrefixSharing(5))
    assert sorted((u.prefix_len, len(u.samples)) for u in units if isinstance(u, SFTTree)) == [(10, 3)]
    assert [u.where for u in units if isinstance(u, SFTSample)] == ["lossy"]
    # With one conversation to share with, the lossy one shares what comes before its loss token.
    units = build_trees([samples[0], lossy], 1000, TOKENS)
    assert len(units) == 1 and units[0].prefix_len == 4 and not any(lossy.loss_mask[:4])
    bins = pack_micro_batches([samples[0], lossy], 1000, TOKENS)  # packed_micro_batch refuses loss in a prefix
    assert sorted(_samples_of(bins)) == sorted(
        (s.input_ids, list(range(s.num_tokens)), s.loss_mask) for s in units[0].samples
    )
    assert all(isinstance(u, SFTSample) for u in build_trees([samples[0], lossy], 1000, PrefixSharing(5)))


def test_conversations_group_by_prefix_within_budget_deterministically():
    a, b = list(range(1, 13)), [1, 2, 3] + list(range(200, 209))  # two system prompts sharing their first 3 tokens
    samples = [s for pair in zip(_conversations(5, a), _conversations(5, b, 300), strict=True) for s in pair]
    units = build_trees(samples, 1000, TOKENS)
    trees = [u for u in units if isinstance(u, SFTTree)]
    assert sorted((t.prefix_len, len(t.samples)) for t in trees) == [(12, 5), (12, 5)]  # not one tree of prefix 3
    assert units == build_trees(list(samples), 1000, TOKENS)
    for budget in (20, 30, 45):  # tighter budgets: smaller trees, none beyond the budget
        bins = pack_micro_batches(samples, budget, TOKENS)
        assert all(sum(u.num_tokens for u in b) <= budget for b in bins)
        assert sorted(_samples_of(bins)) == sorted(
            (s.input_ids, list(range(s.num_tokens)), s.loss_mask) for s in samples
        )
        assert bins == pack_micro_batches(samples, budget, TOKENS)
    # Nothing to share: the same micro-batches as plain packing.
    alone = [_conv([i], [i + 1], [5, 6], f"s{i}") for i in range(0, 40, 4)]
    assert pack_micro_batches(alone, 12, TOKENS) == pack_micro_batches(alone, 12)


def test_attention_cost_keeps_conversations_with_a_short_prefix_apart():
    samples = _conversations(4, [1, 2, 3]) + [_conv([1, 2, 3], [9] * 40, [5] * 40, "long")]
    assert any(isinstance(u, SFTTree) for u in build_trees(samples, 1000, TOKENS))
    costly = PrefixSharing(2, TreeCost(per_token=1, per_pair=10))  # attention dominates: a tree's row costs more
    assert all(isinstance(u, SFTSample) for u in build_trees(samples, 1000, costly))


@pytest.mark.parametrize("tiny_model_dir", ["llama", "qwen3"], indirect=True)
def test_sft_loss_and_gradients_with_trees_equal_whole_conversations(tiny_model_dir, tmp_path):
    config = _config(tiny_model_dir, tmp_path, tmp_path / "out", model_impl="custom")
    trainer = setup_trainer(config.trainer_config())
    samples = load_samples(config.data.train_files, trainer.tokenizer, ["assistant"], 64)
    num_loss_tokens = sum(s.num_loss_tokens for s in samples)

    def grads(sharing):
        trainer.optimizer.zero_grad(set_to_none=True)
        bins = pack_micro_batches(samples, 1024, sharing)
        loss = run_passes(trainer, bins, num_loss_tokens, backward=True)
        return bins, float(loss), {n: p.grad.clone() for n, p in trainer.policy.named_parameters()}

    whole_bins, whole_loss, whole_grads = grads(None)
    for sharing in (TOKENS, prefix_sharing(trainer, True, 2)):
        bins, loss, tree_grads = grads(sharing)
        trees = [u for b in bins for u in b if isinstance(u, SFTTree)]
        saved = sum(t.prefix_len * (len(t.samples) - 1) for t in trees)
        assert trees and saved > 0  # the conversations with the system prompt share it
        assert sum(packed_micro_batch(b, CPU).num_tokens for b in bins) == sum(s.num_tokens for s in samples) - saved
        assert loss == pytest.approx(whole_loss, rel=1e-6)
        for name, grad in whole_grads.items():
            # float32 summation order: a few ulps of the tensor's largest entries, not of each (possibly tiny) one
            torch.testing.assert_close(tree_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item())
        for t in trees:  # each tree shares what the rule allows its conversations, at least the system message
            ids, masks = [s.input_ids for s in t.samples], [s.loss_mask for s in t.samples]
            assert t.prefix_len == shared_prefix_len(ids, masks) >= 5
    assert len(whole_bins) == 1


def test_trees_only_where_the_trainer_runs_them_as_trees(tiny_qwen3_dir, tmp_path):
    """The CPU and context parallelism run trees; CUDA (varlen) and transformers models would write them back out as
    their conversations, so SFT packs conversations whole there."""
    from slipstream.trainer.logprobs import runs_prefix_trees

    custom = setup_trainer(_config(tiny_qwen3_dir, tmp_path, tmp_path / "c", model_impl="custom").trainer_config())
    sharing = prefix_sharing(custom, True, 3)
    assert sharing is not None and sharing.min_prefix_tokens == 3 and sharing.cost.per_pair > 0
    assert prefix_sharing(custom, False, 3) is None
    model = custom.policy.model
    assert runs_prefix_trees(model, CPU) and not runs_prefix_trees(model, torch.device("cuda"))
    assert runs_prefix_trees(model, torch.device("cuda"), context_parallel=True)
    hf = setup_trainer(_config(tiny_qwen3_dir, tmp_path, tmp_path / "h", model_impl="hf").trainer_config())
    assert prefix_sharing(hf, True, 2) is None
