"""Parity with transformers (CPU, float32) in the regime where a family's special attention acts (rows several times
longer than its window, chunk or top-k), written once: `build_pair` makes a random transformers model of a config and
loads ours from its checkpoint; `check_rows` compares logits and gradients on whole rows, `check_packed_rows` a packed
row against its samples run alone (ours and transformers). Gradients are compared per tensor, relative to that
tensor's largest gradient in transformers."""

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from slipstream.models.registry import MODEL_SPECS, load_pretrained
from tests.unit.moe_family_helpers import save_random_hf

LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4
"""max |ours - transformers| of a parameter's gradient, over the largest |gradient| transformers gives that tensor."""
PACKED_ATOL = 1e-5
"""A packed row's logits against the same samples run alone through our model (chunked linear attention: 1e-4, as a
packed sample's chunks are not those of the sample alone, so float32 rounds otherwise)."""


def build_pair(
    config, folder: Path, seed: int = 1, tweak: Callable[[torch.nn.Module], None] | None = None
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(ours, transformers) in eval mode, with the weights of a transformers model of `config` (seed `seed`; selection
    biases random, as transformers inits them at 0; then `tweak`, under no_grad) saved to `folder` and loaded back."""
    save_random_hf(config, folder, seed, tweak)
    ours = load_pretrained(folder, impl="custom").eval()
    return ours, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def random_ids(vocab_size: int, *shape: int, seed: int) -> torch.Tensor:
    """Token ids past the special ones (a padding id's zero embedding would tie every key of a DSA indexer)."""
    return torch.randint(3, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _token_loss(logits_BTV: torch.Tensor, seed: int) -> torch.Tensor:
    """Summed cross-entropy against random targets: a packed row's loss is the sum of its samples' losses."""
    targets_N = random_ids(logits_BTV.shape[-1], logits_BTV.shape[:2].numel(), seed=seed)
    return F.cross_entropy(logits_BTV.flatten(0, 1), targets_N, reduction="sum") / 100


def _hf_grads(family: str, hf: torch.nn.Module, args) -> dict[str, torch.Tensor]:
    """transformers' gradients under our parameter names (0 where it has none)."""
    grads = {k: torch.zeros_like(p) if p.grad is None else p.grad.clone() for k, p in hf.named_parameters()}
    return MODEL_SPECS[family].from_hf(grads, args)


def worst_grad_error(ours: torch.nn.Module, want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(largest relative error, its parameter) of our gradients against `want`; a parameter that gets no gradient in
    ours (the DSA indexers) must get none in `want` either."""
    worst, where = 0.0, ""
    for key, param in ours.named_parameters():
        scale = want[key].abs().max().item()
        if param.grad is None:
            assert scale == 0.0, f"{key}: transformers gives it a gradient, ours none"
            continue
        assert scale > 0.0, f"{key}: no gradient in transformers"
        error = (param.grad - want[key]).abs().max().item() / scale
        if error > worst:
            worst, where = error, key
    return worst, where


def check_rows(family: str, ours, hf, input_ids_BT: torch.Tensor, hf_forward=None) -> dict[str, float]:
    """Whole rows (positions 0..T-1): logits and gradients of ours against transformers (`hf_forward(hf, ids)`,
    default `hf(input_ids=ids).logits`). Returns the measured errors."""
    hf_forward = hf_forward or (lambda model, ids: model(input_ids=ids).logits)
    B, T = input_ids_BT.shape
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    logits = ours(input_ids_BT, torch.arange(T).expand(B, T))
    expected = hf_forward(hf, input_ids_BT)
    logits_error = (logits - expected).abs().max().item()
    assert logits_error <= LOGITS_ATOL, f"{family}: max |logits diff| {logits_error:.2e}"
    _token_loss(logits, seed=5).backward()
    _token_loss(expected, seed=5).backward()
    grad_error, where = worst_grad_error(ours, _hf_grads(family, hf, ours.args))
    assert grad_error <= GRAD_RTOL, f"{family}: gradient of {where} off by {grad_error:.2e} of its largest"
    return {"logits": logits_error, "grad": grad_error}


def check_packed_rows(
    family: str, ours, hf, lengths: list[int], seed: int = 7, hf_forward=None, alone_atol: float = PACKED_ATOL
) -> dict[str, float]:
    """One row packing samples of `lengths` (positions restart at 0): its logits equal each sample run alone through
    ours (<= `alone_atol`) and through transformers, and its gradients the sum of transformers' per-sample ones."""
    hf_forward = hf_forward or (lambda model, ids: model(input_ids=ids).logits)
    samples = [random_ids(ours.args.vocab_size, 1, n, seed=seed + i) for i, n in enumerate(lengths)]
    position_ids_BT = torch.cat([torch.arange(n) for n in lengths])[None]
    ours.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    packed = ours(torch.cat(samples, dim=1), position_ids_BT)
    with torch.no_grad():
        alone = torch.cat([ours(s, torch.arange(s.shape[1])[None]) for s in samples], dim=1)
    hf_alone = [hf_forward(hf, s) for s in samples]
    alone_error = (packed - alone).abs().max().item()
    hf_error = (packed - torch.cat(hf_alone, dim=1)).abs().max().item()
    assert alone_error <= alone_atol, f"{family}: packed vs alone {alone_error:.2e}"
    assert hf_error <= LOGITS_ATOL, f"{family}: packed vs transformers alone {hf_error:.2e}"
    _token_loss(packed, seed=seed).backward()
    _token_loss(torch.cat(hf_alone, dim=1), seed=seed).backward()  # the same targets, sample by sample
    grad_error, where = worst_grad_error(ours, _hf_grads(family, hf, ours.args))
    assert grad_error <= GRAD_RTOL, f"{family}: packed gradient of {where} off by {grad_error:.2e} of its largest"
    return {"packed_vs_alone": alone_error, "packed_vs_hf": hf_error, "packed_grad": grad_error}
