"""Our dense models run many short packed samples as one padded row per sample on CPU (row_layout.py): the same
log-probs, entropies and gradients as the packed row, and the choice itself."""

import pytest
import torch

from slipstream.models.common.attention import varlen_attn
from slipstream.models.registry import load_pretrained
from slipstream.trainer import logprobs as logprobs_module
from slipstream.trainer.data import build_padded_layout
from slipstream.trainer.logprobs import packed_logprobs
from slipstream.trainer.row_layout import use_padded_rows

CPU = torch.device("cpu")
# (prompt, completion) tokens of each sample: 16 samples of 30 to 45 tokens, like an RL group of short answers
LENGTHS = [(24 + i % 5, 6 + i) for i in range(16)]


def _packed(lengths, vocab_size):
    g = torch.Generator().manual_seed(0)
    ids, pos, mask, temps = [], [], [], []
    for i, (num_prompt, num_completion) in enumerate(lengths):
        n = num_prompt + num_completion
        ids += torch.randint(3, vocab_size, (n,), generator=g).tolist()
        pos += list(range(n))
        mask += [False] * num_prompt + [True] * num_completion
        temps += [1.0] * num_prompt + [0.7 + 0.2 * i] * num_completion
    return torch.tensor(ids), torch.tensor(pos), torch.tensor(mask), torch.tensor(temps)


def _run(model, batch, padded: bool, monkeypatch):
    monkeypatch.setattr(logprobs_module, "use_padded_rows", lambda *args: padded)
    model.zero_grad()
    ids, pos, mask, temps = batch
    logprobs_T, entropy_T = packed_logprobs(model, ids, pos, temps, chunk_size=16, target_mask_T=mask)
    (logprobs_T * torch.linspace(-1, 1, ids.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs_T.detach(), entropy_T.detach(), grads


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_rows_equal_the_packed_row(tiny_model_factory, family, monkeypatch):
    model = load_pretrained(tiny_model_factory(family), impl="custom")
    batch = _packed(LENGTHS, model.args.vocab_size)
    assert use_padded_rows(model, build_padded_layout(batch[1]), CPU, torch.float32)  # what CPU picks here

    packed_lp, packed_ent, packed_grads = _run(model, batch, False, monkeypatch)
    padded_lp, padded_ent, padded_grads = _run(model, batch, True, monkeypatch)
    assert (packed_lp[batch[2]] != 0).all()
    torch.testing.assert_close(padded_lp, packed_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded_ent, packed_ent, rtol=0, atol=1e-5)
    assert padded_grads.keys() == packed_grads.keys() and len(packed_grads) > 0
    for name, grad in packed_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=0, atol=1e-5, msg=name)


def test_the_choice(tiny_model_factory):
    model = load_pretrained(tiny_model_factory("qwen3"), impl="custom")
    many_short = build_padded_layout(_packed(LENGTHS, 100)[1])
    assert use_padded_rows(model, many_short, CPU, torch.float32)
    one_sample = build_padded_layout(torch.arange(40))
    assert not use_padded_rows(model, one_sample, CPU, torch.float32)
    # one long sample and a short one: padding the short row to the long one costs more than it saves
    long_and_short = build_padded_layout(torch.cat([torch.arange(2000), torch.arange(2)]))
    assert not use_padded_rows(model, long_and_short, CPU, torch.float32)
    # CUDA with 16-bit compute runs packed rows through fused varlen attention (where torch has it): no padding
    if varlen_attn is not None:
        assert not use_padded_rows(model, many_short, torch.device("cuda"), torch.bfloat16)
    assert use_padded_rows(model, many_short, torch.device("cuda"), torch.float32)
    moe = load_pretrained(tiny_model_factory("qwen3_moe"), impl="custom")
    assert not use_padded_rows(moe, many_short, CPU, torch.float32)  # pads would skew routing statistics
