"""storage/record.py and storage/codec.py: key format, record encoding, every-bit verification."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_service.core.errors import BadHash, InvalidInput
from storage import CorruptEntry, DiskKey
from storage.codec import SKIP_AFTER, SKIP_FOR, Codec, ProbeStreak, as_byte_view, compress
from storage.record import (
    HEADER,
    VERIFY_CHUNK,
    check_header,
    encode_record,
    load_into,
    verified_raw,
    verify_header,
)

KEY = DiskKey(b"\x11" * 16, "layer0.swa", "SWA", 0xDEADBEEF)


def _value(key: DiskKey, payload: bytes, now: int) -> bytes:
    return bytes(encode_record(key, memoryview(payload), now).assemble(bytearray()))


def _roundtrip(key: DiskKey, payload: bytes) -> bytes:
    value = _value(key, payload, 123)
    view = memoryview(value)
    kb = key.to_bytes()
    return bytes(verified_raw(kb, verify_header(kb, view), view))


@pytest.mark.parametrize("kind", ["COMPRESSED", "TAIL", "SWA", "INDEXER"])
def test_key_round_trips(kind: str) -> None:
    key = DiskKey(bytes(range(16)), "grüppe", kind, (1 << 64) - 1)
    assert DiskKey.from_bytes(key.to_bytes()) == key


@pytest.mark.parametrize("bad", [b"", b"x" * 15, b"x" * 17])
def test_wrong_hash_length_is_bad_hash(bad: bytes) -> None:
    with pytest.raises(BadHash):
        DiskKey(bad, "g", "SWA", 1)


@pytest.mark.parametrize(
    "fields", [("g", "NOPE", 1), ("", "SWA", 1), ("g" * 256, "SWA", 1), ("g", "SWA", -1)]
)
def test_bad_key_fields_are_invalid_input(fields: tuple[str, str, int]) -> None:
    with pytest.raises(InvalidInput):
        DiskKey(b"x" * 16, *fields)


def test_incompressible_kv_stays_raw_and_zeros_compress() -> None:
    fp16 = np.random.default_rng(0).standard_normal(1 << 19).astype(np.float16)
    assert compress(as_byte_view(fp16))[0] is Codec.RAW
    codec, stored = compress(memoryview(bytes(1 << 20)))
    assert codec is Codec.ZSTD and len(stored) < 1 << 12
    assert compress(memoryview(bytes(100)))[0] is Codec.RAW  # too small to bother


def test_a_stream_that_never_compresses_stops_being_sampled_for_a_while() -> None:
    """After SKIP_AFTER failed samples in a row the next SKIP_FOR payloads of the stream go
    raw unsampled (a compressible one too: the proof that no sample was taken); one more
    failed sample skips again, a promising one resumes sampling every payload."""
    noise = as_byte_view(np.random.default_rng(0).standard_normal(64 * 1024).astype(np.float16))
    zeros = as_byte_view(np.zeros(128 * 1024, np.uint8))
    streak = ProbeStreak()
    for _ in range(SKIP_AFTER):
        assert compress(noise, streak)[0] is Codec.RAW
    assert [compress(zeros, streak)[0] for _ in range(SKIP_FOR)] == [Codec.RAW] * SKIP_FOR
    assert compress(noise, streak)[0] is Codec.RAW  # sampled: one failure skips again
    assert [compress(zeros, streak)[0] for _ in range(SKIP_FOR)] == [Codec.RAW] * SKIP_FOR
    assert compress(zeros, streak)[0] is Codec.ZSTD  # sampled: the stream compresses now
    assert compress(zeros, streak)[0] is Codec.ZSTD  # and is sampled every time again
    assert compress(zeros)[0] is Codec.ZSTD  # no streak: always sampled


def test_a_compressing_stream_is_always_sampled() -> None:
    zeros = as_byte_view(np.zeros(128 * 1024, np.uint8))
    noise = as_byte_view(np.random.default_rng(1).standard_normal(64 * 1024).astype(np.float16))
    streak = ProbeStreak()
    for i in range(3 * SKIP_AFTER):  # never SKIP_AFTER failures in a row
        payload = noise if i % 2 else zeros
        assert compress(payload, streak)[0] is (Codec.RAW if i % 2 else Codec.ZSTD)


def test_payload_views_accept_arrays_and_reject_bad_input() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert bytes(as_byte_view(arr)) == arr.tobytes()
    bad: list[Any] = [arr[:, ::2], "text", 42]
    for payload in bad:
        with pytest.raises(InvalidInput):
            as_byte_view(payload)


@pytest.mark.parametrize("payload", [b"", b"abc", bytes(200_000), np.arange(5000).tobytes()])
def test_record_round_trip(payload: bytes) -> None:
    assert _roundtrip(KEY, payload) == payload


@settings(max_examples=150, deadline=None)
@given(data=st.data(), compressible=st.booleans())
def test_any_single_bit_flip_is_detected(data: st.DataObject, compressible: bool) -> None:
    payload = bytes(6000) if compressible else np.random.default_rng(1).bytes(6000)
    encoded = encode_record(KEY, memoryview(payload), 99)
    meta, value = encoded.meta, bytearray(encoded.assemble(bytearray()))
    assert (meta.codec is Codec.ZSTD) == compressible
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        _roundtrip_value(KEY, bytes(value))


def _roundtrip_value(key: DiskKey, value: bytes) -> None:
    kb, view = key.to_bytes(), memoryview(value)
    verified_raw(kb, verify_header(kb, view), view)


def test_record_is_bound_to_its_key() -> None:
    value = _value(KEY, b"payload", 1)
    other = DiskKey(b"\x12" * 16, KEY.group, KEY.kind, KEY.abi_fingerprint)
    with pytest.raises(CorruptEntry) as err:
        _roundtrip_value(other, bytes(value))
    assert err.value.reason == "header_checksum"


def test_truncated_record_is_detected() -> None:
    value = _value(KEY, b"x" * 100, 1)
    for cut in (0, HEADER.size - 1, HEADER.size, len(value) - 1):
        with pytest.raises(CorruptEntry):
            _roundtrip_value(KEY, bytes(value[:cut]))


def test_every_single_bit_flip_of_a_small_zstd_record_is_detected() -> None:
    """Exhaustive, not sampled: zstd ignores one frame-descriptor bit, which the codec rejects."""
    value = _value(KEY, bytes(6000), 99)
    assert value[5] == Codec.ZSTD
    for bit in range(len(value) * 8):
        flipped = bytearray(value)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptEntry):
            _roundtrip_value(KEY, bytes(flipped))


def _read_into(value: bytes, out: memoryview) -> int:
    """The tier's per-get path: header check, then copy + verify into ``out``."""
    kb, view = KEY.to_bytes(), memoryview(value)
    return load_into(kb, view, check_header(kb, view), out)


@pytest.mark.parametrize("compressible", [False, True])
@pytest.mark.parametrize(
    "size", [1, VERIFY_CHUNK - 1, VERIFY_CHUNK, VERIFY_CHUNK + 1, 3 * VERIFY_CHUNK + 4097]
)
def test_read_into_copies_and_verifies_across_chunk_boundaries(size: int,
                                                               compressible: bool) -> None:
    payload = (bytes(size) if compressible
               else np.random.default_rng(size).bytes(size))
    value = _value(KEY, payload, 5)
    out = bytearray(size)
    assert _read_into(value, memoryview(out)) == size
    assert out == payload
    with pytest.raises(InvalidInput):  # a caller's wrong-sized buffer is not corruption
        _read_into(value, memoryview(bytearray(size - 1)))
    roomy = bytearray(size + 1)  # a larger buffer gets the payload in its first n bytes
    assert _read_into(value, memoryview(roomy)) == size and roomy[:size] == payload


@pytest.mark.parametrize("where", [0, VERIFY_CHUNK - 1, VERIFY_CHUNK, 2 * VERIFY_CHUNK + 7, -1])
def test_read_into_detects_a_flip_in_any_chunk(where: int) -> None:
    size = 3 * VERIFY_CHUNK + 100
    value = bytearray(_value(KEY, np.random.default_rng(9).bytes(size), 5))
    assert value[5] == Codec.RAW
    offset = HEADER.size + where if where >= 0 else len(value) - 1
    value[offset] ^= 0x40
    with pytest.raises(CorruptEntry) as err:
        _read_into(bytes(value), memoryview(bytearray(size)))
    assert err.value.reason == "payload_checksum"
