"""weights/wire/delta.py: a bucket encoded against its previous version (sparse or full, whichever is smaller) and
applied onto the receiver's copy of that version gives the new bytes exactly; a wrong base or a corrupted payload is
caught by the checksum of the full new bytes."""

import pytest
import torch

from slipstream.weights.wire import delta
from slipstream.weights.wire.delta import FULL, SPARSE, Header, apply, checksum, encode, sparse_bytes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.float8_e4m3fn]


def _bucket(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """n random elements of `dtype` as a bucket's flat bytes (fp8 and ints: random bytes, NaN patterns included)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and torch.finfo(dtype).bits >= 16:
        return torch.randn(n, generator=g).to(dtype).view(torch.uint8).clone()
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)


def _changed(old: torch.Tensor, dtype: torch.dtype, fraction: float, seed: int) -> torch.Tensor:
    """`old` with about `fraction` of its elements given other bits."""
    size = torch.empty((), dtype=dtype).element_size()
    new = old.clone()
    w = delta.words(new, size)
    g = torch.Generator().manual_seed(seed)
    picked = torch.rand(w.numel(), generator=g) < fraction
    w[picked] = w[picked] ^ 1  # the lowest bit: the smallest change a bf16 update makes
    return new


def _round_trip(old: torch.Tensor, new: torch.Tensor, size: int, **kwargs) -> delta.Encoded:
    encoded = encode(new, old, size, **kwargs)
    base = old.clone()
    assert apply(encoded.header, encoded.payload.clone(), base, size)
    assert torch.equal(base, new)
    return encoded


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 1.0])
def test_round_trip_is_exact_for_every_published_dtype(dtype, fraction):
    size = torch.empty((), dtype=dtype).element_size()
    old = _bucket(dtype, 1001, seed=1)
    new = _changed(old, dtype, fraction, seed=2)
    count = int((delta.words(new, size) != delta.words(old, size)).sum())
    encoded = _round_trip(old, new, size)
    if sparse_bytes(count, size) < new.numel():
        assert encoded.header == Header(SPARSE, count, encoded.header.sums)
        assert encoded.payload.numel() == sparse_bytes(count, size) < new.numel()
    else:
        assert encoded.header.mode == FULL and encoded.payload is new
    if fraction == 0.0:  # nothing changed: a header and no payload
        assert encoded.header.mode == SPARSE and encoded.header.count == 0 and encoded.payload.numel() == 0
    if fraction == 1.0:
        assert encoded.header.mode == FULL


def test_sparse_wins_exactly_while_it_is_smaller_than_the_bucket():
    old = _bucket(torch.bfloat16, 600, seed=3)  # 1200 bytes; a changed bf16 element costs 4 + 2 bytes
    for count, mode in ((199, SPARSE), (200, FULL), (201, FULL)):
        new = old.clone()
        delta.words(new, 2)[:count] ^= 1
        expected = SPARSE if sparse_bytes(count, 2) < 1200 else FULL
        assert expected == mode
        assert _round_trip(old, new, 2).header.mode == mode


def test_signed_zeros_and_nan_payloads_are_bits_not_numbers():
    old = torch.tensor([0.0, 1.0, float("nan"), 2.0, float("nan"), 3.0, 4.0, 5.0], dtype=torch.float32)
    new = old.clone()
    new[0] = -0.0  # equal as numbers, other bits: must arrive
    nan_w = new.view(torch.int32)
    nan_w[4] = nan_w[4] | 0x1234  # another NaN payload: must arrive
    raw_old, raw_new = old.view(torch.uint8), new.view(torch.uint8)
    encoded = _round_trip(raw_old, raw_new, 4)
    assert encoded.header.mode == SPARSE and encoded.header.count == 2  # the unchanged NaN (index 2) is no change
    got = raw_old.clone()
    apply(encoded.header, encoded.payload, got, 4)
    assert torch.signbit(got.view(torch.float32)[0]) and got.view(torch.int32)[4] == nan_w[4]


def test_first_version_and_forced_sends_are_full():
    new = _bucket(torch.bfloat16, 64, seed=4)
    assert encode(new, None, 2).header.mode == FULL
    assert encode(new, new.clone(), 2, full=True).header.mode == FULL
    base = torch.zeros_like(new)  # a FULL bucket needs no base: any bytes are overwritten
    encoded = encode(new, None, 2)
    assert apply(encoded.header, encoded.payload, base, 2) and torch.equal(base, new)


def test_a_stale_base_is_detected():
    v1 = _bucket(torch.bfloat16, 500, seed=5)
    v2 = _changed(v1, torch.bfloat16, 0.02, seed=6)
    v3 = _changed(v2, torch.bfloat16, 0.02, seed=7)
    encoded = encode(v3, v2, 2)
    assert encoded.header.mode == SPARSE
    assert not apply(encoded.header, encoded.payload, v1.clone(), 2)  # the receiver missed version 2


@pytest.mark.parametrize("where", ["value", "index in range", "index out of range", "negative index"])
def test_a_corrupted_sparse_payload_is_detected(where):
    old = _bucket(torch.float32, 300, seed=8)
    new = _changed(old, torch.float32, 0.05, seed=9)
    encoded = encode(new, old, 4)
    header, payload = encoded.header, encoded.payload.clone()
    assert header.mode == SPARSE and header.count >= 2
    indices = payload[: header.count * 4].view(torch.int32)
    if where == "value":
        payload[-1] ^= 0x40
    elif where == "index in range":
        indices[0] = (indices[0] + 1) % 300
    elif where == "index out of range":
        indices[1] = 300
    else:
        indices[1] = -1
    assert not apply(header, payload, old.clone(), 4)


def test_a_corrupted_full_payload_is_detected():
    new = _bucket(torch.bfloat16, 77, seed=10)  # 154 bytes: checksummed as 16-bit words
    encoded = encode(new, None, 2)
    payload = encoded.payload.clone()
    payload[100] ^= 1
    assert not apply(encoded.header, payload, torch.empty_like(new), 2)


def test_a_payload_of_the_wrong_size_is_refused():
    old = _bucket(torch.bfloat16, 100, seed=11)
    encoded = encode(_changed(old, torch.bfloat16, 0.05, seed=12), old, 2)
    with pytest.raises(ValueError, match="header says"):
        apply(encoded.header, encoded.payload[:-2], old.clone(), 2)


def test_header_round_trips_and_rejects_what_cannot_be_one():
    header = Header(SPARSE, 12, (-5, 2**63 - 1))
    assert Header.parse(header.to_tensor(), 200, 2) == header
    for bad in ([2, 0, 0, 0], [SPARSE, 101, 0, 0], [SPARSE, -1, 0, 0], [FULL, 3, 0, 0]):
        with pytest.raises(ValueError, match="malformed delta header"):
            Header.parse(torch.tensor(bad), 200, 2)


def _reference_checksum(flat: torch.Tensor) -> tuple[int, int]:
    """Fletcher pair over sign-extended words, in Python integers, reduced to signed 64 bits."""
    n = flat.numel()
    size = 4 if n % 4 == 0 else 2 if n % 2 == 0 else 1
    w = [int(x) for x in flat.view(delta._WORDS[size]).tolist()]
    s1, s2 = sum(w), sum((i + 1) * x for i, x in enumerate(w))

    def signed(v: int) -> int:
        v %= 2**64
        return v - 2**64 if v >= 2**63 else v

    return signed(s1), signed(s2)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 30, 4096])
def test_checksum_is_the_documented_sum_in_chunks_and_wraps(nbytes, monkeypatch):
    monkeypatch.setattr(delta, "CHECKSUM_CHUNK_WORDS", 5)  # several chunks, the last one short
    delta._cached_positions.cache_clear()
    try:
        flat = torch.randint(0, 256, (nbytes,), generator=torch.Generator().manual_seed(nbytes), dtype=torch.uint8)
        assert tuple(checksum(flat).tolist()) == _reference_checksum(flat)
        big = torch.full((64,), -1, dtype=torch.int32)  # sums that wrap past 2**63 in the reference
        big[::2] = 2**31 - 1
        assert tuple(checksum(big.view(torch.uint8)).tolist()) == _reference_checksum(big.view(torch.uint8))
    finally:
        delta._cached_positions.cache_clear()


def test_checksum_tells_swapped_words_and_single_bits_apart():
    flat = _bucket(torch.float32, 256, seed=13)
    w = flat.view(torch.int32)
    swapped = w.clone()
    swapped[[3, 200]] = swapped[[200, 3]]
    assert not torch.equal(checksum(swapped.view(torch.uint8)), checksum(flat))
    sign = w.clone()
    sign[[10, 12]] ^= -(2**31)  # two sign flips: what a sum of 64-bit words would miss
    assert not torch.equal(checksum(sign.view(torch.uint8)), checksum(flat))


def test_changes_are_counted_even_when_the_bucket_goes_whole():
    old = _bucket(torch.bfloat16, 100, seed=14)
    new = old.clone()
    delta.words(new, 2)[:3] ^= 1
    assert encode(new, old, 2).changed == 3 and encode(new, old, 2, full=True).changed == 3
    assert encode(new, old, 2, full=True).header.mode == FULL and encode(new, None, 2).changed is None


def test_manifest_carries_the_delta_flag_for_one_sender_only():
    from slipstream.weights.wire.stream import Bucket, Manifest, TensorMeta

    plan = (Bucket("bfloat16", (TensorMeta("w", "bfloat16", (4, 4)),)),)
    data = Manifest(3, plan, delta=True).to_dict()
    assert data["delta"] is True and Manifest.from_dict(data).delta
    assert "delta" not in Manifest(3, plan).to_dict() and not Manifest.from_dict(Manifest(3, plan).to_dict()).delta
    with pytest.raises(ValueError, match="'delta' must be true or false"):
        Manifest.from_dict(data | {"delta": "yes"})
    with pytest.raises(ValueError, match="one sender"):
        Manifest.from_dict(data | {"senders": 2})
