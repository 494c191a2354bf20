"""On-disk key and record format of the disk tier. Pure: no LMDB, no I/O.

Key (``DiskKey.to_bytes``), hash first so one prefix's objects sit together::

    [0, 16)   block hash (xxh3-128 of the chained prefix)
    [16, 24)  ABI fingerprint, big-endian u64
    [24, 25)  object kind code (KIND_CODES)
    [25, ..)  cache group name, UTF-8 (1..MAX_GROUP_BYTES bytes)

A record is two values under its key, written in one transaction: the 72-byte header
(little-endian), which is the key's whole ``index`` entry, and the stored payload, alone, in
``records``. Apart, so the payload goes into LMDB straight from the caller's buffer: one
copy, as a bare put makes (joined, every offload paid a second copy of the payload to lay
the header before it, ~10% of a put)::

    [0, 4)    magic b"HKVR"         [24, 40)  xxh3-128 of the RAW payload
    [4, 5)    format version (3)    [40, 48)  ABI fingerprint (must equal the key's)
    [5, 6)    codec (RAW | ZSTD)    [48, 56)  created, ns since the epoch
    [6, 7)    kind code             [56, 64)  last used, ns since the epoch
    [7, 8)    reserved, 0           [64, 72)  xxh3-64 of key bytes + header[0, 64)
    [8, 16)   raw length
    [16, 24)  stored length: the payload value's exact length

Every stored field is under the header checksum, so nothing the tier reads from disk is
trusted unverified: not the sizes (the byte accounting is derived from them) and not the last
use (the LRU order is). Format 2 kept last use, record size and raw length in 24 unchecked
bytes before a 64-byte header; one flipped bit there made evictions fail forever.

Verification, always, on every read: the header checksum (covers every header field and
binds the record to its key, so a flip in the header *or in the checksum field itself* is
caught), then magic/version/codec/kind/ABI, then the payload's length, then the xxh3-128 of the raw
bytes after decoding. A get does not rewrite the header (that would cost a write per read): it
notes the use in memory, and the next write transaction reseals the header with the new last
use (:func:`resealed`, only over a header that verified).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash
import zstandard

from hkv_service.core.errors import BadHash, InvalidInput
from hkv_service.core.ids import BLOCK_HASH_BYTES

from .codec import Codec, ProbeStreak, compress, decompress
from .errors import CorruptEntry
from .verify import copy_all

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "KIND_CODES",
    "MAGIC",
    "DiskKey",
    "Encoded",
    "Header",
    "RecordMeta",
    "check_entry",
    "check_header",
    "encode_record",
    "header_of",
    "load_batch",
    "load_bytes",
    "load_into",
    "resealed",
]

MAGIC = b"HKVR"
FORMAT_VERSION = 3  # 1: the header led the payload in one value; 2: unsealed index fields
MAX_GROUP_BYTES = 255
# a new kind takes the next code (codes on disk never change meaning): 5, the recurrent
# state checkpoints of issue 37
KIND_CODES: dict[str, int] = {"COMPRESSED": 1, "TAIL": 2, "SWA": 3, "INDEXER": 4, "STATE": 5}
_KIND_NAMES = {code: name for name, code in KIND_CODES.items()}
_KEY_FIXED = struct.Struct(">16sQB")
HEADER = struct.Struct("<4sBBBBQQ16sQQQQ")
_CHECKED = HEADER.size - 8  # the header checksum covers header[0, 64)
assert HEADER.size == 72
_CODECS = (Codec.RAW, Codec.ZSTD)


@dataclass(frozen=True, slots=True)
class DiskKey:
    """What identifies one object on disk. Validated on construction."""

    block_hash: bytes
    group: str
    kind: str
    abi_fingerprint: int

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or len(self.block_hash) != BLOCK_HASH_BYTES:
            got = len(self.block_hash) if isinstance(self.block_hash, bytes | bytearray) else "?"
            raise BadHash(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {got}")
        if self.kind not in KIND_CODES:
            raise InvalidInput(f"kind {self.kind!r} is not one of {sorted(KIND_CODES)}")
        if not 0 < len(self.group.encode()) <= MAX_GROUP_BYTES:
            raise InvalidInput(f"group name must be 1..{MAX_GROUP_BYTES} UTF-8 bytes")
        if not 0 <= self.abi_fingerprint < 1 << 64:
            raise InvalidInput("ABI fingerprint must be an unsigned 64-bit integer")

    def to_bytes(self) -> bytes:
        fixed = _KEY_FIXED.pack(self.block_hash, self.abi_fingerprint, KIND_CODES[self.kind])
        return fixed + self.group.encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> DiskKey:
        block_hash, abi, code = _KEY_FIXED.unpack_from(raw)
        group = bytes(raw[_KEY_FIXED.size :]).decode()
        return cls(block_hash, group, _KIND_NAMES[code], abi)


class Header(NamedTuple):
    """A verified record header (a tuple: built on every read, so it must be cheap)."""

    codec: Codec
    kind: str
    raw_len: int
    stored_len: int
    checksum: bytes  # xxh3-128 of the raw payload
    abi_fingerprint: int
    created_ns: int
    last_used_ns: int


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """What the tier holds for one key. ``evicted``: keys a put evicted to make room."""

    key: DiskKey
    codec: Codec
    raw_len: int
    stored_len: int
    checksum: bytes
    created_ns: int
    last_used_ns: int
    evicted: tuple[DiskKey, ...] = ()

    @property
    def record_bytes(self) -> int:
        """Bytes the record occupies in the ``records`` sub-database (header + payload)."""
        return HEADER.size + self.stored_len


@dataclass(frozen=True, slots=True)
class Encoded:
    """A record ready to store: its header and its stored payload (the caller's buffer when
    raw), put as two values so the payload is copied once, by LMDB."""

    header: bytes
    stored: memoryview | bytes
    meta: RecordMeta

    @property
    def size(self) -> int:
        return len(self.header) + len(self.stored)


def encode_record(key: DiskKey, view: memoryview, now_ns: int,
                  streak: ProbeStreak | None = None) -> Encoded:
    """Checksum ``view``, compress it when that pays, and seal the header (``streak``: the
    sampling history of ``view``'s stream, see codec.ProbeStreak)."""
    checksum = xxhash.xxh3_128_digest(view)
    codec, stored = compress(view, streak)
    fields = (MAGIC, FORMAT_VERSION, codec, KIND_CODES[key.kind], 0, len(view), len(stored),
              checksum, key.abi_fingerprint, now_ns, now_ns)
    meta = RecordMeta(key, codec, len(view), len(stored), checksum, now_ns, now_ns)
    return Encoded(_sealed(key.to_bytes(), fields), stored, meta)


def _sealed(key_bytes: bytes, fields: tuple[Any, ...]) -> bytes:
    """The header of ``fields`` (HEADER order, without the checksum), sealed to its key."""
    unsealed = HEADER.pack(*fields, 0)
    return HEADER.pack(*fields, xxhash.xxh3_64_intdigest(key_bytes + unsealed[:_CHECKED]))


def resealed(key_bytes: bytes, fields: tuple[Any, ...], last_used_ns: int) -> bytes:
    """The header of ``fields`` (from :func:`check_entry`: verified) with a new last use."""
    return _sealed(key_bytes, (*fields[:F_LAST_USED], last_used_ns))


def _corrupt(key_bytes: bytes, reason: str, detail: str) -> CorruptEntry:
    return CorruptEntry(
        f"disk record {key_bytes.hex()[:32]}... failed verification ({detail}); "
        "it was quarantined: treat as a miss and recompute",
        reason,
        key_bytes,
    )


def header_of(fields: tuple[Any, ...]) -> Header:
    """The :class:`Header` of fields :func:`check_header` passed."""
    _, _, codec, kind, _, raw_len, stored_len, checksum, abi, created, last_used, _ = fields
    return Header(_CODECS[codec], _KIND_NAMES[kind], raw_len, stored_len, checksum, abi, created,
                  last_used)


# Positions in check_header's tuple (HEADER order) that the per-get path and the catalog read.
F_CODEC, F_RAW_LEN, F_STORED_LEN, F_CHECKSUM, F_LAST_USED = 2, 5, 6, 7, 10


def check_header(key_bytes: bytes, header: memoryview, stored_len: int) -> tuple[Any, ...]:
    """The header's fields (``HEADER`` order) once every check passed, ``stored_len`` being
    the length of the payload value found beside it; raises CorruptEntry.

    On every get, so it is kept lean: one unpack, no intermediate copies, no enum call.
    """
    fields = check_entry(key_bytes, header)
    if stored_len != fields[F_STORED_LEN]:
        raise _corrupt(key_bytes, "length", f"a payload of {stored_len} bytes, header says "
                       f"{fields[F_STORED_LEN]}")
    return fields


def check_entry(key_bytes: bytes, header: memoryview | bytes) -> tuple[Any, ...]:
    """:func:`check_header` without the payload: the header's own checks (checksum, format,
    key binding, codec lengths). What the catalog trusts for sizes and last use."""
    if len(header) != HEADER.size:
        raise _corrupt(key_bytes, "short", f"a header of {len(header)} bytes, not {HEADER.size}")
    fields = HEADER.unpack_from(header)
    magic, version, codec, kind, _, raw_len, stored, _, abi, _, _, sealed = fields
    if sealed != xxhash.xxh3_64_intdigest(key_bytes + header[:_CHECKED]):
        raise _corrupt(key_bytes, "header_checksum", "header checksum mismatch")
    _, key_abi, key_kind = _KEY_FIXED.unpack_from(key_bytes)
    if magic != MAGIC or version != FORMAT_VERSION or codec not in (0, 1):
        raise _corrupt(key_bytes, "format", f"unknown magic/version/codec {magic!r}/{version}")
    if abi != key_abi or kind != key_kind:
        raise _corrupt(key_bytes, "key_mismatch", "record ABI or kind differs from its key")
    if codec == Codec.RAW and raw_len != stored:
        raise _corrupt(key_bytes, "length", f"a raw record of {raw_len} bytes stores {stored}")
    return fields


def load_into(key_bytes: bytes, payload: memoryview, fields: tuple[Any, ...],
              dest: memoryview) -> int:
    """Copy the raw bytes of ``payload`` (whose header :func:`check_header` passed, giving
    ``fields``) into ``dest[:raw_len]`` and verify them; returns raw_len.

    From :data:`storage.verify.PARALLEL_MIN_BYTES` the source is hashed on a helper thread
    while it is copied (sound inside the read snapshot, see :mod:`storage.verify`); below,
    the copy is hashed after it (:func:`storage.verify.copy_digest`). ``dest`` is a flat
    writable byte view; too small raises InvalidInput. On CorruptEntry ``dest`` holds
    unverified bytes and must not be used.
    """
    n: int = fields[F_RAW_LEN]
    if n > len(dest):
        raise InvalidInput(f"buffer of {len(dest)} bytes is too small for {n}")
    if fields[F_CODEC] == Codec.RAW:
        src: memoryview = payload
    else:
        src = memoryview(_decoded_frame(key_bytes, payload, n))
        if len(src) != n:
            raise _corrupt(key_bytes, "payload_checksum", "payload length mismatch")
    _copy_verified(key_bytes, src, _head(dest, n), fields[F_CHECKSUM])
    return n


def load_bytes(key_bytes: bytes, payload: memoryview, fields: tuple[Any, ...]) -> bytes:
    """A verified private copy of the raw payload (``fields`` from :func:`check_header`).

    The one copy out of the map is made first and the *copy* is hashed: hashing cache-hot
    bytes is cheaper than a second pass over the map. Bytes that fail never leave here.
    """
    if fields[F_CODEC] == Codec.RAW:
        raw = bytes(payload)
    else:
        raw = _decoded_frame(key_bytes, payload, fields[F_RAW_LEN])
    if len(raw) != fields[F_RAW_LEN] or xxhash.xxh3_128_digest(raw) != fields[F_CHECKSUM]:
        raise _corrupt(key_bytes, "payload_checksum", "payload checksum mismatch")
    return raw


def _copy_verified(key_bytes: bytes, src: memoryview, out: memoryview, checksum: bytes) -> None:
    """``out[:] = src``, and its digest (:func:`storage.verify.copy_all`) must be ``checksum``."""
    if copy_all(((src, out),))[0] != checksum:
        raise _corrupt(key_bytes, "payload_checksum", "payload checksum mismatch")


Load = tuple[bytes, memoryview, tuple[Any, ...], memoryview | None]


def load_batch(loads: Sequence[Load], results: list[Any]) -> None:
    """Append, in order, each ``(key_bytes, payload, fields, dest)``'s verified load to
    ``results``: :func:`load_into` ``dest``, or :func:`load_bytes` when ``dest`` is None.

    The raw payloads bound for a destination are copied and hashed together
    (:func:`storage.verify.copy_all`: half of them on the helper thread, one handoff),
    so call this inside the snapshot the payloads come from. Raises CorruptEntry (its ``key``
    set) for the first load that fails; ``results`` then holds the loads before it.
    """
    pairs: dict[int, tuple[memoryview, memoryview]] = {}
    for i, (_, payload, fields, dest) in enumerate(loads):
        if dest is not None and fields[F_CODEC] == Codec.RAW and fields[F_RAW_LEN] <= len(dest):
            pairs[i] = (payload, _head(dest, fields[F_RAW_LEN]))
    digests = dict(zip(pairs, copy_all(list(pairs.values())), strict=True))
    for i, (key_bytes, payload, fields, dest) in enumerate(loads):
        if i not in digests:  # decoded, or bytes wanted, or a too-small dest (which raises)
            results.append(load_bytes(key_bytes, payload, fields) if dest is None
                           else load_into(key_bytes, payload, fields, dest))
        elif digests[i] != fields[F_CHECKSUM]:
            raise _corrupt(key_bytes, "payload_checksum", "payload checksum mismatch")
        else:
            results.append(fields[F_RAW_LEN])


def _head(dest: memoryview, n: int) -> memoryview:
    return dest if n == len(dest) else dest[:n]


def _decoded_frame(key_bytes: bytes, frame: memoryview, raw_len: int) -> bytes:
    try:
        return decompress(frame, raw_len)
    except zstandard.ZstdError as exc:
        raise _corrupt(key_bytes, "zstd", f"zstd frame does not decode: {exc}") from exc

