"""Publish the policy after step N as `weights/step_N/`: HF safetensors + tokenizer + probe.json + READY.

The directory is written under a temporary name and renamed into place, so readers never see a partial one.
Weights are published cast to the served dtype, and probe numerics follow the published dtype: the probe is
computed from the very (cast) tensors written to disk, so it matches what inference serves.
"""

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from slipstream.trainer.data import PackedMicroBatch
from slipstream.trainer.logprobs import compute_logprobs
from slipstream.transport.weights import PROBE, READY, weights_dir
from slipstream.utils.fs import atomic_write_text, commit_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_STEP_RE = re.compile(r"^step_(\d+)$")


def build_probe_token_ids(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """Token ids of the probe text (with the tokenizer's default special tokens); needs at least 2 tokens."""
    token_ids = list(tokenizer(text)["input_ids"])
    if len(token_ids) < 2:
        raise ValueError(f"probe.text {text!r} has {len(token_ids)} token(s); use a text of at least 2 tokens")
    return token_ids


@torch.no_grad()
def compute_probe_logprobs(model: nn.Module, token_ids: list[int]) -> list[float]:
    """logprobs[i] = log p(token_ids[i + 1] | token_ids[: i + 1]) at temperature 1, in eval mode, computed in the
    model's own parameter dtype (no autocast); the LM-head log-softmax is float32."""
    device = next(model.parameters()).device
    num_tokens = len(token_ids)
    mb = PackedMicroBatch(
        input_ids_T=torch.tensor(token_ids, dtype=torch.long, device=device),
        position_ids_T=torch.arange(num_tokens, device=device),
        loss_mask_T=torch.zeros(num_tokens, dtype=torch.bool, device=device),
        advantages_T=torch.zeros(num_tokens, device=device),
        inference_logprobs_T=torch.zeros(num_tokens, device=device),
        temperatures_T=torch.ones(num_tokens, device=device),
    )
    was_training = model.training
    model.eval()
    try:
        logprobs_T, _ = compute_logprobs(model, mb)
    finally:
        model.train(was_training)
    return logprobs_T[1:].tolist()


def publish_weights(
    model: nn.Module,
    tokenizer: "PreTrainedTokenizerBase",
    output_dir: Path,
    step: int,
    probe_token_ids: list[int],
    keep_last: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `weights/step_{step}` atomically, with the weights cast to `dtype`, and return it; with `keep_last`,
    delete all but the newest `keep_last` published steps afterwards (default: keep all). Files are 0644."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None (got {keep_last})")
    final_dir = weights_dir(output_dir, step)
    tmp_dir = final_dir.parent / f".tmp_{final_dir.name}_{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)

    published = cast_model(model, dtype)
    published.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    # The probe runs on `published` in pure `dtype` (bf16 activations and residual stream, as vLLM serving these
    # bf16 weights runs them), not under the trainer's autocast: autocast would use the same bf16 matmul weights
    # but keep fp32 embeddings, norm weights and residual stream, which inference does not have. The probe checks
    # that inference serves exactly the published tensors, so it must compute what inference computes.
    probe = {"token_ids": probe_token_ids, "logprobs": compute_probe_logprobs(published, probe_token_ids)}
    del published
    atomic_write_text(tmp_dir / PROBE, json.dumps(probe))
    atomic_write_text(tmp_dir / READY, f"{step}\n")
    make_world_readable(tmp_dir)
    commit_dir(tmp_dir, final_dir)

    if keep_last is not None:
        prune_weights(output_dir, keep_last)
    return final_dir


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` itself if its parameters are already `dtype`, else a copy whose parameters are cast to `dtype`
    (tied parameters stay tied; buffers are copied as they are). The float32 masters are never copied in full:
    each parameter is cast straight into the copy, so the extra memory is one model in `dtype`."""
    params = list(model.parameters())
    if all(p.dtype == dtype for p in params):
        return model
    # deepcopy takes objects already in its memo as their copies: pre-seed it with the cast parameters.
    memo = {id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in params}
    return copy.deepcopy(model, memo)


def make_world_readable(root: Path) -> None:
    """chmod directories 0755 and files 0644 under `root` (inclusive), so servers run by other users can read
    them whatever the trainer's umask."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def prune_weights(output_dir: Path, keep_last: int) -> list[Path]:
    """Delete published step directories except the newest `keep_last`; return the deleted ones."""
    root = Path(output_dir) / "weights"
    steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name)))
    deleted = [weights_dir(output_dir, s) for s in steps[:-keep_last]]
    for path in deleted:
        shutil.rmtree(path)
    return deleted
