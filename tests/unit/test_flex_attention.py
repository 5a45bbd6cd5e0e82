"""trainer.packed_attention = "flex": flex_attention with a block mask of the rows' samples and prefix trees gives
the reference's results. Forward only here (torch's flex has no CPU backward: the trainer refuses flex off GPUs);
gradients and the compiled CUDA kernel are checked by tests/gpu/test_attention_paths.py. Attention alone, the whole
model on packed samples and a prefix tree, and the config's checks."""

import pytest
import torch

from slipstream.config.trainer import TrainerConfig
from slipstream.models.common.attention import build_attention_layout, flex_attention_call, packed_attention
from slipstream.models.registry import load_pretrained
from slipstream.trainer.policy import Policy

# two plain samples, then a tree: root "0..5", branches forked at 3 and at 2
POSITIONS = [0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 3, 4, 2, 3]


def _qkv(num_tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, h, num_tokens, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))


def test_flex_matches_the_reference_mask_on_samples_and_trees():
    position_ids_BT = torch.tensor([POSITIONS])
    layout = build_attention_layout(position_ids_BT, torch.float64, packed="flex")
    assert layout.backend == "flex"
    q, k, v = _qkv(len(POSITIONS))
    got = flex_attention_call(q, k, v, layout.block_mask)
    torch.testing.assert_close(got, packed_attention(q, k, v, position_ids_BT), rtol=1e-10, atol=1e-10)


def _positions(lengths: list[int]) -> list[int]:
    return [p for n in lengths for p in range(n)]


# rows of independent samples: shorter than a block, across many blocks, ending on a block edge, one per row
SAMPLE_ROWS = [
    [[300, 5, 1, 200, 17], [100, 423]],
    [[128, 128, 256, 60], [572]],
    [[1, 1, 1, 126, 129, 2], [3, 257]],
]


@pytest.mark.parametrize("rows", SAMPLE_ROWS)
def test_sample_rows_build_the_block_mask_create_block_mask_builds(rows):
    """document_blocks.py's direct construction = create_block_mask's, block by block (partial and full blocks,
    their order), and the attention through it = the reference, for rows of plain samples."""
    from torch.nn.attention.flex_attention import create_block_mask

    from slipstream.models.common.document_blocks import document_block_mask
    from slipstream.models.common.prefix_tree import tree_ids

    position_ids_BT = torch.tensor([_positions(lengths) for lengths in rows])
    B, T = position_ids_BT.shape
    start_BT = tree_ids(position_ids_BT).tree_start_BT

    def mask_mod(b, h, q, kv):
        return (start_BT[b, q] == start_BT[b, kv]) & (kv <= q)

    got = document_block_mask(start_BT, mask_mod)
    want = create_block_mask(mask_mod, B, None, T, T, device="cpu")
    assert got.seq_lengths == want.seq_lengths
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        got_n, want_n = getattr(got, counts), getattr(want, counts)
        assert torch.equal(got_n, want_n), counts
        for b, q in ((b, q) for b in range(B) for q in range(got_n.shape[-1])):
            n = int(want_n[b, 0, q])
            assert torch.equal(getattr(got, indices)[b, 0, q, :n], getattr(want, indices)[b, 0, q, :n]), (counts, b, q)
    assert torch.equal(got.to_dense(), want.to_dense())
    # the attention path: build_attention_layout takes the direct construction for such rows
    layout = build_attention_layout(position_ids_BT, torch.float64, packed="flex")
    assert layout.backend == "flex" and torch.equal(layout.block_mask.to_dense(), want.to_dense())
    q, k, v = _qkv(T, seed=1)
    q, k, v = (x.expand(B, -1, -1, -1).contiguous() for x in (q, k, v))
    got_o = flex_attention_call(q, k, v, layout.block_mask)
    torch.testing.assert_close(got_o, packed_attention(q, k, v, position_ids_BT), rtol=1e-10, atol=1e-10)


def test_one_sample_rows_keep_their_own_path_and_bad_kernels_are_refused():
    assert build_attention_layout(torch.arange(8)[None], torch.float32, packed="flex").backend == "reference"
    with pytest.raises(ValueError, match="packed attention 'flash'"):
        build_attention_layout(torch.arange(8)[None], torch.float32, packed="flash")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_model_with_flex_equals_the_reference_on_samples_and_a_tree(tiny_model_factory, family):
    model_dir = tiny_model_factory(family)
    position_ids_T = torch.tensor(POSITIONS)
    input_ids_T = torch.randint(3, 400, (len(POSITIONS),), generator=torch.Generator().manual_seed(1))
    temperatures_T = torch.full((len(POSITIONS),), 0.9)
    results = []
    for kernel in ("varlen", "flex"):
        model = load_pretrained(model_dir, impl="custom")
        model.packed_attention = kernel
        with torch.no_grad():
            results.append(Policy(model)(input_ids_T, position_ids_T, temperatures_T)[0])
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


def test_flex_needs_our_models(tmp_path):
    with pytest.raises(ValueError, match="packed_attention = 'flex' runs in Slipstream's own models"):
        TrainerConfig(output_dir=tmp_path, max_steps=1, model={"name": "x"}, model_impl="hf", packed_attention="flex")


def test_the_trainer_refuses_flex_off_gpus(tiny_model_factory, tmp_path):
    from slipstream.trainer.setup import setup_trainer

    config = TrainerConfig(
        output_dir=tmp_path, max_steps=1, model={"name": str(tiny_model_factory("qwen3"))}, packed_attention="flex"
    )
    with pytest.raises(ValueError, match="'flex' is a GPU kernel .* use packed_attention = 'varlen' there"):
        setup_trainer(config)


def test_compiled_flex_kernel_made_once_and_outside_traces_guards_nothing_new():
    """`compiled_flex_attention` makes the kernel once (the same object after); made before a compiled function
    that fetches it (as the model's forward does when it picks a flex layout on CUDA), the function does not
    recompile on its next call (made inside the first trace, the list's emptiness was a guard that failed)."""
    from slipstream.models.common import attention

    attention._COMPILED_FLEX.clear()
    kernel = attention.compiled_flex_attention()
    assert attention.compiled_flex_attention() is kernel and attention._COMPILED_FLEX == [kernel]

    def block(x):
        attention.compiled_flex_attention()  # fetched, as flex_attention_call does inside compiled blocks
        return x * 2

    torch._dynamo.reset()
    compiled = torch.compile(block)
    compiled(torch.ones(4))
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(torch.ones(4)), torch.full((4,), 2.0))
