"""Slipstream's vLLM weight-transfer engine (backend `slipstream`, registered by inference/vllm_plugin.py): vLLM's RL
API (/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update) drives it, and it
receives each version by broadcast from trainer rank 0 (gloo on CPU, NCCL on GPU), from the trainer's shared memory
(the ipc transport) or from a published folder.

Weights arrive in checkpoint (Hugging Face) format and go through vLLM's layer-wise reload: start_weight_update
prepares it, every received bucket is handed to `model.load_weights`, finish_weight_update processes the layers and,
on builds that keep a packed copy of a tied LM head, refreshes that copy (refresh_tied_modules).

The first version's loads are watched (weights/receive/copy_plan.py): when vLLM only copied the received bytes into the
model's parameters (bf16 on GPU), later versions replay those copies (one fused copy per bucket), without vLLM's
loaders or its layer-wise reload; pieces of several trainer ranks are copied straight from the buffer they arrived
in, without being laid out whole first. Otherwise (vLLM's CPU build repacks linear weights; quantized layers transform
them) every version keeps going through vLLM, and the log says why once. `SLIPSTREAM_WEIGHT_COPY_PLAN=0` turns the
replay off.

No-stall updates (`weights.no_stall`): /update_weights with `"stage": true` only starts receiving the version in a
background thread (weights/receive/staging.py) and returns, so vLLM keeps generating with the version before; nothing
touches the model until /finish_weight_update, which waits for the thread (normally done) and loads the staged buckets
(copy-plan replay, else vLLM's layer-wise reload: initialize, load_weights, finalize, refresh_tied_modules, then
check_loaded), all in that one call, between two engine steps. So a version's loads are prepared (the layer-wise
reload initialized, which moves parameters to the meta device) where its first load begins, not at
start_weight_update.
"""

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferUpdateInfo,
)

from slipstream.weights.receive.copy_plan import PlanMismatch, PlannedLoads
from slipstream.weights.receive.receiver import WeightReceiver, check_loaded
from slipstream.weights.receive.staging import StagedVersion, Stager
from slipstream.weights.wire.bucket_assembly import BucketAssembler
from slipstream.weights.wire.collective import GroupInit
from slipstream.weights.wire.stream import BroadcastSink, Bucket, Manifest

logger = logging.getLogger(__name__)
SWAP_LOG = "slipstream weight transfer: swapped in version %d in %.4f s (of which %.4f s waiting for its staging)"
"""Logged at each staged version's swap (weights.no_stall): the time from /finish_weight_update's start in the worker
until the staged weights are live on the device, the time vLLM did not generate (benchmarks/gpu_loop.py reads it)."""


@dataclass
class SlipstreamUpdateInfo(WeightTransferUpdateInfo):
    """One version: from a folder (`path`), by broadcast (`manifest`, the bucket plan) or from the trainer's shared
    memory (`manifest` and `shared`); version 0 also from the model's own checkpoint folder (`model`)."""

    step: int
    path: str | None = None
    model: str | None = None
    """The model's checkpoint folder: its initial weights, loaded back on a server that served another run's."""
    manifest: dict[str, Any] | None = field(default=None)
    shared: dict[str, Any] | None = field(default=None)
    """The `ipc` transport: the handle of the trainer's buffer holding the manifest's buckets
    (weights/wire/shared_buffer.py)."""
    stage: bool = False
    """`weights.no_stall`: receive the broadcast in the background and load it at /finish_weight_update."""


class SlipstreamWeightTransferEngine(WeightTransferEngine[GroupInit, SlipstreamUpdateInfo]):
    init_info_cls = GroupInit
    """How this worker joins the trainer's group: weights.wire.collective.GroupInit (validated on parsing)."""
    update_info_cls = SlipstreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        parallel = vllm_config.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.receiver = WeightReceiver(torch.device(device), rank_in_receivers=rank)
        self._tied: list[list[str]] = []
        self._loaded: set[str] = set()
        self.loads = PlannedLoads(enabled=os.environ.get(COPY_PLAN_ENV, "1") != "0")
        self._layerwise = False
        self._prepared = False
        """The version's loads began (the copy plan asked, vLLM's layer-wise reload initialized if it loads)."""
        self.stager = Stager(self.receiver)

    def init_transfer_engine(self, init_info: GroupInit) -> None:
        self.stager.release()
        self.receiver.join(init_info)
        logger.info(
            "slipstream weight transfer: joined session %s (%s, %d receive buffers)",
            init_info.session,
            init_info.backend,
            init_info.receive_buffers,
        )

    def start_weight_update(self) -> None:
        if self._layerwise:
            self._close_unfinished()
        self.stager.abandon()  # a version staged by an update that never finished
        self._tied = shared_parameter_groups(self.model)
        self._loaded = set()
        self._layerwise = False
        self._prepared = False

    def _prepare(self, manifest: dict[str, Any] | None) -> None:
        """The version's loads begin: replay the copy plan if it still fits `manifest`'s buckets, else vLLM's
        layer-wise reload (which moves the parameters to the meta device until finish: never while staging)."""
        if self._prepared:
            return
        self._prepared = True
        if not self.loads.start(lambda: model_tensors(self.model)):
            self._load_through_vllm()
        elif manifest is not None:
            buckets = Manifest.from_dict(manifest).buckets
            if not self.loads.expect([tuple(t.name for t in b.tensors) for b in buckets]):
                logger.info("slipstream weight transfer: other buckets than the copy plan's; loading through vLLM")
                self._load_through_vllm()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default synchronises torch.accelerator, which raises on CPU; the receiver syncs CUDA itself.
        info = self.parse_update_info(update_info)
        if info.stage:
            self.stager.start({k: v for k, v in asdict(info).items() if v is not None and k != "stage"})
            return  # vLLM generates on while the version streams in; finish_weight_update swaps it in
        self.receive_weights(info)

    def receive_weights(self, update_info: SlipstreamUpdateInfo) -> None:
        info = {k: v for k, v in asdict(update_info).items() if v is not None and k != "stage"}
        self._prepare(update_info.manifest)
        stats = self.receiver.receive(info, self._load, self._load_wire)
        logger.info("slipstream weight transfer: %s", stats.to_dict())
        check_loaded(stats, self._loaded)  # every tensor received went to the model (else HTTP 500, run stops)

    def _swap(self) -> StagedVersion:
        """Load the staged version into the model (inside finish_weight_update, before vLLM's layer-wise reload is
        finalized): every bucket from staging memory, then the same completeness check as a paused load."""
        staged = self.stager.take()
        logger.info("slipstream weight transfer: staged %s", staged.stats.to_dict())
        self._prepare(staged.manifest.to_dict())
        for pairs in staged.buckets:
            self._load(pairs)
        check_loaded(staged.stats, self._loaded)
        return staged

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self._loaded.update(name for name, _ in pairs)
        if self.loads.replaying():
            try:
                self.loads.replay(pairs)
                return
            except PlanMismatch as e:
                self._leave_plan(e)
        with self.loads.call(pairs):
            self.model.load_weights(pairs)
            copied = keep_deferred_loads(pairs)
        if copied:
            logger.debug("slipstream weight transfer: kept %d bytes of layers not complete yet", copied)

    def _load_wire(self, bucket: Bucket, wire: torch.Tensor) -> bool:
        """Several trainer ranks' pieces of a bucket: replay the copy plan straight from the wire buffer, which saves
        laying the bucket out whole first (a copy of every byte). False: lay it out and `_load` it."""
        if not self.loads.replaying():
            return False
        names = tuple(t.name for t in bucket.tensors)
        try:
            if not self.loads.replay_wire(names, bucket.layout, wire):
                return False
        except PlanMismatch as e:
            self._leave_plan(e)
            return False
        self._loaded.update(names)
        return True

    def _leave_plan(self, mismatch: PlanMismatch) -> None:
        """The copy plan does not fit this version: vLLM's loaders take it, watched (only at a version's first
        bucket; later, `record_instead` raises and the version fails)."""
        self.loads.record_instead()
        logger.info("slipstream weight transfer: %s; this version loads through vLLM", mismatch)
        self._load_through_vllm()

    def _load_through_vllm(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._layerwise = True

    def _close_unfinished(self) -> None:
        """The version before never finished: its load failed midway (an incomplete version stops its run) on a server
        that outlived the run. vLLM's layer-wise reload is still open, the unloaded layers' parameters on the meta
        device: close it (those layers get their previous tensors back) so this version starts from a whole model,
        and drop what was recorded of it for a copy plan."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        logger.warning("slipstream weight transfer: the weight update before this one never finished; closing it first")
        self.loads.abandon()
        finalize_layerwise_reload(self.model, self.model_config)
        self._layerwise = False

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        start = time.perf_counter()
        staged = self._swap() if self.stager.active else None
        if self._layerwise:
            with self.loads.finish():
                finalize_layerwise_reload(self.model, self.model_config)
                refreshed = refresh_tied_modules(self.model, self._tied, self._loaded)
            if refreshed:
                logger.info("slipstream weight transfer: refreshed tied modules %s", refreshed)
        self._layerwise = False
        if self._prepared:
            self._prepared = False
            line = self.loads.end(model_tensors(self.model))
            if line:
                logger.info("slipstream weight transfer: %s", line)
        if staged is not None:
            # the copies queued on the device are done before the clock stops: the time vLLM did not generate
            if self.receiver.device.type == "cuda":
                torch.cuda.synchronize(self.receiver.device)
            logger.info(
                SWAP_LOG,
                staged.stats.step,
                time.perf_counter() - start,
                staged.waited_s,
            )

    def shutdown(self) -> None:
        self.stager.release()
        self.receiver.shutdown()

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: dict[str, Any]) -> None:
        """vLLM's trainer-side hook (abstract on the engine up to vLLM 0.26; later releases moved the trainer side
        to a class of its own). Slipstream's trainer sends through weights/send/publish.py, which also shards, pipelines
        and offers versions; this is the plain form for a caller of vLLM's API: broadcast `iterator`'s (HF name,
        tensor) pairs from rank 0 of `trainer_args["group"]` (a torch ProcessGroup the receivers joined through
        /init_weight_transfer_engine) in the buckets of `trainer_args["manifest"]` (a Manifest or its dict, the one
        given to /update_weights), cast to each bucket's dtype. Raises if the pairs disagree with the manifest."""
        manifest = trainer_args["manifest"]
        if isinstance(manifest, dict):
            manifest = Manifest.from_dict(manifest)
        if any(bucket.senders != 1 for bucket in manifest.buckets):
            raise ValueError("trainer_send_weights sends whole buckets from one rank: the manifest has pieces")
        device = torch.device(trainer_args.get("device", "cpu"))
        assembler = BucketAssembler(list(manifest.buckets), [BroadcastSink(trainer_args["group"], device)])
        for name, tensor in iterator:
            assembler.add(name, tensor.detach())
        assembler.finish()


COPY_PLAN_ENV = "SLIPSTREAM_WEIGHT_COPY_PLAN"
"""`0`: every version loads through vLLM's loaders (no copy plan)."""


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The model's parameters and buffers: where a copy plan may write."""
    return [*model.parameters(), *model.buffers()]


def keep_deferred_loads(pairs: list[tuple[str, torch.Tensor]]) -> int:
    """vLLM's layer-wise reload does not copy a tensor when its loader is called: it keeps the tensor until its layer's
    last weight has arrived (or until finish, for a layer never complete, such as a padded vocabulary), then loads
    them all. A layer's weights can straddle buckets (q_proj at the end of one, k_proj and v_proj in the next; a MoE
    layer's experts span several), and the receiver reuses a bucket's buffer for the bucket after next, which it starts
    receiving as soon as the next bucket is handed over: a kept view would then be read after it was overwritten. So
    every tensor still kept after this bucket's loads that lives in this bucket's buffer is replaced by a copy of its
    own. Returns the bytes copied (0 when every layer of the bucket completed within it)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    buffers = {tensor.untyped_storage().data_ptr() for _, tensor in pairs if tensor.device.type != "meta"}
    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    if value.untyped_storage().data_ptr() in buffers:
                        bound.arguments[key] = value.clone()
                        copied += value.numel() * value.element_size()
    return copied


def shared_parameter_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that share storage (tied embeddings), grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(param.data_ptr(), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def refresh_tied_modules(model: torch.nn.Module, groups: list[list[str]], loaded: set[str]) -> list[str]:
    """A tied parameter (lm_head = embed_tokens) arrives once in the checkpoint, so vLLM's layer-wise reload
    never re-processes the module that uses the other name; on the CPU build that module keeps a packed copy
    of the OLD weight for its GEMM. Re-run its post-load processing. Returns the refreshed module names."""
    params = dict(model.named_parameters(remove_duplicate=False))
    refreshed = []
    for group in groups:
        if len({params[n].data_ptr() for n in group}) != 1:
            raise RuntimeError(f"tied parameters {group} no longer share storage after the weight reload")
        for name in group:
            if name in loaded:
                continue
            module = model.get_submodule(name.rpartition(".")[0])
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                refreshed.append(name.rpartition(".")[0])
    return refreshed
