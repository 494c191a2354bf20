"""storage/record.py and storage/codec.py: key format, record encoding, every-bit verification;
the ABI in the key and the header, checked on real LMDB."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_service.core.errors import BadHash, InvalidInput
from hkv_service.core.states import Kind
from storage import CorruptEntry, DiskKey, DiskTier, NotOnDisk
from storage.codec import SKIP_AFTER, SKIP_FOR, Codec, ProbeStreak, as_byte_view, compress
from storage.lmdb_store import DB_NAMES
from storage.record import (
    HEADER,
    check_header,
    encode_record,
    load_bytes,
    load_into,
)
from storage.verify import VERIFY_CHUNK

KEY = DiskKey(b"\x11" * 16, "layer0.swa", "SWA", 0xDEADBEEF)


def _value(key: DiskKey, payload: bytes, now: int) -> bytes:
    """A record's header and stored payload joined (apart on disk, in two sub-databases):
    one byte string whose every bit the tests below can flip or cut."""
    encoded = encode_record(key, memoryview(payload), now)
    return encoded.header + bytes(encoded.stored)


def _check(kb: bytes, value: memoryview) -> tuple[Any, ...]:
    """check_header on a joined value: its first HEADER.size bytes, the rest's length."""
    return check_header(kb, value[: HEADER.size], len(value) - HEADER.size)


def _roundtrip(key: DiskKey, payload: bytes) -> bytes:
    value = _value(key, payload, 123)
    view = memoryview(value)
    kb = key.to_bytes()
    return load_bytes(kb, view[HEADER.size :], _check(kb, view))


@pytest.mark.parametrize("kind", [k.value for k in Kind if k is not Kind.DISK])
def test_key_round_trips(kind: str) -> None:
    """Every object kind of the core can go to disk (a recurrent STATE once could not: its
    offload raised InvalidInput; issue 37)."""
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


def test_a_stream_whose_sample_flatters_it_learns_from_the_whole_frame() -> None:
    """A compressible middle in incompressible payloads: every sample passes, every whole
    frame fails. The streak must count the frames' verdicts, or each payload pays for a full
    compression forever (regression: it counted the samples)."""
    payload = bytearray(np.random.default_rng(5).bytes(256 * 1024))  # saves nothing
    mid = (len(payload) - 8 * 1024) // 2
    payload[mid : mid + 8 * 1024] = bytes(8 * 1024)  # the sample compresses, the rest not
    view = as_byte_view(bytes(payload))
    streak = ProbeStreak()
    for _ in range(SKIP_AFTER):
        assert compress(view, streak)[0] is Codec.RAW
    zeros = as_byte_view(np.zeros(len(view), np.uint8))
    assert compress(zeros, streak)[0] is Codec.RAW  # skipped: no compression was tried


def test_a_stream_of_small_payloads_stops_being_compressed_too() -> None:
    """Payloads too small for a sample (up to 2 x PROBE_BYTES) are compressed whole; a
    stream of them that never pays skips like any other (regression: they never skipped)."""
    noise = as_byte_view(np.random.default_rng(2).standard_normal(4 * 1024).astype(np.float16))
    assert len(noise) == 8 * 1024
    streak = ProbeStreak()
    for _ in range(SKIP_AFTER):
        assert compress(noise, streak)[0] is Codec.RAW
    small_zeros = as_byte_view(np.zeros(8 * 1024, np.uint8))
    assert compress(small_zeros, streak)[0] is Codec.RAW  # skipped
    assert compress(small_zeros)[0] is Codec.ZSTD  # no streak: compressed


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
    meta, value = encoded.meta, bytearray(encoded.header + bytes(encoded.stored))
    assert (meta.codec is Codec.ZSTD) == compressible
    bit = data.draw(st.integers(0, len(value) * 8 - 1))
    value[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntry):
        _roundtrip_value(KEY, bytes(value))


def _roundtrip_value(key: DiskKey, value: bytes) -> None:
    kb, view = key.to_bytes(), memoryview(value)
    load_bytes(kb, view[HEADER.size :], _check(kb, view))


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
    return load_into(kb, view[HEADER.size :], _check(kb, view), out)


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


# -- ABI on disk (reliability row 17): the ABI is in the key and re-checked in the header ------


def _resealed_for(key: DiskKey, value: bytes) -> bytes:
    """``value`` with its header checksum recomputed over ``key``: a record whose fields were
    written for another key but sealed consistently (a writer bug or a copied record, which
    the header checksum alone cannot catch)."""
    out = bytearray(value)
    sealed = xxhash.xxh3_64_intdigest(key.to_bytes() + bytes(out[: HEADER.size - 8]))
    out[HEADER.size - 8 : HEADER.size] = sealed.to_bytes(8, "little")
    return bytes(out)


@pytest.mark.parametrize(
    "written_for",
    [
        DiskKey(KEY.block_hash, KEY.group, KEY.kind, KEY.abi_fingerprint + 1),
        DiskKey(KEY.block_hash, KEY.group, "COMPRESSED", KEY.abi_fingerprint),
    ],
    ids=["other_abi", "other_kind"],
)
def test_header_abi_or_kind_differing_from_the_key_is_corrupt(written_for: DiskKey) -> None:
    forged = _resealed_for(KEY, _value(written_for, b"another model's bytes", 7))
    kb, view = KEY.to_bytes(), memoryview(forged)
    with pytest.raises(CorruptEntry) as err:
        _check(kb, view)
    assert err.value.reason == "key_mismatch"
    with pytest.raises(CorruptEntry):
        _roundtrip_value(KEY, forged)
    # The same bytes sealed and read under the key they were written for are fine.
    honest = _value(written_for, b"another model's bytes", 7)
    assert _roundtrip(written_for, b"another model's bytes") == b"another model's bytes"
    _check(written_for.to_bytes(), memoryview(honest))


def _forge(txn: lmdb.Transaction, records: Any, index: Any, key: DiskKey,
           forged: bytes) -> None:
    """Replace ``key``'s record (index entry = header, payload) by ``forged``, same length."""
    honest = txn.get(key.to_bytes(), db=records)
    assert honest is not None and len(honest) == len(forged) - HEADER.size
    assert txn.get(key.to_bytes(), db=index) is not None  # the index entry is the header
    txn.put(key.to_bytes(), forged[: HEADER.size], db=index)
    txn.put(key.to_bytes(), forged[HEADER.size :], db=records)


@pytest.mark.parametrize("when", ["at_rest", "while_open"])
def test_stored_record_with_a_foreign_abi_header_is_quarantined_never_served(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path, when: str
) -> None:
    """On real LMDB: the record under key B (ABI 8) is replaced by one written for key A
    (ABI 7), same length, header sealed for B. The tier refuses it and quarantines it: at
    open (the catalog audit verifies every index entry) or, forged under an open tier, at
    the get."""
    key_a, key_b = h.make_key(1, abi=7), h.make_key(1, abi=8)
    payload = h.kv_bytes(4096, seed=1)
    tier = tier_factory()
    tier.put(key_b, h.kv_bytes(4096, seed=2))
    tier.put(h.make_key(2, abi=8), b"a neighbour")
    forged = _resealed_for(key_b, _value(key_a, payload, 5))
    if when == "while_open":
        dbs = tier._store.dbs
        tier._store.write(lambda txn: _forge(txn, dbs["records"], dbs["index"], key_b, forged))
        with pytest.raises(CorruptEntry) as err:
            tier.get(key_b)
        assert err.value.reason == "key_mismatch"
    else:
        tier.close()
        env = lmdb.open(str(tmp_path / "disk"), max_dbs=len(DB_NAMES))
        with env.begin(write=True) as txn:
            _forge(txn, env.open_db(b"records", txn=txn), env.open_db(b"index", txn=txn),
                   key_b, forged)
        env.close()
        tier = tier_factory()
    with pytest.raises(NotOnDisk):  # quarantined: a miss from now on, never the bytes
        tier.get(key_b)
    with pytest.raises(NotOnDisk):  # and the ABI it was written for was never stored
        tier.get(key_a)
    assert tier.stats().corruption == 1 and tier.quarantine_count() == 1
    assert tier.get(h.make_key(2, abi=8)) == b"a neighbour"
    assert tier.check_integrity() == []


def test_get_under_another_abi_is_not_on_disk(tier: DiskTier, h: Any) -> None:
    """Same block hash, group and kind; another ABI fingerprint: a different key, so a miss,
    never the stored ABI's bytes (by any read path)."""
    stored, other = h.make_key(5, abi=7), h.make_key(5, abi=8)
    tier.put(stored, b"abi 7 bytes")
    assert not tier.contains(other)
    reads: list[Callable[[], object]] = [
        lambda: tier.get(other),
        lambda: tier.get(other, wait_s=1.0),
        lambda: tier.get_into(other, bytearray(64)),
        lambda: tier.get_many([other]),
        lambda: tier.get_many([other], wait_s=1.0),
        lambda: tier.get_many_into([other], [bytearray(64)]),
    ]
    for read in reads:
        with pytest.raises(NotOnDisk):
            read()
    tier.put(other, b"abi 8 bytes")  # both ABIs side by side, each reads its own
    assert tier.get(stored) == b"abi 7 bytes" and tier.get(other) == b"abi 8 bytes"
    assert {m.key.abi_fingerprint for m in tier.scan(verify=True)} == {7, 8}
    assert tier.stats().corruption == 0 and tier.gate.stats().in_transit_objects == 0
