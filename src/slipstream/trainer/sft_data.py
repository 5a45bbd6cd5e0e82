"""SFT data order and packing: which samples make step N (a cursor into seeded per-epoch permutations, saved with
each checkpoint so a resumed run continues at the same sample), each data rank's share, and packed micro-batches
(samples one after another in one row, position_ids restarting at 0 per sample: the trainer's packed attention
keeps them apart; conversations sharing a prefix may go as one prefix tree, sft_trees.py).

Legend: T = tokens of a packed micro-batch.
"""

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from slipstream.trainer.data import PackedMicroBatch, validate_packed
from slipstream.trainer.sft_render import SFTSample
from slipstream.trainer.sft_trees import PrefixSharing, Unit, build_trees, unit_parts
from slipstream.utils.fs import atomic_write_text

CURSOR_FILE = "sft_data.json"
"""The data position of a checkpoint, in `checkpoints/step_N/`, written before the trainer part is committed."""


@dataclass(frozen=True)
class DataCursor:
    """Where the next step's samples start: position `index` of epoch `epoch`'s order."""

    epoch: int = 0
    index: int = 0

    def write(self, path: Path, num_samples: int) -> None:
        """Save the cursor with the number of training samples it indexes (checked by `read`)."""
        atomic_write_text(path, json.dumps({**asdict(self), "num_samples": num_samples}) + "\n")

    @classmethod
    def read(cls, path: Path, num_samples: int) -> "DataCursor":
        """The cursor saved at `path`; an error when it indexes another number of training samples."""
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: this checkpoint was not written by `slipstream sft`")
        data = json.loads(path.read_text())
        if data["num_samples"] != num_samples:
            raise ValueError(
                f"{path}: the checkpoint was trained on {data['num_samples']} samples, the training files now hold "
                f"{num_samples}; resume with the same data.train_files, or start a new run"
            )
        return cls(epoch=int(data["epoch"]), index=int(data["index"]))


@lru_cache(maxsize=4)
def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    """The order of the samples in `epoch`: a permutation seeded by (seed, epoch) (string seeds hash the same in
    every process and Python version), or the file order."""
    order = list(range(num_samples))
    if shuffle:
        random.Random(f"sft:{seed}:{epoch}").shuffle(order)
    return tuple(order)


def next_batch(
    num_samples: int, cursor: DataCursor, batch_size: int, seed: int, shuffle: bool
) -> tuple[list[int], DataCursor]:
    """(indices of the step's `batch_size` samples, the cursor after them); a batch may span two epochs."""
    indices: list[int] = []
    epoch, index = cursor.epoch, cursor.index
    while len(indices) < batch_size:
        order = epoch_order(num_samples, epoch, seed, shuffle)
        taken = order[index : index + batch_size - len(indices)]
        indices += taken
        index += len(taken)
        if index == num_samples:
            epoch, index = epoch + 1, 0
    return indices, DataCursor(epoch, index)


def rank_share(indices: list[int], data_rank: int, num_data_ranks: int) -> list[int]:
    """The samples of `indices` that data rank `data_rank` trains on (round robin)."""
    return indices[data_rank::num_data_ranks]


def pack_micro_batches(
    samples: list[SFTSample], max_tokens: int, sharing: PrefixSharing | None = None
) -> list[list[Unit]]:
    """Group samples into micro-batches of at most `max_tokens` tokens: first fit, longest first (deterministic:
    ties keep their order). With `sharing`, conversations that share a prefix go as prefix trees (sft_trees.py),
    which count their tokens with the prefix once."""
    for sample in samples:
        if sample.num_tokens > max_tokens:
            raise ValueError(f"{sample.where}: {sample.num_tokens} tokens do not fit micro_batch_tokens {max_tokens}")
    units: list[Unit] = list(samples) if sharing is None else build_trees(samples, max_tokens, sharing)
    bins: list[list[Unit]] = []
    sizes: list[int] = []
    for unit in sorted(units, key=lambda u: -u.num_tokens):
        for b, size in enumerate(sizes):
            if size + unit.num_tokens <= max_tokens:
                bins[b].append(unit)
                sizes[b] += unit.num_tokens
                break
        else:
            bins.append([unit])
            sizes.append(unit.num_tokens)
    return bins


def packed_micro_batch(units: Sequence[Unit], device: torch.device) -> PackedMicroBatch:
    """One packed row of `units` (position_ids restart at 0 per conversation and tree, and continue the shared
    prefix's in a tree's further conversations; temperature 1, no RL fields)."""
    parts = [part for unit in units for part in unit_parts(unit)]
    input_ids_T = torch.tensor([t for s, start in parts for t in s.input_ids[start:]], dtype=torch.long)
    position_ids_T = torch.cat([torch.arange(start, s.num_tokens) for s, start in parts])
    loss_mask_T = torch.tensor([m for s, start in parts for m in s.loss_mask[start:]], dtype=torch.bool)
    zeros_T = torch.zeros(input_ids_T.numel())
    packed = PackedMicroBatch(
        input_ids_T=input_ids_T,
        position_ids_T=position_ids_T,
        loss_mask_T=loss_mask_T,
        advantages_T=zeros_T,
        inference_logprobs_T=zeros_T,
        temperatures_T=torch.ones(input_ids_T.numel()),
    )
    packed = replace(packed, layout=validate_packed(packed))
    if device.type == "cpu":
        return packed
    return PackedMicroBatch(**{f: None if t is None else t.to(device) for f, t in vars(packed).items()})
