"""Config of the weight path from trainer to inference: transport, buckets, rendezvous, and which published weights
are kept on disk."""

from typing import Literal

from pydantic import Field, model_validator

from slipstream.config.base import BaseConfig


class DeltaConfig(BaseConfig):
    """Delta updates (`[weights.delta]`): each bucket of a version goes either whole or as the elements that changed
    since the version before (an int32 index and the new value each), whichever is smaller, with a checksum of the
    bucket's full new bytes; inference applies a delta onto its copy of the version before and loads the whole bucket
    only once the checksum matches, so it loads exactly what a full send carries. A bucket that fails (a corrupted
    delta, a stale copy) goes again whole within the same update.

    Costs one copy of the published weights on trainer rank 0's device and one on every inference worker's (the
    version before), a comparison of every bucket on rank 0 and a checksum of every bucket on both sides. Rank 0 sends
    every bucket after gathering it (delta updates do not use every rank sending its own rows). Runs on the broadcast
    transports (`nccl` on GPUs, `gloo` on CPUs); not with `model.lora` (adapters go through files)."""

    enabled: bool = False
    """Send versions as deltas (needs weights.transport = "nccl" or "gloo")."""

    full_every: int = Field(10, ge=1)
    """Every this many versions one goes whole, whatever changed (1: every version). A version also goes whole when
    it is the first, when inference restarted or reconnected (a new transfer session), when the bucket plan changed,
    and after an attempt that failed."""


class WeightsConfig(BaseConfig):
    """How the trainer's weights reach inference after every step (set once at the top level of `slipstream rl`).

    The trainer streams the model in Hugging Face names (never the whole model on one device), in dtype-grouped
    buckets. `filesystem` writes the stream as safetensors shards into `weights/step_N/` (+ READY); `nccl` / `gloo`
    broadcast it to every inference worker through vLLM's weight-transfer API (Slipstream's engine, registered as the
    vLLM weight-transfer backend `slipstream`): every trainer rank sends the rows it holds of each bucket when the
    model's sharding allows (FSDP2, or expert parallelism alone), else rank 0 sends after a gather. Every transport
    ends with the same probe check of the loaded weights."""

    transport: Literal["auto", "filesystem", "nccl", "gloo", "ipc"] = "auto"
    """`filesystem`: through files in the run directory (works everywhere, costs disk bandwidth). `nccl`: GPU to GPU
    broadcast (trainer and inference on CUDA). `gloo`: the same broadcast over TCP between CPU processes (the CPU twin
    of nccl). `ipc`: trainer and inference on one machine share the version's memory (CUDA IPC on a GPU, where NCCL
    cannot join two processes of one device, e.g. colocated; a shared-memory file on CPU): the trainer lays the
    version out in a buffer of the model's size (bf16 bytes) and inference copies it in place; the trainer writes the
    next version only once inference took this one. `auto`: nccl when the trainer runs on CUDA, else filesystem."""

    bucket_mb: int = Field(512, ge=1)
    """Size of one transfer bucket in MiB: tensors of one dtype are packed into flat buffers of at most this size
    (a tensor larger than a bucket travels alone). Each sending trainer rank keeps up to 3 such buffers (the model's
    largest bucket each) on its device between versions; each inference worker keeps `receive_buffers` (twice as
    many when several trainer ranks send) between versions, on top of vLLM's memory (gpu_memory_utilization leaves
    room for them)."""

    receive_buffers: int = Field(2, ge=2)
    """Bucket buffers each inference worker receives into (collective transports): it posts the receives of this
    many buckets minus one ahead of the bucket it is loading, so the trainer can send that far ahead of the worker's
    own loads. 2: the next bucket is received while this one loads. More lets the link run while a worker's host is
    slow to queue its loads (the paused loads of benchmarks/RESULTS.md's 2 x H200 runs: 3.1-7.0 ms of host time
    against 3.3 ms of link for Qwen3-0.6B's shape), at the cost of one largest bucket of device memory each."""

    edge_bucket_mb: int | None = Field(32, ge=1)
    """Where every trainer rank sends its own rows (collective transports; the stream need not follow the model's
    order there): the first buckets ramp up from this size in MiB, doubling up to `bucket_mb`, and the last ones
    ramp down to it, with embeddings and LM heads mid-stream. Nothing moves before the trainer has cast the first
    bucket, and a version is loaded only when inference has copied the last one, so both are kept small (Qwen3-0.6B's
    shape, 1 -> 1 H200: 0.75-0.77 -> 0.79-0.83 of raw NCCL bandwidth, benchmarks/RESULTS.md). None: every bucket
    up to `bucket_mb`, in the model's order (as the stream after a gather and the filesystem transport always are)."""

    delta: DeltaConfig = DeltaConfig()
    """Send each version as the elements that changed since the one before, checked by a checksum (off by default)."""

    no_stall: bool = False
    """Load each version without pausing inference (issue #40): every inference worker receives the version in the
    background into staging memory while vLLM keeps generating with the version before, and the swap (staged bytes
    copied into the model) runs inside /finish_weight_update, between two engine steps, so no step sees a mix of
    versions. vLLM stops generating only for the swap, not for the transfer. The first version of a transfer session
    (the first broadcast, and after inference restarted) still loads paused (counted in `weights/num_paused_updates`),
    as do versions loaded from disk (a restarted server's served version).

    Memory: one more copy of the published weights (in the published dtype) per inference worker, on its device, kept
    from one version to the next; none more with `weights.delta`, whose copy of the version before is the staging
    memory. A worker that cannot allocate it fails the update with an error that says so (the run stops; nothing was
    loaded): lower vLLM's memory share or set `weights.no_stall = false`. Needs `weights.transport = "nccl"` (GPUs:
    each worker queues its receives on a CUDA stream of its own, so generation never waits for them; not yet run on a
    GPU) or `"gloo"` (CPUs, where it is tested end to end); not with `model.lora` (adapters load from files) nor
    against the simulated inference server. Tokens are stamped with the new version from the swap's end
    (rollout/streaming.py says what that approximates)."""

    track_changes: bool = False
    """Measure how much of each version changed since the one before, as a delta update would send it (trainer rank 0,
    bitwise in the published dtype): `weights/changed_fraction` (elements whose bits differ), `weights/delta_bytes`
    and `weights/delta_ratio` (an int32 index + the new value per changed element, or the whole bucket when smaller;
    against `weights/bytes`). Costs one copy of the published weights on rank 0's device. Not where every trainer rank
    sends its own rows (collective transports with several trainer ranks) nor with `model.lora`: refused at start."""

    master_addr: str = "127.0.0.1"
    """Address the trainer's rendezvous store listens on (collective transports); inference workers connect to it.
    Use the trainer node's address when inference runs on other machines."""

    master_port: int = Field(0, ge=0, le=65535)
    """TCP port of the trainer's rendezvous store (collective transports). 0 (default): `slipstream rl` picks a port
    free on the trainer's node when it launches trainer and orchestrator there (two runs on one node never collide);
    set a fixed port when the trainer and the orchestrator are started separately (by hand, or on different nodes)."""

    @model_validator(mode="after")
    def _check_no_stall(self) -> "WeightsConfig":
        if self.no_stall and self.transport not in ("gloo", "nccl"):
            raise ValueError(
                f'weights.no_stall stages each version from a broadcast (weights.transport is "{self.transport}"; '
                'files and shared memory are read by the paused load): set weights.transport = "nccl" (GPUs) or '
                '"gloo" (CPUs), or weights.no_stall = false'
            )
        return self

    def check_no_stall_lora(self, lora: bool) -> None:
        """Refuse `no_stall` with `model.lora` (called by the configs that hold both)."""
        if self.no_stall and lora:
            raise ValueError(
                "weights.no_stall stages full-model versions from a broadcast, but with model.lora inference loads "
                "adapter folders (paused): set weights.no_stall = false"
            )

    @model_validator(mode="after")
    def _check_delta(self) -> "WeightsConfig":
        if not self.delta.enabled:
            return self
        if self.transport not in ("nccl", "gloo"):
            raise ValueError(
                f"weights.delta.enabled sends changed elements by broadcast (weights.transport is "
                f'"{self.transport}", which carries whole versions): set weights.transport = "nccl" (GPUs) or "gloo" '
                "(CPUs), or weights.delta.enabled = false"
            )
        if self.track_changes:
            raise ValueError(
                "weights.delta.enabled reports weights/changed_fraction and the bytes it sent itself, from the copy "
                "of the version before it keeps anyway: set weights.track_changes = false"
            )
        return self

    def store_port(self, who: str) -> int:
        """master_port, checked for a process that opens or announces the store (`who`, for the message)."""
        if self.master_port == 0:
            raise ValueError(
                f"{who}: weights.master_port is 0 (chosen by `slipstream rl` at launch), but this process was started "
                "without it; set --weights.master_port to a free TCP port, the same for trainer and orchestrator"
            )
        return self.master_port

    accept_timeout_s: float = Field(1500.0, gt=0.0, le=1800.0)
    """Collective transports: how long the trainer waits for inference to take an offered version (the orchestrator
    may hold updates during an online evaluation) before it fails with a message. At most 1800 s: the trainer's
    other ranks wait in a collective meanwhile, whose timeout is 30 minutes."""

    keep_weights: int = Field(0, ge=0)
    """Published `weights/step_N/` folders kept beyond those still needed (the served version, versions being loaded
    or verified, pending evaluations, and checkpoint steps resume needs); the rest are deleted as soon as inference
    serves a newer version. E.g. 2 also keeps the two newest published steps."""
