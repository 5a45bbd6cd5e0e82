"""Delta encoding of one bucket (`weights.delta`, issue #40): the bucket's new bytes either whole or as the elements
that changed since the previous version (int32 indices + their new values), whichever is smaller, behind a small
header that carries the mode, the number of changed elements and a checksum of the bucket's FULL new bytes.

The receiver applies a sparse bucket onto its copy of the previous version of that bucket and compares the checksum of
the result with the header's: a match means the result is the sender's bytes, so what goes on to the load path is what
a full send would have carried (bit for bit); a mismatch (a stale or missing base, a corrupted payload) means the
bucket must be sent again in full. Comparison is bitwise on the published dtype's bytes, as weights/send/changes.py
measures it: -0.0 and 0.0 differ, a NaN equals the same NaN.

The checksum is a Fletcher-style pair over the bucket's 32-bit words (16-bit or bytes when its size is not a multiple
of 4), sign-extended to int64 and summed with wrap-around: (sum w_i, sum (i + 1) * w_i) mod 2**64. It runs as a few
torch reductions on the bucket's device (no copy to the host, unlike vLLM's sha256 of every tensor in
compute_weight_checksums, which pulls the model to the CPU), and a word differs from another by less than 2**33, so it
catches every change of one or two words (swapped values, a wrong index) and a random corruption with odds of about
2**-64. It guards against accidents (a stale base, a bug, a flipped byte), not against an adversary.

On the wire (a manifest with `delta`, broadcast from one sender: weights/send/delta_send.py, receive/delta_receive.py):
per bucket in plan order, the header (int64 [HEADER_WORDS]), then its payload when it has bytes (the header says how
many). After the last bucket, the *repair round*: an all-reduce (SUM) of one int32 flag per bucket, 1 from each receiver
whose bucket failed its checksum (or that had no base for a sparse one), then the sender broadcasts every flagged
bucket whole, in plan order (the receivers check it against the header's checksum again). So a corrupted delta is
never loaded, and the version still arrives whole in the same update.
"""

import functools
from dataclasses import dataclass

import torch

FULL, SPARSE = 0, 1
"""A bucket's mode in its header."""

HEADER_WORDS = 4
"""The header: int64 [mode, changed elements, checksum 1, checksum 2]."""

INDEX_BYTES = 4
"""A sparse bucket's index per changed element (int32)."""

MAX_SPARSE_ELEMENTS = 2**31 - 1
"""A bucket with more elements always travels whole (its indices would not fit int32)."""

CHECKSUM_CHUNK_WORDS = 1 << 22
"""Words summed per step of the checksum (bounds its int64 temporaries: 64 MiB for the two of them)."""

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Header:
    """What the receiver learns about a bucket before its payload: mode, changed elements (sparse), checksum."""

    mode: int
    count: int
    sums: tuple[int, int]

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.tensor([self.mode, self.count, *self.sums], dtype=torch.int64, device=device)

    @staticmethod
    def parse(header: torch.Tensor, nbytes: int, element_size: int) -> "Header":
        """A received header of a bucket of `nbytes` in a dtype of `element_size` bytes; ValueError if it cannot be one
        (the stream's framing is lost: sender and receiver no longer agree on what follows)."""
        mode, count, s1, s2 = (int(v) for v in header.tolist())
        if mode not in (FULL, SPARSE) or not 0 <= count <= nbytes // element_size or (mode == FULL and count):
            raise ValueError(f"malformed delta header {[mode, count]} for a bucket of {nbytes} bytes")
        return Header(mode, count, (s1, s2))

    def payload_bytes(self, nbytes: int, element_size: int) -> int:
        """Bytes of the payload that follows this header, for a bucket of `nbytes`."""
        if self.mode == FULL:
            return nbytes
        return index_bytes(self.count) + self.count * element_size


def index_bytes(count: int) -> int:
    """A sparse payload's index part: int32 per element, padded to 8 bytes so the values after it are aligned."""
    return -(-count * INDEX_BYTES // 8) * 8


def sparse_bytes(count: int, element_size: int) -> int:
    return index_bytes(count) + count * element_size


@dataclass(frozen=True)
class Encoded:
    header: Header
    payload: torch.Tensor
    """uint8: the new bytes (FULL; the caller's tensor itself, not a copy), or indices then values (SPARSE)."""
    changed: int | None = None
    """Elements whose bits changed (None: there was nothing to compare with)."""


def words(flat: torch.Tensor, element_size: int) -> torch.Tensor:
    """`flat` (uint8) seen as one integer word per element of a dtype of `element_size` bytes."""
    return flat.view(_WORDS[element_size])


def checksum(flat: torch.Tensor) -> torch.Tensor:
    """The checksum of `flat` (uint8, contiguous) as int64 [2] on its device (see the module docstring)."""
    n = flat.numel()
    size = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    w = flat.view(_WORDS[size])
    s1 = torch.zeros((), dtype=torch.int64, device=flat.device)
    s2 = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, w.numel(), CHECKSUM_CHUNK_WORDS):
        chunk = w[start : start + CHECKSUM_CHUNK_WORDS].to(torch.int64)
        total = chunk.sum()
        # sum over the chunk of (start + j + 1) * w_j = sum (j + 1) * w_j + start * sum w_j, all mod 2**64
        s2 += (chunk * _positions(chunk.numel(), flat.device)).sum() + total * start
        s1 += total
    return torch.stack([s1, s2])


@functools.lru_cache(maxsize=4)
def _cached_positions(device: torch.device) -> torch.Tensor:
    return torch.arange(1, CHECKSUM_CHUNK_WORDS + 1, dtype=torch.int64, device=device)


def _positions(n: int, device: torch.device) -> torch.Tensor:
    return _cached_positions(device)[:n]


def encode(new: torch.Tensor, old: torch.Tensor | None, element_size: int, full: bool = False) -> Encoded:
    """Encode a bucket's `new` bytes (uint8) against the same bucket's `old` bytes (None: no previous version), in a
    dtype of `element_size` bytes. SPARSE when the changed elements' indices and values take fewer bytes than the
    bucket, else FULL (and always when `full`, which still counts the changes). One host sync (the number of changed
    elements)."""
    sums = tuple(int(v) for v in checksum(new).tolist())
    nbytes = new.numel()
    if old is None or nbytes // element_size > MAX_SPARSE_ELEMENTS:
        return Encoded(Header(FULL, 0, sums), new)
    if old.numel() != nbytes:
        raise ValueError(f"the previous version of this bucket has {old.numel()} bytes, the new one {nbytes}")
    new_w = words(new, element_size)
    changed = (new_w != words(old, element_size)).nonzero().view(-1)
    count = changed.numel()
    size = sparse_bytes(count, element_size)
    if full or size >= nbytes:
        return Encoded(Header(FULL, 0, sums), new, count)
    payload = torch.zeros(size, dtype=torch.uint8, device=new.device)
    at = index_bytes(count)
    payload[: count * INDEX_BYTES].view(torch.int32).copy_(changed)
    words(payload[at:], element_size).copy_(new_w[changed])
    return Encoded(Header(SPARSE, count, sums), payload, count)


def apply(header: Header, payload: torch.Tensor, base: torch.Tensor, element_size: int) -> bool:
    """Make `base` (uint8: the receiver's copy of this bucket's previous version; any bytes for a FULL bucket) the new
    version from `header` and `payload`, in place. True when its checksum then matches the header's; False when it
    does not (or a sparse payload's indices point outside the bucket): `base` then holds no version and must be sent
    again in full."""
    expected = header.payload_bytes(base.numel(), element_size)
    if payload.numel() != expected:
        raise ValueError(f"a delta payload of {payload.numel()} bytes, its header says {expected}")
    if header.mode == FULL:
        base.copy_(payload)
    elif header.count:
        indices = payload[: header.count * INDEX_BYTES].view(torch.int32)
        values = words(payload[index_bytes(header.count) :], element_size)
        target = words(base, element_size)
        bounds = torch.stack([indices.min(), indices.max()]).tolist()
        if bounds[0] < 0 or bounds[1] >= target.numel():
            return False
        target[indices.long()] = values
    return tuple(int(v) for v in checksum(base).tolist()) == header.sums
