"""On a CUDA GPU: every attention path of models/common/attention.py (SDPA causal for one sample per row, flash
varlen for packed rows, flex_attention for packed rows and prefix trees) against the reference (`packed_attention`: block-diagonal mask, float64 on CPU), values and
gradients; and each model family on CUDA (bf16 autocast), packed, against the reference attention and against
float32 on CPU.

Not run in CI (marked gpu). Tolerances are relative norms ||x - ref|| / ||ref||: bf16 inputs give ~3e-3 for
attention; a bf16-autocast model against float32 lands near 1e-2 (MoE: see the model test).
"""

import pytest
import torch

from slipstream.models.common import transformer
from slipstream.models.common.attention import (
    AttentionLayout,
    attention,
    build_attention_layout,
    packed_attention,
)
from slipstream.models.registry import build_model
from slipstream.models.tiny import build_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def positions(rows: list[list[int]]) -> torch.Tensor:
    """position_ids_BT of rows packing samples of the given lengths (all rows the same total length)."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def reference(q_BTHK, k_BTGK, v_BTGK, position_ids_BT):
    """float64 CPU reference output and input gradients for a fixed output gradient."""
    q, k, v = (t.detach().double().cpu().requires_grad_() for t in (q_BTHK, k_BTGK, v_BTGK))
    o_BTHK = packed_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), position_ids_BT).transpose(1, 2)
    return o_BTHK, q, k, v


CASES = {
    "one sample": ([[2048]], "causal", "varlen"),
    "one sample per row, 2 rows": ([[777], [777]], "causal", "varlen"),
    "packed": ([[300, 1, 517, 182, 1024]], "varlen", "varlen"),
    "packed, 2 rows": ([[5, 600, 419], [1024]], "varlen", "varlen"),
    "packed, flex": ([[300, 1, 517, 182, 1024]], "flex", "flex"),
    "packed, 2 rows, flex": ([[5, 600, 419], [1024]], "flex", "flex"),
    "prefix tree, flex": ("tree", "flex", "flex"),
}


def tree_positions() -> torch.Tensor:
    """A row of two samples and a prefix tree (root 0..999, branches forked at 600 and at 17), 2024 tokens."""
    parts = [torch.arange(300), torch.arange(324), torch.arange(1000), torch.arange(600, 900), torch.arange(17, 117)]
    return torch.cat(parts)[None]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("autocast", [False, True])
def test_gpu_paths_match_reference(name, autocast):
    rows, backend, packed = CASES[name]
    position_ids_BT = tree_positions() if rows == "tree" else positions(rows)
    B, T = position_ids_BT.shape
    g = torch.Generator().manual_seed(len(name))
    dtype = torch.float32 if autocast else torch.bfloat16  # under autocast the projections' fp32 outputs come in
    q, k, v = (torch.randn(B, T, h, 128, generator=g).to(CUDA, dtype).requires_grad_() for h in (16, 8, 8))
    grad_o = torch.randn(B, T, 16, 128, generator=g)

    layout = build_attention_layout(position_ids_BT.to(CUDA), torch.bfloat16, packed=packed)
    assert layout.backend == backend
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        o = attention(q, k, v, layout)
    o.backward(grad_o.to(CUDA, o.dtype))

    # the reference sees the same bf16-rounded inputs the kernels computed with
    o_ref, q_ref, k_ref, v_ref = reference(*(t.bfloat16() for t in (q, k, v)), position_ids_BT)
    o_ref.backward(grad_o.double())
    assert rel(o, o_ref) < 1e-2
    for x, x_ref in ((q, q_ref), (k, k_ref), (v, v_ref)):
        assert rel(x.grad, x_ref.grad) < 2e-2


def test_float32_packed_rows_take_the_reference_on_cuda():
    """Flash kernels need 16-bit inputs; float32 without autocast keeps the exact (mask) path."""
    assert build_attention_layout(positions([[3, 5]]).to(CUDA), torch.float32).backend == "reference"
    assert build_attention_layout(positions([[8]]).to(CUDA), torch.float32).backend == "causal"


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_models_on_cuda_match_reference_attention_and_cpu(family, monkeypatch):
    """Packed rows (varlen) and each sample alone (causal) on CUDA under bf16 autocast against the same model on
    CUDA with the reference attention (same bf16 arithmetic elsewhere), and against float32 on CPU. MoE is checked
    per token: a bf16 difference can flip a token's top-k experts, which moves that token's output a lot (seen on
    an H100: 6% relative norm over all logits against the reference attention)."""
    torch.manual_seed(0)
    cfg = build_config(family, vocab_size=512, eos_token_id=2, pad_token_id=0)
    model = build_model(cfg, "custom").float()
    lengths = [37, 1, 250, 224]
    input_ids_BT = torch.randint(0, 512, (1, sum(lengths)))
    position_ids_BT = positions([lengths])
    with torch.no_grad():
        expected = model(input_ids_BT, position_ids_BT)
        model.to(CUDA)
        input_ids_BT, position_ids_BT = input_ids_BT.to(CUDA), position_ids_BT.to(CUDA)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            packed = model(input_ids_BT, position_ids_BT).float()
            alone = []
            for ids_BT in torch.split(input_ids_BT, lengths, dim=1):
                alone.append(model(ids_BT, torch.arange(ids_BT.shape[1], device=CUDA)[None]).float())
            monkeypatch.setattr(transformer, "build_attention_layout", lambda p, *_: AttentionLayout("reference", p))
            reference_attention = model(input_ids_BT, position_ids_BT).float()
    alone = torch.cat(alone, dim=1)
    print(family, {"packed": rel(packed, reference_attention), "alone": rel(alone, reference_attention)})
    print(family, {"packed vs cpu": rel(packed, expected)})
    if family != "qwen3_moe":
        assert rel(packed, reference_attention) < 1e-2 and rel(alone, reference_attention) < 1e-2
        assert rel(packed, expected) < 3e-2
        return
    # A sample boundary crossed would move every later token; a flipped expert moves a few tokens.
    for logits in (packed, alone):
        assert rel(logits, reference_attention) < 0.15
        assert fraction_close(logits, reference_attention, 5e-2) > 0.8
    assert fraction_close(packed, expected, 5e-2) > 0.8


def fraction_close(x_BTV: torch.Tensor, ref_BTV: torch.Tensor, tol: float) -> float:
    """Share of tokens whose logits are within `tol` relative norm of the reference."""
    x_BTV, ref_BTV = x_BTV.double().cpu(), ref_BTV.double().cpu()
    rel_BT = (x_BTV - ref_BTV).norm(dim=-1) / ref_BTV.norm(dim=-1)
    return (rel_BT < tol).double().mean().item()


@pytest.mark.parametrize("keep_attention", [False, True])
def test_checkpointing_keeps_flex_attention_outputs(keep_attention):
    """With trainer.packed_attention = "flex", compiled blocks and keep_attention checkpointing, backward does not
    rerun the flex forward kernel (it did before flex_attention joined parallel/ac.py's saved ops: measured on an
    H100, the 8 x 2048 step ran it twice per block); full checkpointing reruns it once per block."""
    from slipstream.config.trainer import ParallelConfig

    parallel = ParallelConfig(activation_checkpointing=True, activation_checkpointing_keep_attention=keep_attention)
    cfg, step = flex_training_step(parallel)
    step()  # compile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    forward = [n for n in names if "flex_attention" in n and "backward" not in n]
    backward = [n for n in names if "flex_attention_backward" in n]
    blocks = cfg.num_hidden_layers
    assert backward, names
    assert len(forward) == (blocks if keep_attention else 2 * blocks), forward


def test_flex_blocks_do_not_recompile_after_the_first_step():
    """The compiled flex kernel is made outside the compiled blocks: made inside the first trace, its list's
    emptiness was a guard that failed at the second step and recompiled every block once more (measured on an
    H100 with TORCH_LOGS=recompiles). The same shapes again must now run without any recompilation."""
    from slipstream.config.trainer import ParallelConfig

    torch._dynamo.reset()
    _, step = flex_training_step(ParallelConfig())
    step()  # compile
    with torch._dynamo.config.patch(error_on_recompile=True):
        step()


def flex_training_step(parallel):
    """(config, step): a tiny Qwen3 on CUDA with packed_attention = "flex", parallelized with compiled blocks
    under `parallel`, and a step that runs forward and backward on three packed samples."""
    from slipstream.parallel.fsdp import parallelize_model
    from slipstream.trainer.policy import Policy

    torch.manual_seed(0)
    cfg = build_config("qwen3", vocab_size=512, eos_token_id=2, pad_token_id=0)
    model = build_model(cfg, "custom").to(CUDA)
    model.packed_attention = "flex"
    policy = parallelize_model(Policy(model), None, parallel, torch.bfloat16, compile=True)
    lengths = [300, 212, 500]
    input_ids_T = torch.randint(3, 512, (sum(lengths),), device=CUDA)
    position_ids_T = positions([lengths])[0].to(CUDA)
    temperatures_T = torch.ones(sum(lengths), device=CUDA)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logprobs_T, _ = policy(input_ids_T, position_ids_T, temperatures_T)
        logprobs_T.float().sum().backward()

    return cfg, step
