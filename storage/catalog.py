"""Bookkeeping inside one LMDB transaction: what is stored, its size and its last use.

Sub-databases (names from :data:`storage.lmdb_store.DB_NAMES`)::

    records     key -> stored payload                         the data
    index       key -> the record header (storage.record.HEADER: sizes, checksums, last
                use, sealed by one checksum bound to the key); small, read with every get
    lru         last_used_ns (big-endian) + key -> b""        ordered oldest use first
    quarantine  key + detected_ns -> reason + NUL + (header + payload)[0, QUARANTINE_KEEP)
    meta        b"used_bytes" -> u64                          sum of record_bytes
                b"format" -> u8                               record format (FORMAT_VERSION)

Every method takes the caller's transaction, so a put, its evictions and the byte counter
change together or not at all. Invariants (checked by ``DiskTier.check_integrity``): the key
sets of records/index/lru are equal, each lru key carries its entry's last use, and
``used_bytes`` is the sum of ``record_bytes`` (header and payload bytes). The header is the
index entry rather than a sub-database of its own: one put and one B-tree fewer per object.

Trust: sizes and last use are read only from index entries whose checksum verifies
(:func:`storage.record.check_entry`); ``lru`` and ``used_bytes`` are derived data. An entry
that fails is never used for accounting: removing it searches ``lru`` for its key and
recounts ``used_bytes`` from the verified entries (:meth:`Catalog.recount`), and a counter
that would go negative is recounted too. :meth:`Catalog.audit` checks all of it at open, and
:meth:`Catalog.repair` rebuilds what the audit found wrong.

A quarantined record keeps only its first :data:`QUARANTINE_KEEP` bytes (header and a slice of
payload, enough to see what went wrong): its bytes are known bad and the object can always be
recomputed, so keeping all of it would only let bad data grow without bound.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import lmdb

from .errors import CorruptEntry
from .record import (
    F_LAST_USED,
    F_RAW_LEN,
    F_STORED_LEN,
    HEADER,
    KIND_CODES,
    MAX_GROUP_BYTES,
    check_entry,
    resealed,
)

__all__ = ["QUARANTINE_KEEP", "Audit", "Catalog", "IndexEntry", "Removal"]

QUARANTINE_KEEP = 4096
_TICK = struct.Struct(">Q")  # big-endian, so LMDB's byte order is time order
_USED = b"used_bytes"
_FORMAT = b"format"
_KEY_MIN, _KEY_MAX = 16 + 8 + 1 + 1, 16 + 8 + 1 + MAX_GROUP_BYTES
_KIND_BYTES = frozenset(KIND_CODES.values())


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """What a verified index entry says about its record."""

    last_used_ns: int
    record_bytes: int
    raw_len: int


class Removal(enum.Enum):
    ABSENT = "absent"
    REMOVED = "removed"
    CORRUPT = "corrupt"  # removed; its entry failed verification (count it as corruption)


@dataclass(slots=True)
class Audit:
    """What :meth:`Catalog.audit` found. ``damage``: a key no writer of ours makes (a B-tree
    page of garbage): the environment itself is damaged, nothing else here is meaningful."""

    damage: str | None = None
    corrupt: dict[bytes, str] = field(default_factory=dict)  # key -> why its entry fails
    orphans: list[bytes] = field(default_factory=list)  # payloads without an entry
    hollow: list[bytes] = field(default_factory=list)  # entries without a payload
    lru_wrong: int = 0  # lru keys that are not (entry's last use + key), or missing
    used_stored: int = 0
    used_verified: int = 0

    @property
    def clean(self) -> bool:
        return not (self.corrupt or self.orphans or self.hollow or self.lru_wrong
                    or self.used_stored != self.used_verified)


def well_formed_key(key: Any) -> bool:
    """Could ``key`` (a buffer) be a :class:`storage.record.DiskKey`'s bytes? Its length is
    checked before any byte of it is read."""
    return _KEY_MIN <= len(key) <= _KEY_MAX and key[24] in _KIND_BYTES


def _no_key(name: str, key: Any) -> str:
    return f"a key of {len(key)} bytes in {name} is no record key: the page holding it is damaged"


def _entry_of(key: bytes, raw: Any) -> IndexEntry:
    """The verified entry of index value ``raw``; raises CorruptEntry."""
    fields = check_entry(key, raw)
    return IndexEntry(fields[F_LAST_USED], HEADER.size + fields[F_STORED_LEN], fields[F_RAW_LEN])


class Catalog:
    """Stateless helpers over the tier's sub-databases; all state is in the transaction.

    ``dbs`` is the store's mapping of handles, read on every call: a reset of the store
    replaces its contents.
    """

    def __init__(self, dbs: Mapping[str, Any]) -> None:
        self._dbs = dbs

    def lookup(self, txn: lmdb.Transaction, key: bytes) -> IndexEntry | None:
        """The verified entry of ``key``, None when absent; raises CorruptEntry."""
        raw = txn.get(key, db=self._dbs["index"])
        return None if raw is None else _entry_of(key, raw)

    def has(self, txn: lmdb.Transaction, key: bytes) -> bool:
        return txn.get(key, db=self._dbs["index"]) is not None

    def raw_len(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        """``lookup(...).raw_len`` (read before a waiting get); raises CorruptEntry."""
        entry = self.lookup(txn, key)
        return None if entry is None else entry.raw_len

    def record(self, txn: lmdb.Transaction, key: bytes) -> tuple[Any, Any] | None:
        """``(header, payload)`` (memoryviews in a ``buffers=True`` read), or None when the
        key has no payload. A payload without its header gives a ``b""`` header, which
        fails verification like any other damage."""
        dbs = self._dbs
        payload = txn.get(key, db=dbs["records"])
        if payload is None:
            return None
        header = txn.get(key, db=dbs["index"])
        return (b"" if header is None else header), payload

    def format_version(self, txn: lmdb.Transaction, current: int) -> int:
        """The store's record format; an empty store is stamped ``current`` (write txn)."""
        raw = txn.get(_FORMAT, db=self._dbs["meta"])
        if raw is not None:
            return int(bytes(raw)[0]) if len(raw) == 1 else 0
        if txn.stat(self._dbs["records"])["entries"] == 0:
            txn.put(_FORMAT, bytes([current]), db=self._dbs["meta"])
            return current
        return 1  # records written before the format was stamped: the header led the payload

    def used_bytes(self, txn: lmdb.Transaction) -> int:
        raw = txn.get(_USED, db=self._dbs["meta"])
        return 0 if raw is None or len(raw) != 8 else int(struct.unpack("<Q", raw)[0])

    def add_used(self, txn: lmdb.Transaction, delta: int) -> None:
        used = self.used_bytes(txn) + delta
        if used < 0:  # the stored counter was wrong: derive it again, never trust it
            self.recount(txn)
            return
        txn.put(_USED, struct.pack("<Q", used), db=self._dbs["meta"])

    def recount(self, txn: lmdb.Transaction) -> int:
        """Set ``used_bytes`` to the sum over the verified index entries; returns it."""
        used = sum(entry.record_bytes for entry in self.index_items(txn).values()
                   if entry is not None)
        txn.put(_USED, struct.pack("<Q", used), db=self._dbs["meta"])
        return used

    def insert(self, txn: lmdb.Transaction, key: bytes, header: bytes, payload: Any,
               last_used_ns: int) -> None:
        """Store a record for a key that is absent (callers ``remove`` a replaced one first);
        the caller :meth:`add_used` its ``record_bytes``, once for a whole batch."""
        dbs = self._dbs
        txn.put(key, payload, db=dbs["records"])
        txn.put(key, header, db=dbs["index"])
        txn.put(_TICK.pack(last_used_ns) + key, b"", db=dbs["lru"])

    def remove(self, txn: lmdb.Transaction, key: bytes) -> Removal:
        """Delete ``key``'s record, entry and lru key and take its bytes off the counter.
        An entry that fails verification is removed without trusting it (see module doc)."""
        dbs = self._dbs
        raw = txn.get(key, db=dbs["index"])
        had_payload = txn.delete(key, db=dbs["records"])
        if raw is None:
            return Removal.CORRUPT if had_payload else Removal.ABSENT
        try:
            entry: IndexEntry | None = _entry_of(key, raw)
        except CorruptEntry:
            entry = None
        txn.delete(key, db=dbs["index"])
        if entry is None or not had_payload:
            self._forget_lru(txn, key)
            self.recount(txn)
            return Removal.CORRUPT
        if not txn.delete(_TICK.pack(entry.last_used_ns) + key, db=dbs["lru"]):
            self._forget_lru(txn, key)  # the lru key was damaged: find it by its key
        self.add_used(txn, -entry.record_bytes)
        return Removal.REMOVED

    def _forget_lru(self, txn: lmdb.Transaction, key: bytes) -> None:
        """Delete every lru key of ``key`` whatever its tick (a scan: damage only)."""
        with txn.cursor(db=self._dbs["lru"]) as cur:
            stale = [bytes(k) for k in cur.iternext(values=False) if k[_TICK.size :] == key]
        for lru_key in stale:
            txn.delete(lru_key, db=self._dbs["lru"])

    def drop_lru(self, txn: lmdb.Transaction, lru_key: bytes) -> None:
        """Delete one lru key that names no record (see :meth:`oldest`)."""
        txn.delete(lru_key, db=self._dbs["lru"])

    def touch(self, txn: lmdb.Transaction, key: bytes, now_ns: int) -> None:
        """Move ``key`` to the young end of the LRU order (no-op if it is gone, or if its
        entry fails verification: resealing it would make damage look sound)."""
        dbs = self._dbs
        raw = txn.get(key, db=dbs["index"])
        if raw is None:
            return
        try:
            fields = check_entry(key, raw)
        except CorruptEntry:
            return  # left for the next read or removal of it to find
        last_used = fields[F_LAST_USED]
        if last_used >= now_ns:
            return
        txn.delete(_TICK.pack(last_used) + key, db=dbs["lru"])
        txn.put(_TICK.pack(now_ns) + key, b"", db=dbs["lru"])
        txn.put(key, resealed(key, fields, now_ns), db=dbs["index"])

    def oldest(self, txn: lmdb.Transaction) -> tuple[bytes, bytes] | None:
        """``(lru key, record key)`` of the least recently used record, or None when empty."""
        with txn.cursor(db=self._dbs["lru"]) as cur:
            if not cur.first():
                return None
            lru_key = bytes(cur.key())
        return lru_key, lru_key[_TICK.size :]

    def latest_tick(self, txn: lmdb.Transaction) -> int:
        with txn.cursor(db=self._dbs["lru"]) as cur:
            return int(_TICK.unpack(bytes(cur.key())[: _TICK.size])[0]) if cur.last() else 0

    def quarantine(
        self, txn: lmdb.Transaction, key: bytes, value: bytes, reason: str, now_ns: int
    ) -> Removal:
        """Move a record out of ``records`` (and the index) into ``quarantine``; ``value`` is
        its header and payload as found, joined."""
        removal = self.remove(txn, key)
        kept = reason.encode() + b"\0" + value[:QUARANTINE_KEEP]
        txn.put(key + _TICK.pack(now_ns), kept, db=self._dbs["quarantine"])
        return removal

    def counts(self, txn: lmdb.Transaction) -> dict[str, int]:
        return {name: int(txn.stat(self._dbs[name])["entries"])
                for name in ("records", "index", "lru", "quarantine")}

    def index_items(self, txn: lmdb.Transaction) -> dict[bytes, IndexEntry | None]:
        """Every index entry, verified (None: it fails verification)."""
        items: dict[bytes, IndexEntry | None] = {}
        with txn.cursor(db=self._dbs["index"]) as cur:
            for k, v in cur:
                key = bytes(k)
                try:
                    items[key] = _entry_of(key, v)
                except CorruptEntry:
                    items[key] = None
        return items

    def lru_keys(self, txn: lmdb.Transaction) -> list[bytes]:
        """The full lru keys (tick + record key), oldest first."""
        with txn.cursor(db=self._dbs["lru"]) as cur:
            return [bytes(k) for k in cur.iternext(keys=True, values=False)]

    @staticmethod
    def lru_key(key: bytes, entry: IndexEntry) -> bytes:
        return _TICK.pack(entry.last_used_ns) + key

    def iter_records(self, txn: lmdb.Transaction, start: bytes
                     ) -> Iterator[tuple[bytes, Any, Any]]:
        """(key, header, payload) in key order from the first key >= ``start``."""
        dbs = self._dbs
        with txn.cursor(db=dbs["records"]) as cur:
            if cur.set_range(start):
                for key, payload in cur:
                    header = txn.get(key, db=dbs["index"])
                    yield bytes(key), (b"" if header is None else header), payload

    # -- audit at open ------------------------------------------------------------------

    def audit(self, txn: lmdb.Transaction) -> Audit:
        """Check every entry and derived datum: one pass over the index (a get of each
        payload's presence and lru key beside it), then the counts; the record, lru and
        quarantine keys are walked only where a count disagrees (or, for quarantine, always:
        it is small). Never reads a payload; reads a key only once its length is sane."""
        found = Audit(damage=self.meta_problem(txn))
        if found.damage is not None:
            return found
        dbs = self._dbs
        paired = 0  # index entries that have a payload
        with txn.cursor(db=dbs["index"]) as cur:
            for k, v in cur:
                if not well_formed_key(k):
                    found.damage = _no_key("index", k)
                    return found
                key = bytes(k)
                has_payload = txn.get(key, db=dbs["records"]) is not None
                paired += has_payload
                try:
                    entry = _entry_of(key, v)
                except CorruptEntry as exc:
                    found.corrupt[key] = exc.reason
                    continue
                found.used_verified += entry.record_bytes
                if not has_payload:
                    found.hollow.append(key)
                elif txn.get(self.lru_key(key, entry), db=dbs["lru"]) is None:
                    found.lru_wrong += 1
        if txn.stat(dbs["records"])["entries"] != paired:
            found.damage = self._orphans(txn, found.orphans)
        expected = txn.stat(dbs["index"])["entries"] - len(found.corrupt) - len(found.hollow)
        found.lru_wrong += abs(txn.stat(dbs["lru"])["entries"] - expected)
        if found.lru_wrong:
            found.damage = found.damage or self._malformed_key(txn, "lru", _TICK.size)
        found.damage = found.damage or self._malformed_key(txn, "quarantine", -_TICK.size)
        found.used_stored = self.used_bytes(txn)
        return found

    def meta_problem(self, txn: lmdb.Transaction) -> str | None:
        """What in the meta sub-database no writer of ours makes, or None."""
        with txn.cursor(db=self._dbs["meta"]) as cur:
            for k, v in cur:
                if (bytes(k) if len(k) <= 16 else b"", len(v)) not in ((_USED, 8), (_FORMAT, 1)):
                    return f"the meta sub-database holds a foreign entry ({len(k)} bytes)"
        return None

    def _orphans(self, txn: lmdb.Transaction, orphans: list[bytes]) -> str | None:
        """Append the record keys without an index entry to ``orphans``; returns the damage
        a malformed record key shows, if one is met."""
        dbs = self._dbs
        with txn.cursor(db=dbs["records"]) as cur:
            for k in cur.iternext(values=False):
                if not well_formed_key(k):
                    return _no_key("records", k)
                if txn.get(k, db=dbs["index"]) is None:
                    orphans.append(bytes(k))
        return None

    def _malformed_key(self, txn: lmdb.Transaction, name: str, tick: int) -> str | None:
        """Where in sub-database ``name`` a key is that no writer of ours makes (its record
        key preceded by ``tick`` bytes, or followed by ``-tick``), or None."""
        with txn.cursor(db=self._dbs[name]) as cur:
            for k in cur.iternext(values=False):
                if not well_formed_key(k[tick:] if tick >= 0 else k[:tick]):
                    return _no_key(name, k)
        return None

    def repair(self, txn: lmdb.Transaction, found: Audit, now_ns: int) -> int:
        """Fix what :meth:`audit` found: quarantine entries that fail and payloads without
        an entry, drop entries without a payload, rebuild lru and used_bytes from the
        verified entries. Returns how many keys the audit walked that a delete did not find
        (nonzero: keys out of order in their pages; what is left is not sound, see tier)."""
        dbs = self._dbs
        missed = 0
        for key, reason in found.corrupt.items():
            header = bytes(txn.get(key, db=dbs["index"]) or b"")
            payload = txn.get(key, db=dbs["records"])
            value = header + (bytes(payload[:QUARANTINE_KEEP]) if payload is not None else b"")
            txn.delete(key, db=dbs["records"])
            missed += not txn.delete(key, db=dbs["index"])
            kept = reason.encode() + b"\0" + value[:QUARANTINE_KEEP]
            txn.put(key + _TICK.pack(now_ns), kept, db=dbs["quarantine"])
        for key in found.orphans:
            payload = txn.get(key, db=dbs["records"])
            kept = b"no_index\0" + bytes(payload[:QUARANTINE_KEEP] if payload else b"")
            missed += not txn.delete(key, db=dbs["records"])
            txn.put(key + _TICK.pack(now_ns), kept, db=dbs["quarantine"])
        for key in found.hollow:
            missed += not txn.delete(key, db=dbs["index"])
        missed += self._rebuild_lru(txn)
        self.recount(txn)
        return missed

    def _rebuild_lru(self, txn: lmdb.Transaction) -> int:
        """Make lru exactly {entry's last use + key} over the verified entries; returns how
        many stale lru keys a delete did not find."""
        wanted = {self.lru_key(key, entry) for key, entry in self.index_items(txn).items()
                  if entry is not None}
        have = set(self.lru_keys(txn))
        missed = sum(not txn.delete(lru_key, db=self._dbs["lru"]) for lru_key in have - wanted)
        for lru_key in wanted - have:
            txn.put(lru_key, b"", db=self._dbs["lru"])
        return missed
