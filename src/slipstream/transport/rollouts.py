"""Training batches on the filesystem: `rollouts/step_N/rank_R.msgpack`, msgspec-encoded, written atomically.

Token arrays of a micro-batch are aligned with `input_ids`: entry t describes token t. Several samples are
packed into one micro-batch; `position_ids` restart at 0 where a new sample begins. Samples sharing a prompt may be
packed as a prefix tree (orchestrator.shared_prefix): the first sample whole, then each further sample's tokens
after the shared prefix, their positions continuing the prefix's (models/common/prefix_tree.py). A shared prefix
carries no loss and keeps the first sample's per-token values (router replay rows included).

Vision-language samples (format 2) carry their images: per sample, its token span in the micro-batch and the encoded
image files of its prompt, in the order of their placeholders; the trainer runs its image processor on them. A
sample with images is never part of a prefix tree.
"""

import time
from pathlib import Path

import msgspec

from slipstream.rundir import RunDir
from slipstream.utils.fs import atomic_write_bytes

BATCH_FORMAT_VERSION = 2
"""2: micro-batches may carry images (MicroBatch.images)."""


class Routing(msgspec.Struct, frozen=True):
    """Router replay: the experts inference routed each token of a micro-batch to, as raw C-order bytes of a
    [tokens, moe_layers, top_k] array of `dtype` ("uint8" or "uint16"); the dtype's largest value marks a token
    inference did not route (the trainer routes it itself). Kept binary: one byte per (token, layer, expert slot)
    for up to 255 experts."""

    data: bytes
    dtype: str
    num_layers: int
    top_k: int


class SampleImages(msgspec.Struct, frozen=True):
    """The images of one sample of a micro-batch: the sample is tokens [start, start + num_tokens) (position 0 at
    `start`); `images` are its prompt's image files (PNG from a data URL), in the order of their placeholder runs.
    Its tokens hold each image's placeholder already expanded (one `<|image_pad|>` per merged patch, as inference
    rendered the prompt)."""

    start: int
    num_tokens: int
    images: list[bytes]


class MicroBatch(msgspec.Struct, frozen=True):
    """Packed samples for one forward/backward pass."""

    input_ids: list[int]
    """Prompt and completion tokens of every sample, concatenated."""
    position_ids: list[int]
    """Position of each token inside its own sample (restarts at 0 per sample; in a prefix tree a further sample's
    first token continues at the position it has after the shared prefix)."""
    loss_mask: list[bool]
    """True where the token was sampled by the policy and carries loss."""
    advantages: list[float]
    """Advantage of the token's sample (0 where loss_mask is False)."""
    inference_logprobs: list[float]
    """Log-prob inference gave the token when sampling it (0 where loss_mask is False)."""
    temperatures: list[float]
    """Sampling temperature of the token (1.0 where loss_mask is False)."""
    routing: Routing | None = None
    """Router replay of the micro-batch's tokens (MoE models with orchestrator.router_replay); None: none."""
    images: list[SampleImages] | None = None
    """Vision-language models: the samples that hold images, in token order; None: no sample holds one."""


class TrainingBatch(msgspec.Struct, frozen=True):
    """One trainer rank's share of one step."""

    step: int
    rank: int
    num_loss_tokens: int
    """Loss tokens of the whole step across all ranks: the loss normaliser."""
    micro_batches: list[MicroBatch]
    metrics: dict[str, float] = {}
    """Orchestrator metrics of this step (rewards, lengths, policy lag), logged by the trainer."""
    format_version: int = BATCH_FORMAT_VERSION


class BatchFormatError(ValueError):
    """A batch file is malformed or of another format version."""


def batch_path(output_dir: Path, step: int, rank: int) -> Path:
    return RunDir(output_dir).batch_path(step, rank)


def write_batch(output_dir: Path, batch: TrainingBatch) -> Path:
    """Write one rank's batch atomically."""
    path = batch_path(output_dir, batch.step, batch.rank)
    atomic_write_bytes(path, msgspec.msgpack.encode(batch))
    return path


def read_batch(path: Path) -> TrainingBatch:
    """Decode and validate a batch file; malformed files (truncated, not msgpack, wrong types, another format
    version, token arrays of different lengths) raise BatchFormatError naming the file and the problem."""
    try:
        batch = msgspec.msgpack.decode(Path(path).read_bytes(), type=TrainingBatch)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BatchFormatError(f"{path}: not a valid training batch: {e}") from e
    if batch.format_version != BATCH_FORMAT_VERSION:
        raise BatchFormatError(f"{path}: batch format {batch.format_version}, expected {BATCH_FORMAT_VERSION}")
    for i, mb in enumerate(batch.micro_batches):
        n = len(mb.input_ids)
        lens = {len(mb.position_ids), len(mb.loss_mask), len(mb.advantages), len(mb.inference_logprobs)}
        if lens | {len(mb.temperatures)} != {n}:
            raise BatchFormatError(f"{path}: micro_batches[{i}] has token arrays of different lengths")
        problem = check_sample_images(mb)
        if problem:
            raise BatchFormatError(f"{path}: micro_batches[{i}]: {problem}")
    return batch


def check_sample_images(mb: MicroBatch) -> str | None:
    """What is wrong with a micro-batch's `images` (None: nothing): each entry must be one whole sample with at
    least one image, entries in token order and apart."""
    end = 0
    for k, sample in enumerate(mb.images or []):
        stop = sample.start + sample.num_tokens
        if sample.start < end or sample.num_tokens < 1 or stop > len(mb.input_ids) or not sample.images:
            return f"images[{k}] (tokens [{sample.start}, {stop}), {len(sample.images)} images) is not a sample of it"
        if mb.position_ids[sample.start] != 0 or (stop < len(mb.input_ids) and mb.position_ids[stop] != 0):
            return f"images[{k}] (tokens [{sample.start}, {stop})) does not span exactly one sample"
        end = stop
    return None


def wait_for_batch(output_dir: Path, step: int, rank: int, timeout_s: float, poll_s: float = 0.05) -> TrainingBatch:
    """Block until the orchestrator has written this rank's batch of `step`; raise TimeoutError saying what was awaited."""
    path = batch_path(output_dir, step, rank)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f}s for the orchestrator's batch {path}; is the orchestrator running?"
            )
        time.sleep(poll_s)
    batch = read_batch(path)
    if (batch.step, batch.rank) != (step, rank):
        raise BatchFormatError(
            f"{path}: holds the batch of step {batch.step} rank {batch.rank}, expected step {step} rank {rank}; "
            "is another orchestrator writing into this output_dir?"
        )
    return batch
