"""Micro-batch tensors and the packed <-> padded layout used to run packed samples through plain transformers.

Legend: T = tokens of a packed micro-batch, B = samples (one per padded row), L = longest sample, D = hidden.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from slipstream.transport.rollouts import MicroBatch, Routing, TrainingBatch


class MicroBatchError(ValueError):
    """A micro-batch breaks the packing contract of transport/rollouts.py."""


@dataclass(frozen=True)
class PackedMicroBatch:
    """A MicroBatch as tensors on the training device; entry t describes token t."""

    input_ids_T: Tensor
    position_ids_T: Tensor
    loss_mask_T: Tensor
    advantages_T: Tensor
    inference_logprobs_T: Tensor
    temperatures_T: Tensor
    replay_TRA: Tensor | None = None
    """Router replay: inference's experts per token for each of the R MoE layers (int64, -1 where none)."""

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.numel()


@dataclass(frozen=True)
class PaddedLayout:
    """Where each packed token sits in the padded rows: token t is at [row_T[t], col_T[t]]."""

    row_T: Tensor
    col_T: Tensor
    is_start_T: Tensor
    num_rows: int
    max_len: int


def to_packed(mb: MicroBatch, device: torch.device) -> PackedMicroBatch:
    """Convert and validate one micro-batch (sample starts, positions, temperatures, loss at sample starts)."""
    if not mb.input_ids:
        raise MicroBatchError("empty micro-batch: the orchestrator must not emit micro-batches without tokens")
    packed = PackedMicroBatch(
        input_ids_T=torch.tensor(mb.input_ids, dtype=torch.long, device=device),
        position_ids_T=torch.tensor(mb.position_ids, dtype=torch.long, device=device),
        loss_mask_T=torch.tensor(mb.loss_mask, dtype=torch.bool, device=device),
        advantages_T=torch.tensor(mb.advantages, dtype=torch.float32, device=device),
        inference_logprobs_T=torch.tensor(mb.inference_logprobs, dtype=torch.float32, device=device),
        temperatures_T=torch.tensor(mb.temperatures, dtype=torch.float32, device=device),
        replay_TRA=None if mb.routing is None else routing_tensor(mb.routing, len(mb.input_ids), device),
    )
    layout = build_padded_layout(packed.position_ids_T)
    if (packed.loss_mask_T & layout.is_start_T).any():
        raise MicroBatchError("a sample's first token has loss_mask=True, but nothing precedes it to predict it")
    if (packed.temperatures_T <= 0).any():
        raise MicroBatchError(
            "temperatures must be > 0 (log-probs at temperature 0 are undefined); use 1.0 for prompts"
        )
    return packed


def routing_tensor(routing: Routing, num_tokens: int, device: torch.device) -> Tensor:
    """replay_TRA (int64, -1 where inference did not route the token) from a micro-batch's Routing."""
    if routing.dtype not in ("uint8", "uint16"):
        raise MicroBatchError(f"routing.dtype must be uint8 or uint16, got {routing.dtype!r}")
    array = np.frombuffer(routing.data, dtype=routing.dtype)
    shape = (num_tokens, routing.num_layers, routing.top_k)
    if array.size != num_tokens * routing.num_layers * routing.top_k:
        raise MicroBatchError(f"routing holds {array.size} expert ids, not {shape} for the micro-batch's tokens")
    values = torch.from_numpy(array.astype(np.int64)).view(shape)
    values[values == np.iinfo(routing.dtype).max] = -1
    return values.to(device)


def build_padded_layout(position_ids_T: Tensor) -> PaddedLayout:
    """One row per sample; a sample starts where position_ids restart at 0 and counts up by 1 from there."""
    is_start_T = position_ids_T == 0
    if not bool(is_start_T[0]):
        raise MicroBatchError(f"position_ids must start at 0 (got {int(position_ids_T[0])})")
    row_T = torch.cumsum(is_start_T.long(), dim=0) - 1
    starts_B = torch.nonzero(is_start_T).squeeze(-1)
    col_T = torch.arange(position_ids_T.numel(), device=position_ids_T.device) - starts_B[row_T]
    if not torch.equal(col_T, position_ids_T):
        raise MicroBatchError("position_ids must count 0, 1, 2, ... inside each sample and restart at 0 per sample")
    return PaddedLayout(
        row_T=row_T,
        col_T=col_T,
        is_start_T=is_start_T,
        num_rows=starts_B.numel(),
        max_len=int(col_T.max()) + 1,
    )


def unpack(values_T: Tensor, layout: PaddedLayout, pad_value: float | int) -> Tensor:
    """Packed [T, ...] -> padded [B, L, ...] (right padding with pad_value)."""
    shape = (layout.num_rows, layout.max_len, *values_T.shape[1:])
    values_BL = torch.full(shape, pad_value, dtype=values_T.dtype, device=values_T.device)
    values_BL[layout.row_T, layout.col_T] = values_T
    return values_BL


def pack(values_BL: Tensor, layout: PaddedLayout) -> Tensor:
    """Padded [B, L, ...] -> packed [T, ...]; differentiable."""
    return values_BL[layout.row_T, layout.col_T]


def count_loss_tokens(batch: TrainingBatch) -> int:
    return sum(sum(mb.loss_mask) for mb in batch.micro_batches)


def validate_batch(batch: TrainingBatch, step: int, rank: int, world_size: int) -> None:
    """Check the batch is the one awaited and its loss normaliser matches its loss tokens. `rank` and `world_size`
    count batch files (data ranks): trainer ranks, except that the cp ranks of a group share one."""
    if (batch.step, batch.rank) != (step, rank):
        raise MicroBatchError(f"expected the batch of step {step} rank {rank}, got step {batch.step} rank {batch.rank}")
    local = count_loss_tokens(batch)
    if batch.num_loss_tokens <= 0 or local > batch.num_loss_tokens:
        raise MicroBatchError(
            f"step {step}: batch.num_loss_tokens={batch.num_loss_tokens} but this rank's micro-batches hold {local} "
            "loss tokens; it must be the step's loss-token count across all ranks (> 0)"
        )
    if world_size == 1 and local != batch.num_loss_tokens:
        raise MicroBatchError(
            f"step {step}: batch.num_loss_tokens={batch.num_loss_tokens} but the only rank's micro-batches hold "
            f"{local} loss tokens; they must be equal with one batch per step"
        )
