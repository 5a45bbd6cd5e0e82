"""Publish the policy after every step as weight version N, streamed layer by layer (trainer/weight_export.py):

- `filesystem`: into `weights/step_N/` as safetensors shards + config + tokenizer + probe.json + READY, built under a
  temporary name and renamed into place;
- `nccl` / `gloo`: offered by broadcast (transport/weight_offers.py); rank 0 sends each bucket as soon as it is
  gathered, while the next layer is being gathered. Checkpoint steps (and the last step) are also written to disk,
  since resume and users need them there.

Every rank gathers (FSDP collectives); rank 0 writes and sends. The probe (log-probs of a fixed text) is computed
from the published dtype's weights, so the orchestrator can check that inference serves exactly them.
"""

import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from slipstream.config.trainer import TrainerConfig
from slipstream.trainer.lora_export import MERGED_DIR, adapter_plan, gather_adapter, write_peft_adapter
from slipstream.trainer.setup import Trainer
from slipstream.trainer.weight_export import HFWeightStream
from slipstream.trainer.weights import (
    PublishedFiles,
    cast_model,
    compute_probe_logprobs,
    make_world_readable,
    write_weights_folder,
)
from slipstream.transport.bucket_assembly import BucketBuffers, stream_to
from slipstream.transport.checkpoints import is_checkpoint_step
from slipstream.transport.collective import GroupInit, close_group, open_group, open_store
from slipstream.transport.weight_offers import (
    MANIFEST,
    OFFER,
    Accept,
    mark_delivered,
    wait_for_accept,
)
from slipstream.transport.weight_stream import (
    BroadcastSink,
    BucketSink,
    Manifest,
    SafetensorsSink,
    TolerantSink,
    plan_buckets,
)
from slipstream.transport.weights import PROBE, READY, weights_dir
from slipstream.utils.fs import atomic_write_text, commit_dir

log = logging.getLogger(__name__)


def resolve_transport(transport: str, device: torch.device) -> str:
    """`auto`: nccl when the trainer runs on CUDA, else filesystem."""
    if transport == "auto":
        return "nccl" if device.type == "cuda" else "filesystem"
    return transport


class WeightPublisher:
    """Publishes weight versions for one trainer process (every rank has one; rank 0 does the writing/sending).

    With `model.lora` and `adapters` (the RL trainer) a version is the LoRA adapter alone, written as a PEFT folder
    (trainer/lora_export.py) that inference loads in place; without `adapters` (SFT's final export) it is the merged
    model."""

    def __init__(self, trainer: Trainer, config: TrainerConfig, adapters: bool = False) -> None:
        self.trainer, self.config = trainer, config
        self.lora = config.model.lora if adapters else None
        self.adapter_plan = adapter_plan(trainer.model) if self.lora is not None else None
        # An adapter is small: it always goes through the filesystem (vLLM's LoRA loader reads a folder).
        self.transport = "filesystem" if self.lora else resolve_transport(config.weights.transport, trainer.device)
        self.bucket_bytes = config.weights.bucket_mb << 20
        self.store = None
        self.group = None
        self.session: str | None = None
        self.refused: set[str] = set()
        if self.transport in ("nccl", "gloo") and trainer.info.is_main:
            w = config.weights
            port = w.store_port("the trainer's weight transfer")
            self.store = open_store(w.master_addr, port, is_master=True, timeout_s=w.accept_timeout_s)
        self.files = PublishedFiles(trainer.hf_config, trainer.compute_dtype, trainer.tokenizer, trainer.model_dir)
        self.stream = HFWeightStream(trainer.model, trainer.compute_dtype)  # the per-layer plan, built once
        self.buckets = tuple(plan_buckets(self.stream.metas(), self.bucket_bytes))
        self.buffers = BucketBuffers()
        """Rank 0's bucket buffers (3 buckets of `weights.bucket_mb`), kept from one version to the next."""

    @property
    def is_main(self) -> bool:
        return self.trainer.info.is_main

    def publish(self, step: int) -> dict[str, float]:
        """Publish version `step`; returns metrics (bytes, seconds, attempts)."""
        start = time.perf_counter()
        probe = probe_logprobs(self.trainer)
        stream = self.stream
        manifest = Manifest(step, self.buckets)
        t_probe = time.perf_counter()
        if self.lora is not None:
            return self._publish_adapter(step, probe) | {"weights/probe_s": t_probe - start}
        if self.transport == "filesystem":
            attempts = self._publish_files(step, stream, manifest, probe)
        else:
            attempts = self._publish_broadcast(step, stream, manifest, probe)
        seconds = time.perf_counter() - t_probe
        return {
            "weights/bytes": float(manifest.nbytes),
            "weights/send_s": seconds,
            "weights/send_gbps": manifest.nbytes / max(seconds, 1e-9) / 1e9,
            "weights/probe_s": t_probe - start,
            "weights/send_attempts": float(attempts),
        }

    def _publish_adapter(self, step: int, probe: dict) -> dict[str, float]:
        """`weights/step_N/` = the PEFT adapter + probe.json + READY, built under a temporary name (all ranks gather
        the adapters; rank 0 writes). The last step's folder also holds the merged model in `merged/` (a Hugging
        Face folder that `model.name` accepts)."""
        start = time.perf_counter()
        tensors = gather_adapter(self.adapter_plan, self.trainer.compute_dtype)
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = weights_dir(self.config.output_dir, step)
        tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if step == self.config.max_steps:  # every rank: the merged stream gathers FSDP shards
            manifest = Manifest(step, self.buckets)
            write_weights_folder(tmp / MERGED_DIR, self.stream, manifest, probe, self.files, self.is_main, self.buffers)
        if self.is_main:
            base = str(self.trainer.model_dir)
            write_peft_adapter(tmp, tensors, self.lora, self.adapter_plan, base)
            atomic_write_text(tmp / PROBE, _json(probe))
            atomic_write_text(tmp / READY, f"{step}\n")
            make_world_readable(tmp)
            commit_dir(tmp, folder)
        seconds = time.perf_counter() - start
        return {"weights/bytes": float(num_bytes), "weights/send_s": seconds, "weights/send_attempts": 1.0}

    def _keeps_files(self, step: int) -> bool:
        c = self.config
        if self.transport == "filesystem" or step == c.max_steps:
            return True  # the trained model stays on disk for users, evaluation and resume
        return is_checkpoint_step(step, c.checkpoint.interval, c.max_steps)

    def _publish_files(self, step: int, stream: HFWeightStream, manifest: Manifest, probe: dict) -> int:
        folder = weights_dir(self.config.output_dir, step)
        write_weights_folder(folder, stream, manifest, probe, self.files, self.is_main, self.buffers)
        return 1

    def _publish_broadcast(self, step: int, stream: HFWeightStream, manifest: Manifest, probe: dict) -> int:
        folder = weights_dir(self.config.output_dir, step)
        files = self._keeps_files(step)
        if self.is_main:
            self._write_offer(folder, manifest, probe)
        attempts = 0
        while True:
            attempts += 1
            if self.is_main:
                self._join(
                    wait_for_accept(self.config.output_dir, step, self.refused, self.config.weights.accept_timeout_s)
                )
            sinks: list[BucketSink] = []
            sender = None
            if self.is_main:
                sender = TolerantSink(BroadcastSink(self.group, self.trainer.device))
                sinks.append(sender)
                if files:
                    sinks.append(SafetensorsSink(folder, len(manifest.buckets)))
            stream_to(stream, manifest, sinks, self.buffers)
            ok = self._agree(sender is None or sender.error is None)
            if ok:
                break
            if self.is_main:
                log.warning(
                    f"sending the weights of step {step} failed ({sender.error}); waiting for inference to take "
                    "them again"
                )
                self.refused.add(self.session)
                close_group(self.group)
                self.group, self.session = None, None
        if self.is_main:
            mark_delivered(self.config.output_dir, step, self.session or "")
            if files:
                self.files.write(folder, manifest, probe)
                atomic_write_text(folder / READY, f"{step}\n")
                make_world_readable(folder)
        return attempts

    def _write_offer(self, folder: Path, manifest: Manifest, probe: dict) -> None:
        """Create `weights/step_N/` holding the manifest, probe and OFFER marker (atomically)."""
        tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        atomic_write_text(tmp / MANIFEST, manifest.to_json())
        atomic_write_text(tmp / PROBE, _json(probe))
        atomic_write_text(tmp / OFFER, _json({"step": manifest.step, "backend": self.transport}))
        make_world_readable(tmp)
        commit_dir(tmp, folder)

    def _join(self, accept: Accept) -> None:
        """Use the group of the accepted session, building it (and dropping an older one) when it is new."""
        if accept.session == self.session and self.group is not None:
            return
        close_group(self.group)
        w = self.config.weights
        init = GroupInit(self.transport, w.master_addr, w.store_port("the trainer"), accept.session, accept.world_size)
        self.group = open_group(self.store, init, 0, self.trainer.device)
        self.session = accept.session

    def _agree(self, ok: bool) -> bool:
        """Rank 0's verdict on an attempt, shared with every rank (they repeat the gather if it failed)."""
        if self.trainer.world_size == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], device=self.trainer.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def close(self) -> None:
        close_group(self.group)
        self.group, self.store = None, None


@torch.no_grad()
def probe_logprobs(trainer: Trainer) -> dict:
    """{"token_ids", "logprobs"} of the probe in the published dtype. One rank: on a copy cast to that dtype (what
    inference computes). Several ranks: through the sharded policy (a collective; FSDP gathers each block)."""
    token_ids = trainer.probe_token_ids
    if trainer.world_size == 1:
        return {
            "token_ids": token_ids,
            "logprobs": compute_probe_logprobs(cast_model(trainer.model, trainer.compute_dtype), token_ids),
        }
    device = trainer.device
    ids_T = torch.tensor(token_ids, dtype=torch.long, device=device)
    was_training = trainer.policy.training
    trainer.policy.eval()
    try:
        logprobs_T, _ = trainer.policy(
            ids_T, torch.arange(len(token_ids), device=device), torch.ones(len(token_ids), device=device)
        )
    finally:
        trainer.policy.train(was_training)
    return {"token_ids": token_ids, "logprobs": logprobs_T[1:].float().tolist()}


def _json(data: dict) -> str:
    import json

    return json.dumps(data)
