"""GLM-5's DeepSeek sparse attention where the top-k is shorter than the rows (CPU, float32), on the two points where
transformers 5.19 and vLLM (what serves our rollouts; its CPU build refuses sparse attention, so its CUDA code is the
reference) disagree, and where we follow vLLM:

- the indexer's RoPE: vLLM (and SGLang, DeepSeek-V3.2's reference) rotate the two halves of the rope dims (NeoX) unless
  the config sets `indexer_rope_interleave` (GLM-5's checkpoints do); transformers always interleaves. With the flag
  ours equals transformers (test_long_regime_parity.py); without it, transformers with a half-split indexer;
- keys of EQUAL index score (relu zeroes a key for every indexer head: with few heads, many keys score exactly 0, often
  a query's best score): ours keeps the earliest, the rule of vLLM's context-parallel top-k merge (score, then the lower
  token index), the same however samples are packed or sharded; transformers' `topk` picks among them as its CPU
  quickselect happens to. On such configs ours equals transformers with that rule, and not plain transformers.

Reference = transformers' model with its indexer patched to vLLM's choice (`vllm_indexer`), values and gradients, whole
rows and packed rows, top-k at 1/8 and 1/2 of the row. tests/distributed/test_dsa_context_parallel.py: cp = 2."""

import contextlib
from unittest import mock

import pytest
import torch
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf_dsa

from slipstream.models.common.attention import ContextShard, build_packed_causal_mask, build_shard_causal_mask
from slipstream.models.glm_moe_dsa.args import GlmMoeDsaArgs
from slipstream.models.glm_moe_dsa.attention import DsaIndexer
from tests.unit.long_regime_helpers import build_pair, check_packed_rows, check_rows, random_ids
from tests.unit.test_glm_moe_dsa import dsa_config

T = 64


def _stable_topk(scores, k, dim=-1, largest=True, sorted=True):
    """torch.topk with vLLM's order among equal scores: the lower index first."""
    indices = scores.sort(dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, indices), indices))


def _half_split_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """NeoX RoPE (vLLM's `is_neox_style`): dims i and i + R/2 turn together, by frequency i."""

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.unsqueeze(unsqueeze_dim) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(unsqueeze_dim)

    return rotate(q), rotate(k)


@contextlib.contextmanager
def vllm_indexer(interleave: bool):
    """transformers' GLM-5 with vLLM's indexer choices while inside: half-split RoPE unless `interleave` (the config's
    `indexer_rope_interleave`), and the lower index first among equal scores. Only the indexer's calls are patched
    (the attention's own RoPE stays interleaved, as in vLLM)."""
    forward, calls = hf_dsa.GlmMoeDsaIndexer.forward, []

    def patched(self, *args, **kwargs):
        calls.append(1)
        rope = hf_dsa.apply_rotary_pos_emb_interleave if interleave else _half_split_rope
        with mock.patch.object(hf_dsa, "apply_rotary_pos_emb_interleave", rope):
            with mock.patch.object(torch.Tensor, "topk", _stable_topk):
                return forward(self, *args, **kwargs)

    with mock.patch.object(hf_dsa.GlmMoeDsaIndexer, "forward", patched):
        yield
    assert calls, "transformers' indexer never ran: the patch no longer reaches it"


def vllm_forward(interleave: bool):
    def run(model, input_ids_BT):
        with vllm_indexer(interleave):
            return model(input_ids=input_ids_BT).logits

    return run


def plain_forward(model, input_ids_BT):
    return model(input_ids=input_ids_BT).logits


CONFIGS = {
    # name: (config overrides, interleaved indexer RoPE)
    "half-split-rope": (dict(indexer_rope_interleave=False), False),
    "ties-1-head": (dict(index_n_heads=1), True),  # half the keys of a query score 0: ties at the top
}


@pytest.fixture(
    scope="module",
    params=[(name, top_k) for name in CONFIGS for top_k in (8, 32)],
    ids=lambda param: f"{param[0]}-top{param[1]}of{T}",
)
def pair(request, tmp_path_factory):
    name, top_k = request.param
    overrides, interleave = CONFIGS[name]
    ours, hf = build_pair(dsa_config(index_topk=top_k, **overrides), tmp_path_factory.mktemp(f"{name}{top_k}"))
    assert ours.args.indexer_rope_interleave == interleave
    return name, top_k, ours, hf


def test_whole_rows_match_transformers_with_vllms_indexer(pair):
    name, top_k, ours, hf = pair
    input_ids_BT = random_ids(700, 2, T, seed=3)
    errors = check_rows("glm_moe_dsa", ours, hf, input_ids_BT, hf_forward=vllm_forward(CONFIGS[name][1]))
    print(f"{name} top {top_k} of {T}: {errors}")
    with torch.no_grad():  # where transformers itself chooses otherwise (RoPE, or ties), the logits move by far more
        plain = (ours(input_ids_BT, torch.arange(T).expand(2, T)) - plain_forward(hf, input_ids_BT)).abs().max()
    print(f"{name} top {top_k}: plain transformers differs by {plain:.2e}")
    assert plain > 1e-2, f"{name}: transformers 5.19 now agrees with vLLM here ({plain:.1e}); update the docstrings"


def test_packed_rows_match_transformers_with_vllms_indexer(pair):
    name, top_k, ours, hf = pair
    errors = check_packed_rows("glm_moe_dsa", ours, hf, [44, 12, 52], hf_forward=vllm_forward(CONFIGS[name][1]))
    print(f"{name} top {top_k} packed: {errors}")


def test_the_flag_is_read_as_vllm_reads_it():
    """Absent (transformers' own configs, DeepSeek-V3.2's) means half-split, as vLLM's `getattr(..., False)`."""
    config = dsa_config()
    assert GlmMoeDsaArgs.from_hf_config(config).indexer_rope_interleave
    del config.indexer_rope_interleave
    assert not hasattr(config, "indexer_rope_interleave")
    assert not GlmMoeDsaArgs.from_hf_config(config).indexer_rope_interleave


def test_equal_scores_keep_each_samples_earliest_keys_in_any_layout():
    """A zero indexer query scores every key 0: each query keeps the first top-k keys of its own sample (vLLM's rule),
    in a packed row and in each context-parallel shard of it alike; transformers' topk keeps other keys."""
    args = GlmMoeDsaArgs.from_hf_config(dsa_config(index_topk=4))
    indexer = DsaIndexer(args)
    indexer.init_weights(0.5)
    torch.nn.init.zeros_(indexer.wq_b.weight)
    lengths = [7, 3, 12]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    N = sum(lengths)
    x_BTD, q_resid_BTQ = torch.randn(1, N, 96), torch.randn(1, N, 40)
    cos_BTR, sin_BTR = torch.randn(1, N, 8), torch.randn(1, N, 8)
    keys_BTI = indexer.keys(x_BTD, cos_BTR, sin_BTR)
    mask_BTT = build_packed_causal_mask(position_ids_BT)[:, 0]
    keep_BTT = indexer.select(x_BTD, q_resid_BTQ, keys_BTI, cos_BTR, sin_BTR, mask_BTT)
    key_position_BTT = position_ids_BT[:, None, :].expand(1, N, N)
    assert torch.equal(keep_BTT, mask_BTT & (key_position_BTT < 4))
    for offset, size in ((0, 11), (11, 11)):  # two shards; the boundary cuts the third sample
        rows = slice(offset, offset + size)
        shard_mask_BtT = build_shard_causal_mask(ContextShard(position_ids_BT, offset, None), size)[:, 0]
        got = indexer.select(x_BTD[:, rows], q_resid_BTQ[:, rows], keys_BTI, cos_BTR[:, rows], sin_BTR[:, rows],
                             shard_mask_BtT)  # fmt: skip
        assert torch.equal(got, keep_BTT[:, rows])
    # transformers ranks the same (all-zero) scores with topk: another choice among the ties
    scores_BTT = torch.zeros(1, N, N).masked_fill(~mask_BTT, float("-inf"))
    hf_keep_BTT = torch.zeros_like(mask_BTT).scatter(-1, scores_BTT.topk(4, dim=-1).indices, True) & mask_BTT
    assert not torch.equal(hf_keep_BTT, keep_BTT), "torch.topk now breaks ties by index: update the docstrings"
