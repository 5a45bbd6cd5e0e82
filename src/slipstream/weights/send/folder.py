"""Published weight folders `weights/step_N/`: HF safetensors shards (the weight stream written to disk, see
weights/send/export.py) + config + tokenizer + probe.json + manifest.json + READY, built under a temporary name and
renamed into place, so readers never see a partial one; and the probe: log-probs of a fixed text computed in the
published dtype (not under the trainer's autocast), so that it matches what inference serves.
"""

import copy
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from slipstream.trainer.data import PackedMicroBatch
from slipstream.trainer.logprobs import compute_logprobs, is_custom_model
from slipstream.utils.fs import atomic_write_text, commit_dir
from slipstream.weights.wire.published import PROBE, READY, weights_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

GENERATION_CONFIG = "generation_config.json"
DEFAULT_BUCKET_BYTES = 512 << 20
"""Default weight-stream bucket (and safetensors shard) size (config: weights.bucket_mb)."""


def build_probe_token_ids(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """Token ids of the probe text (with the tokenizer's default special tokens); needs at least 2 tokens."""
    token_ids = list(tokenizer(text)["input_ids"])
    if len(token_ids) < 2:
        raise ValueError(f"probe.text {text!r} has {len(token_ids)} token(s); use a text of at least 2 tokens")
    return token_ids


@torch.no_grad()
def compute_probe_logprobs(
    model: nn.Module, token_ids: list[int], head_dtype: torch.dtype | None = None
) -> list[float]:
    """logprobs[i] = log p(token_ids[i + 1] | token_ids[: i + 1]) at temperature 1, in eval mode, computed in the
    model's own parameter dtype (no autocast), the logits in `head_dtype` if given (model.head_dtype); the LM-head
    log-softmax is float32."""
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
        logprobs_T, _ = compute_logprobs(model, mb, head_dtype=head_dtype)
    finally:
        model.train(was_training)
    return logprobs_T[1:].tolist()


def publish_weights(
    model: nn.Module,
    tokenizer: "PreTrainedTokenizerBase",
    output_dir: Path,
    step: int,
    probe_token_ids: list[int],
    dtype: torch.dtype = torch.float32,
    source_dir: Path | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Path:
    """Write `weights/step_{step}` of a whole (unsharded) model, ours or transformers', atomically, with the weights
    cast to `dtype`, and return it. `source_dir`, the HF folder the model was loaded from, provides config.json and
    generation_config.json (required for our models; transformers' models carry their config)."""
    from slipstream.weights.send.export import HFWeightStream
    from slipstream.weights.wire.stream import Manifest, plan_buckets

    hf_config = model_hf_config(model, source_dir)
    probe = {
        "token_ids": probe_token_ids,
        "logprobs": compute_probe_logprobs(cast_model(model, dtype), probe_token_ids),
    }
    stream = HFWeightStream(model, dtype)
    manifest = Manifest(step, tuple(plan_buckets(stream.metas(), bucket_bytes)))
    files = PublishedFiles(hf_config, dtype, tokenizer, source_dir)
    return write_weights_folder(weights_dir(output_dir, step), stream, manifest, probe, files, is_main=True)


class PublishedFiles:
    """What a published folder holds besides the tensors: config (in the published dtype), generation config,
    tokenizer."""

    def __init__(self, hf_config, dtype: torch.dtype, tokenizer, source_dir: Path | None) -> None:
        self.hf_config, self.dtype, self.tokenizer, self.source_dir = hf_config, dtype, tokenizer, source_dir

    def write(self, folder: Path, manifest, probe: dict) -> None:
        from slipstream.weights.wire.offers import MANIFEST

        config = copy.deepcopy(self.hf_config)
        config.dtype = self.dtype
        config.save_pretrained(folder)
        if self.source_dir is not None and (Path(self.source_dir) / GENERATION_CONFIG).is_file():
            # Sampling defaults inference reads: those of the model folder, however the model was rebuilt.
            shutil.copyfile(Path(self.source_dir) / GENERATION_CONFIG, folder / GENERATION_CONFIG)
        self.tokenizer.save_pretrained(folder)
        atomic_write_text(folder / PROBE, json.dumps(probe))
        atomic_write_text(folder / MANIFEST, manifest.to_json())


def model_hf_config(model: nn.Module, source_dir: Path | None):
    """The transformers config to publish with `model`: the source folder's, else the model's own."""
    if source_dir is not None:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(source_dir)
    if is_custom_model(model) or not hasattr(model, "config"):
        raise ValueError("publishing one of our models needs source_dir, the HF folder it was loaded from")
    return model.config


def write_weights_folder(
    final_dir: Path, stream, manifest, probe: dict, files: PublishedFiles, is_main: bool, buffers=None, sinks=()
) -> Path:
    """Stream the weights into a temporary folder (rank 0 writes; every rank iterates `stream`, whose gathers are
    collectives), add the other files and READY, and rename it to `final_dir`. `buffers`: the caller's
    BucketBuffers, kept from one version to the next; `sinks`: more bucket sinks of rank 0 (weights/send/changes.py)."""
    from slipstream.weights.wire.bucket_assembly import stream_to
    from slipstream.weights.wire.stream import SafetensorsSink

    if not is_main:
        stream_to(stream, manifest, [])
        return final_dir
    tmp_dir = final_dir.parent / f".tmp_{final_dir.name}_{os.getpid()}"
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    tmp_dir.mkdir(parents=True)
    stream_to(stream, manifest, [SafetensorsSink(tmp_dir, len(manifest.buckets)), *sinks], buffers)
    files.write(tmp_dir, manifest, probe)
    atomic_write_text(tmp_dir / READY, f"{manifest.step}\n")
    make_world_readable(tmp_dir)
    commit_dir(tmp_dir, final_dir)
    return final_dir


def cast_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` itself if its parameters are already `dtype`, else a copy whose parameters are cast to `dtype`
    (tied parameters stay tied; buffers are copied as they are; tensors the model keeps in float32 stay float32).
    The float32 masters are never copied in full: each parameter is cast straight into the copy, so the extra
    memory is one model in `dtype`."""
    from slipstream.models.common.lora import has_lora, merged_state_dict
    from slipstream.weights.send.export import is_kept_in_fp32, keep_in_fp32

    params = list(model.parameters())
    if all(p.dtype == dtype for p in params):
        return model
    if is_custom_model(model):
        # Rebuilt rather than deep-copied: our MoE layers keep the last forward's statistics, which can be tensors
        # of an autograd graph (deepcopy refuses those); checkpoint wrappers are left out of the copy too.
        with torch.device("meta"):
            copy_ = type(model)(model.args)
        kept = keep_in_fp32(model)
        # LoRA: the copy is the merged model (W + s B A), the same function as the adapted one.
        source = merged_state_dict(model) if has_lora(model) else model.state_dict()
        state_dict = {k: v.detach().to(torch.float32 if is_kept_in_fp32(k, kept) else dtype) for k, v in source.items()}
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
