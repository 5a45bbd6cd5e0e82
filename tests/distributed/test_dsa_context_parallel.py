"""GLM-5's DeepSeek sparse attention under context parallelism on two CPU ranks (gloo, parallel/cp.py's all-gather),
with the top-k at 1/8 and 1/2 of 64-token rows (one row of one sample, one packing three samples with the shard
boundary inside the second), and on a config with one indexer head (many keys of equal score) and half-split indexer
RoPE: the keys each query keeps over the shards are exactly those of the whole rows in one process, and the logits and
gradients (summed over the ranks) equal the whole rows' and transformers' with vLLM's indexer choices
(tests/unit/test_glm_moe_dsa_sparse.py)."""

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.helpers import run_ranks

T, LENGTHS = 64, (20, 25, 19)
CASES = {
    "top8": dict(index_topk=8),
    "top32": dict(index_topk=32),
    "top8-ties-half-split-rope": dict(index_topk=8, index_n_heads=1, indexer_rope_interleave=False),
}


def _rows(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids_BT, position_ids_BT, targets_BT): row 0 one sample, row 1 three packed samples."""
    g = torch.Generator().manual_seed(11)
    input_ids_BT = torch.randint(3, vocab_size, (2, T), generator=g)
    position_ids_BT = torch.stack([torch.arange(T), torch.cat([torch.arange(n) for n in LENGTHS])])
    return input_ids_BT, position_ids_BT, torch.randint(3, vocab_size, (2, T), generator=g)


def _run(model_dir: Path, context_for=None, cols: slice = slice(None)) -> dict:
    """Logits, each indexer's keep mask and the gradients of the summed cross-entropy of tokens `cols` (on one cp rank:
    its shard, `context_for(position_ids_BT)` its ContextShard)."""
    from slipstream.models.glm_moe_dsa.attention import DsaIndexer
    from slipstream.models.registry import load_pretrained

    model = load_pretrained(model_dir, impl="custom").eval()
    input_ids_BT, position_ids_BT, targets_BT = _rows(model.args.vocab_size)
    context = None if context_for is None else context_for(position_ids_BT)
    kept, select = [], DsaIndexer.select

    def recording(self, *args):
        kept.append(select(self, *args))
        return kept[-1]

    with mock.patch.object(DsaIndexer, "select", recording):
        h_BtD = model.forward_hidden(input_ids_BT[:, cols], position_ids_BT[:, cols], context=context)
    logits_BtV = model.logits(h_BtD)
    F.cross_entropy(logits_BtV.flatten(0, 1), targets_BT[:, cols].flatten(), reduction="sum").backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits_BtV.detach(), "kept": kept, "grads": grads}


def _cp_ranks(model_dirs: list[str], out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from slipstream.models.common.attention import ContextShard
    from slipstream.parallel.cp import ContextParallel

    dist.init_process_group("gloo")
    cp = ContextParallel(init_device_mesh("cpu", (2,)))
    size = cp.shard_size(T)
    for model_dir in model_dirs:
        result = _run(
            Path(model_dir),
            lambda position_ids_BT: ContextShard(position_ids_BT, cp.rank * size, cp.gather_tokens),
            slice(cp.rank * size, (cp.rank + 1) * size),
        )
        torch.save(result, Path(out_dir) / f"{Path(model_dir).name}-rank{cp.rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{case: (model folder, [rank 0 result, rank 1 result])}, every case in one spawn."""
    from tests.unit.long_regime_helpers import build_pair
    from tests.unit.test_glm_moe_dsa import dsa_config

    root = tmp_path_factory.mktemp("dsa_cp")
    dirs = {}
    for name, overrides in CASES.items():
        dirs[name] = root / name
        build_pair(dsa_config(**overrides), dirs[name])
    run_ranks(2, _cp_ranks, [str(d) for d in dirs.values()], str(root))
    return {k: (d, [torch.load(root / f"{d.name}-rank{r}.pt") for r in range(2)]) for k, d in dirs.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_shards_select_and_compute_as_the_whole_rows(runs, name):
    from transformers import AutoModelForCausalLM

    from tests.unit.test_glm_moe_dsa_sparse import vllm_forward

    model_dir, shards = runs[name]
    top_k = CASES[name]["index_topk"]
    whole = _run(model_dir)
    assert len(whole["kept"]) == len(shards[0]["kept"]) == 4  # one selection per layer
    for layer, keep_BTT in enumerate(whole["kept"]):
        assert keep_BTT.sum(-1).max() == top_k and (keep_BTT.sum(-1) < keep_BTT.shape[-1] // 2).any()  # sparse
        assert torch.equal(torch.cat([s["kept"][layer] for s in shards], dim=1), keep_BTT), f"layer {layer}"
    logits_BTV = torch.cat([s["logits"] for s in shards], dim=1)
    assert (logits_BTV - whole["logits"]).abs().max() <= 1e-5
    assert shards[0]["grads"].keys() == shards[1]["grads"].keys() == whole["grads"].keys()
    for key, grad in whole["grads"].items():
        summed = shards[0]["grads"][key] + shards[1]["grads"][key]
        assert (summed - grad).abs().max() <= 1e-5 * grad.abs().max(), key
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids_BT, _, _ = _rows(hf.config.vocab_size)
    lengths = [[T], list(LENGTHS)]
    hf_forward = vllm_forward(interleave=CASES[name].get("indexer_rope_interleave", True))
    with torch.no_grad():  # transformers runs each sample alone
        for row in range(2):
            samples = input_ids_BT[row].split(lengths[row])
            expected = torch.cat([hf_forward(hf, s[None]) for s in samples], dim=1)
            assert (logits_BTV[row : row + 1] - expected).abs().max() <= 1e-4, f"row {row}"
