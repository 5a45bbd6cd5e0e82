"""Publish the policy after step N as `weights/step_N/`: HF safetensors + config + tokenizer + probe.json + READY.

The directory is written under a temporary name and renamed into place, so readers never see a partial one.
Weights are published cast to the served dtype, and probe numerics follow the published dtype: the probe is
computed from the very (cast) tensors written to disk, so it matches what inference serves. Our models are
exported to the HF checkpoint layout (sharded safetensors) with the config of the folder they were loaded from.
With several ranks, the full state dict is gathered to rank 0 (`gather_full_state_dict`) which publishes.
"""

import copy
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from slipstream.trainer.data import PackedMicroBatch
from slipstream.trainer.logprobs import compute_logprobs, is_custom_model
from slipstream.transport.weights import PROBE, READY, weights_dir
from slipstream.utils.fs import atomic_write_text, commit_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_STEP_RE = re.compile(r"^step_(\d+)$")
GENERATION_CONFIG = "generation_config.json"
MAX_SHARD_SIZE = "5GB"
"""Largest safetensors file of a published checkpoint of our models (larger ones are sharded, with an index)."""


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
    source_dir: Path | None = None,
) -> Path:
    """Write `weights/step_{step}` atomically, with the weights cast to `dtype`, and return it; with `keep_last`,
    delete all but the newest `keep_last` published steps afterwards (default: keep all). Files are 0644.

    `model` is a whole (unsharded) model: transformers' (saved with save_pretrained) or ours (exported to the HF
    layout). `source_dir`, the HF folder the model was loaded from, provides generation_config.json, and config.json
    for our models (required for them)."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None (got {keep_last})")
    final_dir = weights_dir(output_dir, step)
    tmp_dir = final_dir.parent / f".tmp_{final_dir.name}_{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)

    published = cast_model(model, dtype)
    if is_custom_model(published):
        if source_dir is None:
            raise ValueError("publishing one of our models needs source_dir, the HF folder it was loaded from")
        save_custom_model(published, Path(source_dir), tmp_dir, dtype)
    else:
        published.save_pretrained(tmp_dir)
    if source_dir is not None and (Path(source_dir) / GENERATION_CONFIG).is_file():
        # Sampling defaults inference reads: those of the model folder, however the model was rebuilt.
        shutil.copyfile(Path(source_dir) / GENERATION_CONFIG, tmp_dir / GENERATION_CONFIG)
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


def save_custom_model(model: nn.Module, source_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write one of our models as an HF checkpoint: sharded safetensors (+ index when sharded) and the config.json
    of `source_dir` with `dtype`."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from slipstream.models.registry import export_hf_state_dict

    state_dict = export_hf_state_dict(model)
    split = split_torch_state_dict_into_shards(state_dict, max_shard_size=MAX_SHARD_SIZE)
    for file_name, names in split.filename_to_tensors.items():
        # Exported tensors may be views sharing storage (unstacked experts), which safetensors refuses: clone
        # them, one shard at a time.
        save_file({k: state_dict[k].clone() for k in names}, out_dir / file_name, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": _total_bytes(state_dict)}, "weight_map": split.tensor_to_filename}
        atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True))
    hf_config = AutoConfig.from_pretrained(source_dir)
    hf_config.dtype = dtype
    hf_config.save_pretrained(out_dir)


def _total_bytes(state_dict: dict[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def gather_full_state_dict(policy: nn.Module) -> dict[str, Tensor]:
    """Collective (every rank calls it): the wrapped model's full state dict, unsharded, on the CPU at rank 0
    (an empty dict on the other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from slipstream.trainer.policy import strip_wrapped_prefix

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return strip_wrapped_prefix(get_model_state_dict(policy, options=options))


def build_published_model(
    state_dict: dict[str, Tensor], hf_config, impl: str, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """A whole model of `impl` ("custom" or "hf") on `device` holding `state_dict` cast to `dtype`, to publish."""
    from slipstream.models.registry import build_model

    state_dict = {k: v.to(device=device, dtype=dtype) for k, v in state_dict.items()}
    if impl == "custom":
        with torch.device("meta"):
            model = build_model(hf_config, impl)
        model.load_state_dict(state_dict, strict=True, assign=True)
        return model
    # transformers models keep non-persistent buffers (rotary inv_freq) out of the state dict: build them for real.
    with torch.device(device):
        model = build_model(hf_config, impl).to(dtype)
    model.load_state_dict(state_dict, strict=True)
    return model


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` itself if its parameters are already `dtype`, else a copy whose parameters are cast to `dtype`
    (tied parameters stay tied; buffers are copied as they are). The float32 masters are never copied in full:
    each parameter is cast straight into the copy, so the extra memory is one model in `dtype`."""
    params = list(model.parameters())
    if all(p.dtype == dtype for p in params):
        return model
    if is_custom_model(model):
        # Rebuilt rather than deep-copied: our MoE layers keep the last forward's statistics, which can be tensors
        # of an autograd graph (deepcopy refuses those); checkpoint wrappers are left out of the copy too.
        with torch.device("meta"):
            copy_ = type(model)(model.args)
        state_dict = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
        copy_.load_state_dict(state_dict, strict=True, assign=True)
        return copy_
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
