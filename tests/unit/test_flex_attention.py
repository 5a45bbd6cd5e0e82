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
