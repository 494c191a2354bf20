"""Bookkeeping inside one LMDB transaction: what is stored, its size and its last use.

Sub-databases (names from :data:`storage.lmdb_store.DB_NAMES`)::

    records     key -> stored payload                         the data
    index       key -> (last_used_ns, record_bytes, raw_len) + the 64-byte record header
                (storage.record), written with the payload; small, read with every get
    lru         last_used_ns (big-endian) + key -> b""        ordered oldest use first
    quarantine  key + detected_ns -> reason + NUL + (header + payload)[0, QUARANTINE_KEEP)
    meta        b"used_bytes" -> u64                          sum of record_bytes
                b"format" -> u8                               record format (FORMAT_VERSION)

Every method takes the caller's transaction, so a put, its evictions and the byte counter
change together or not at all. Invariants (checked by ``DiskTier.check_integrity``): the key
sets of records/index/lru are equal and ``used_bytes`` is the sum of ``record_bytes`` (header
and payload bytes). The header rides in the index entry rather than a sub-database of its
own: one put and one B-tree fewer per stored object.

A quarantined record keeps only its first :data:`QUARANTINE_KEEP` bytes (header and a slice of
payload, enough to see what went wrong): its bytes are known bad and the object can always be
recomputed, so keeping all of it would only let bad data grow without bound.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import lmdb

__all__ = ["QUARANTINE_KEEP", "Catalog", "IndexEntry"]

QUARANTINE_KEEP = 4096
_INDEX = struct.Struct("<QQQ")
_TICK = struct.Struct(">Q")  # big-endian, so LMDB's byte order is time order
_USED = b"used_bytes"
_FORMAT = b"format"


@dataclass(frozen=True, slots=True)
class IndexEntry:
    last_used_ns: int
    record_bytes: int
    raw_len: int


class Catalog:
    """Stateless helpers over the tier's sub-databases; all state is in the transaction."""

    def __init__(self, dbs: Mapping[str, Any]) -> None:
        self._records = dbs["records"]
        self._index = dbs["index"]
        self._lru = dbs["lru"]
        self._quarantine = dbs["quarantine"]
        self._meta = dbs["meta"]

    def lookup(self, txn: lmdb.Transaction, key: bytes) -> IndexEntry | None:
        raw = txn.get(key, db=self._index)
        return None if raw is None else IndexEntry(*_INDEX.unpack_from(raw))

    def raw_len(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """``lookup(...).raw_len`` without building an IndexEntry (read before a waiting get)."""
        raw = txn.get(key, db=self._index)
        return None if raw is None else int(_INDEX.unpack_from(raw)[2])

    def record(self, txn: lmdb.Transaction, key: bytes) -> tuple[Any, Any] | None:
        """``(header, payload)`` (memoryviews in a ``buffers=True`` read), or None when the
        key has no payload. A payload without its header gives a ``b""`` header, which
        fails verification like any other damage."""
        payload = txn.get(key, db=self._records)
        if payload is None:
            return None
        entry = txn.get(key, db=self._index)
        return (b"" if entry is None else entry[_INDEX.size :]), payload

    def format_version(self, txn: lmdb.Transaction, current: int) -> int:
        """The store's record format; an empty store is stamped ``current`` (write txn)."""
        raw = txn.get(_FORMAT, db=self._meta)
        if raw is not None:
            return int(bytes(raw)[0])
        if txn.stat(self._records)["entries"] == 0:
            txn.put(_FORMAT, bytes([current]), db=self._meta)
            return current
        return 1  # records written before the format was stamped: the header led the payload

    def used_bytes(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_USED, db=self._meta)
        return 0 if raw is None else int(struct.unpack("<Q", bytes(raw))[0])

    def add_used(self, txn: lmdb.Transaction, delta: int) -> None:
        used = self.used_bytes(txn) + delta
        assert used >= 0, "disk tier byte counter went negative"
        txn.put(_USED, struct.pack("<Q", used), db=self._meta)

    def insert(self, txn: lmdb.Transaction, key: bytes, header: bytes, payload: Any,
               entry: IndexEntry) -> None:
        """Store a record for a key that is absent (callers ``remove`` a replaced one first)
        and :meth:`add_used` its ``record_bytes``, once for a whole batch."""
        txn.put(key, payload, db=self._records)
        txn.put(key, _INDEX.pack(entry.last_used_ns, entry.record_bytes, entry.raw_len) + header,
                db=self._index)
        txn.put(_TICK.pack(entry.last_used_ns) + key, b"", db=self._lru)

    def remove(self, txn: lmdb.Transaction, key: bytes) -> IndexEntry | None:
        entry = self.lookup(txn, key)
        if entry is None:
            return None
        txn.delete(key, db=self._records)
        txn.delete(key, db=self._index)
        txn.delete(_TICK.pack(entry.last_used_ns) + key, db=self._lru)
        self.add_used(txn, -entry.record_bytes)
        return entry

    def touch(self, txn: lmdb.Transaction, key: bytes, now_ns: int) -> None:
        """Move ``key`` to the young end of the LRU order (no-op if it is gone)."""
        raw = txn.get(key, db=self._index)
        if raw is None:
            return
        last_used, record_bytes, raw_len = _INDEX.unpack_from(raw)
        if last_used >= now_ns:
            return
        header = bytes(raw[_INDEX.size :])
        txn.delete(_TICK.pack(last_used) + key, db=self._lru)
        txn.put(_TICK.pack(now_ns) + key, b"", db=self._lru)
        txn.put(key, _INDEX.pack(now_ns, record_bytes, raw_len) + header, db=self._index)

    def oldest(self, txn: lmdb.Transaction) -> bytes | None:
        """Key of the least recently used record, or None when empty."""
        with txn.cursor(db=self._lru) as cur:
            return bytes(cur.key())[_TICK.size :] if cur.first() else None

    def latest_tick(self, txn: lmdb.Transaction) -> int:
        with txn.cursor(db=self._lru) as cur:
            return int(_TICK.unpack(bytes(cur.key())[: _TICK.size])[0]) if cur.last() else 0

    def quarantine(
        self, txn: lmdb.Transaction, key: bytes, value: bytes, reason: str, now_ns: int
    ) -> None:
        """Move a record out of ``records`` (and the index) into ``quarantine``; ``value`` is
        its header and payload as found, joined."""
        self.remove(txn, key)
        kept = reason.encode() + b"\0" + value[:QUARANTINE_KEEP]
        txn.put(key + _TICK.pack(now_ns), kept, db=self._quarantine)

    def counts(self, txn: lmdb.Transaction) -> dict[str, int]:
        dbs = {"records": self._records, "index": self._index, "lru": self._lru,
               "quarantine": self._quarantine}
        return {name: int(txn.stat(db)["entries"]) for name, db in dbs.items()}

    def index_items(self, txn: lmdb.Transaction) -> dict[bytes, IndexEntry]:
        with txn.cursor(db=self._index) as cur:
            return {bytes(k): IndexEntry(*_INDEX.unpack_from(v)) for k, v in cur}

    def lru_keys(self, txn: lmdb.Transaction) -> list[bytes]:
        with txn.cursor(db=self._lru) as cur:
            return [bytes(k)[_TICK.size :] for k in cur.iternext(keys=True, values=False)]

    def iter_records(self, txn: lmdb.Transaction, start: bytes
                     ) -> Iterator[tuple[bytes, IndexEntry | None, Any, Any]]:
        """(key, index entry, header, payload) in key order from the first key >= ``start``
        (the entry and header come from one read of the index)."""
        with txn.cursor(db=self._records) as cur:
            if cur.set_range(start):
                for key, payload in cur:
                    raw = txn.get(key, db=self._index)
                    if raw is None:
                        yield bytes(key), None, b"", payload
                    else:
                        entry = IndexEntry(*_INDEX.unpack_from(raw))
                        yield bytes(key), entry, raw[_INDEX.size :], payload
