"""A buffer of bytes shared between the trainer and an inference worker on the same machine, for the `ipc` weight
transport (trainer and vLLM on one host, e.g. colocated on one GPU, where NCCL cannot connect two processes of one
device): the trainer lays a whole version out in it, bucket after bucket, and hands its handle to inference, which
reads the buckets in place and copies them into the model. No byte is written to disk or sent over a socket.

- CUDA: the buffer is device memory exported with CUDA IPC (torch.multiprocessing's reduction of a CUDA storage); the
  handle carries the storage's IPC handle and reference-counter file, and the receiver maps the same memory.
- CPU (the CPU twin): the buffer is a file in shared memory (`/dev/shm` where it exists) mapped by both processes.

A handle is a JSON-able dict ({"kind": "cuda" | "file", ...}), so it travels in vLLM's /update_weights update_info.
The trainer owns the buffer: it must not write the next version into it before inference has taken this one.
"""

import base64
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

SHM_DIR = Path("/dev/shm")


class SharedBuffer:
    """The trainer's side: `nbytes` of uint8 on `device`, shared through `handle()`. `name` tells runs apart (the CPU
    file's name)."""

    def __init__(self, nbytes: int, device: torch.device, name: str) -> None:
        self.nbytes, self.device = nbytes, device
        self.path: Path | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif device.type == "cpu":
            folder = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
            self.path = folder / f"slipstream-weights-{name}-{os.getpid()}"
            self.path.unlink(missing_ok=True)
            self.tensor = torch.from_file(str(self.path), shared=True, size=nbytes, dtype=torch.uint8)
        else:
            raise ValueError(f"the ipc weight transport shares CPU or CUDA memory, not {device.type}")

    def handle(self) -> dict[str, Any]:
        if self.path is not None:
            return {"kind": "file", "path": str(self.path), "nbytes": self.nbytes}
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        # (cls, size, stride, offset, storage_cls, dtype, device, handle, storage_size, storage_offset, requires_grad,
        #  ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        return {
            "kind": "cuda",
            "nbytes": self.nbytes,
            "device_uuid": str(torch.cuda.get_device_properties(self.device).uuid),
            "handle": _b64(args[7]),
            "storage_size": int(args[8]),
            "storage_offset": int(args[9]),
            "ref_counter_handle": _b64(args[11]),
            "ref_counter_offset": int(args[12]),
            "event_handle": _b64(args[13]) if args[13] is not None else None,
            "event_sync_required": bool(args[14]),
        }

    def close(self) -> None:
        """Drop the buffer (the CPU file too; a receiver that still maps it keeps its pages until it unmaps)."""
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def open_shared(handle: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The receiver's side: the uint8 tensor `handle` names (mapped, not copied). Raises ValueError on a handle this
    process cannot open, naming why."""
    kind = handle.get("kind") if isinstance(handle, dict) else None
    nbytes = handle.get("nbytes") if isinstance(handle, dict) else None
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"shared weights handle: 'nbytes' must be an integer >= 0, got {nbytes!r:.100}")
    if kind == "file":
        path = Path(str(handle.get("path", "")))
        if not path.is_file() or path.stat().st_size < nbytes:
            raise ValueError(f"shared weights file {path} is missing or shorter than {nbytes} bytes")
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    if kind == "cuda":
        if device.type != "cuda":
            raise ValueError("shared weights in CUDA memory, but this inference worker runs on CPU")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid = str(torch.cuda.get_device_properties(device).uuid)
        if handle.get("device_uuid") != uuid:
            raise ValueError(
                f"shared weights live on GPU {handle.get('device_uuid')}, this worker on {uuid}: the ipc transport "
                "maps the trainer's memory, so both must see the same GPU (colocated) or use nccl"
            )
        return rebuild_cuda_tensor(
            torch.Tensor, (nbytes,), (1,), 0, torch.storage.UntypedStorage, torch.uint8, device.index or 0,
            _unb64(handle["handle"]), handle["storage_size"], handle["storage_offset"], False,
            _unb64(handle["ref_counter_handle"]), handle["ref_counter_offset"],
            _unb64(handle["event_handle"]) if handle.get("event_handle") else None, handle["event_sync_required"],
        )  # fmt: skip
    raise ValueError(f"shared weights handle of kind {kind!r}; expected 'file' or 'cuda'")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


ALIGN = 256
"""Each bucket starts at a multiple of this many bytes (any dtype's view of it is aligned)."""


def bucket_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(start of each bucket, total bytes) of buckets of `sizes` bytes laid out one after the other in a shared
    buffer, each aligned to ALIGN. The trainer and the receiver compute it alike from the manifest."""
    offsets, end = [], 0
    for size in sizes:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + size
    return offsets, end


class SharedSink:
    """A BucketSink laying each bucket into `buffer` at its place (bucket_offsets of the manifest's buckets)."""

    def __init__(self, buffer: SharedBuffer, sizes: list[int]) -> None:
        self.buffer = buffer
        self.offsets, total = bucket_offsets(sizes)
        if total > buffer.nbytes:
            raise ValueError(f"the shared weights buffer holds {buffer.nbytes} bytes, the buckets need {total}")

    def send(self, index: int, bucket, flat: torch.Tensor) -> None:
        start = self.offsets[index]
        self.buffer.tensor[start : start + flat.numel()].copy_(flat)

    def close(self) -> None:
        if self.buffer.device.type == "cuda":
            torch.cuda.synchronize(self.buffer.device)  # the copies ran on the sender thread's stream
