"""The disk tier: checksummed, admission-capped, byte-budgeted LRU storage of cache objects.

Theory of operation.

* Put: objects go in write batches of at most half the admission cap (one ticket each,
  which may wait up to ``wait_s`` or raise AdmissionRefused). A batch is encoded outside any
  lock (xxh3-128 of the raw bytes, zstd when it pays), then one write transaction removes
  replaced records, evicts least-recently-used records until the new ones fit the byte
  budget, inserts them and commits (fsync). While one batch commits, the helper thread
  (:mod:`storage.helper`) encodes the next. Only when :meth:`DiskTier.put_many` returns are
  the objects on disk; the caller may then free its memory copies. Evicted keys are handed
  to ``on_evict`` inside the transaction, before the commit (so the state view drops its
  claim no later than the bytes vanish), and returned in ``RecordMeta.evicted``.
* Get: in one read snapshot, verify the header on the zero-copy view of the map, take a
  ticket sized from it (with ``wait_s > 0`` the size comes from the index first, so the wait
  holds no snapshot), copy the payload out once and verify its xxh3-128; from 512 KiB in
  all, a batch is split between this thread and the helper thread, and one object is
  copied while the helper hashes its source (:mod:`storage.verify`). Any mismatch moves
  the record to quarantine, bumps ``corruption`` and raises CorruptEntry: data that failed
  verification is never returned. ``get_many`` shares one snapshot and one admission per
  batch.
* Last use: a get does not write (a sync write per read would cost an fsync). Reads note the
  key in memory; the next write transaction folds those notes into the ``lru`` sub-database
  before it evicts, so eviction order is exact; a crash loses only recency hints.
* Restart: everything but counters is in LMDB. :meth:`DiskTier.scan` lists what the tier
  holds (verifying headers, or whole records with ``verify=True``) so the metadata service
  can re-register it.
* Damage: opening checks the environment (:mod:`storage.lmdb_store`) and audits the catalog
  (:meth:`Catalog.audit`): index entries that fail their checksum are quarantined and
  counted, lru and the byte counter are rebuilt from the verified entries, and a key no
  writer of ours makes (a page of garbage) sets the environment aside like any other damage;
  so does a repair whose delete misses a key the audit walked (a key out of order in its
  page: the child's walk at open finds those first, this holds when no child could run).
  A store of another record format is set aside as "retired" (never read: its bytes would
  all fail verification, and its objects can be recomputed). An environment found damaged
  while running is replaced by an empty one; the call that met it gets a miss (CorruptEntry
  with reason ``env_damaged``; ``contains`` False, ``scan`` ends, ``delete`` False) or, for a
  put, one retry in the fresh environment. Counted in ``damaged_envs`` / ``retired_envs``.

All methods are thread-safe. LMDB serialises writers; readers run in parallel.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from hkv_service.core.admission import AdmissionGate, AdmissionStats, Ticket
from hkv_service.core.api import AdmissionCap
from hkv_service.core.errors import HkvError, InvalidInput

from .catalog import QUARANTINE_KEEP, Catalog, Removal
from .codec import ProbeStreak, as_byte_view
from .errors import CorruptEntry, DiskFull, NotOnDisk, StoreDamaged
from .helper import run_beside
from .lmdb_store import DiskStore, StoreConfig
from .record import (
    F_RAW_LEN,
    FORMAT_VERSION,
    DiskKey,
    Encoded,
    Load,
    RecordMeta,
    check_header,
    encode_record,
    header_of,
    load_batch,
    load_bytes,
)

__all__ = ["DiskTier", "TierStats"]

log = logging.getLogger(__name__)
T = TypeVar("T")

MiB = 1 << 20
READ_BATCH = 64
WRITE_BATCH_BYTES = 32 * MiB  # per transaction: bounds what one commit holds in LMDB's dirty pages

SCAN_CHUNK = 256
EvictCallback = Callable[[tuple[DiskKey, ...]], None]


@dataclass(frozen=True, slots=True)
class _Batch:
    """An admitted, encoded write batch, waiting for its commit."""

    ticket: Ticket
    encoded: list[Encoded]


@dataclass(frozen=True, slots=True)
class TierStats:
    puts: int
    gets: int
    corruption: int
    quarantined: int
    evicted: int
    entries: int
    bytes_used: int
    budget_bytes: int
    map_size: int
    admission: AdmissionStats
    damaged_envs: int = 0  # environments set aside as damaged (at open or while running)
    retired_envs: int = 0  # stores of another record format, set aside unread


class _Clock:
    """Nanosecond wall time made strictly increasing, so LRU ticks never collide.

    It shares the tier's lock, so a get notes its use in one lock round trip.
    """

    def __init__(self, start: int, lock: threading.Lock) -> None:
        self._last = start
        self._lock = lock

    def now(self) -> int:
        with self._lock:
            return self.now_locked()

    def now_locked(self) -> int:
        """``now`` for a caller that holds the lock."""
        self._last = max(time.time_ns(), self._last + 1)
        return self._last


class DiskTier:
    """One owner's disk tier under ``path``. Open it in the process that uses it."""

    def __init__(
        self,
        path: str | Path,
        budget_bytes: int,
        cap: AdmissionCap | AdmissionGate,
        map_size_max: int | None = None,
        *,
        on_evict: EvictCallback | None = None,
        map_size_initial: int = 64 * MiB,
    ) -> None:
        if budget_bytes < 1:
            raise InvalidInput(f"disk budget must be positive, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self.gate = cap if isinstance(cap, AdmissionGate) else AdmissionGate(cap)
        # Copy-on-write pages and the free list need room beside the budgeted bytes.
        map_max = map_size_max or 2 * budget_bytes + 64 * MiB
        self._store = DiskStore(path, StoreConfig(min(map_size_initial, map_max), map_max),
                                on_create=_stamp_format)
        self._catalog = Catalog(self._store.dbs)
        self._on_evict = on_evict
        self._lock = threading.Lock()  # guards _touched, _counts, _closed and the clock
        self._touched: dict[bytes, int] = {}
        self._counts = dict.fromkeys(("puts", "gets", "corruption", "quarantined", "evicted"), 0)
        self._closed = False
        # (group, kind) -> when to stop sampling its payloads for compression (codec.py)
        self._streaks: dict[tuple[str, str], ProbeStreak] = {}
        try:
            self._clock = _Clock(self._opened(), self._lock)
        except BaseException:
            self._store.close()
            raise

    def _opened(self) -> int:
        """Check the format and audit the catalog of the store just opened (an empty one in
        its place if either sets it aside); returns its latest LRU tick."""
        for _ in range(3):  # damage met here resets the store: audit the fresh one
            try:
                self._check_format()
                self._audit()
                with self._store.read() as txn:
                    return self._catalog.latest_tick(txn)
            except StoreDamaged:
                continue
        raise StoreDamaged("the disk tier keeps meeting damage in a fresh environment",
                           "unusable", self._store.generation)

    def _check_format(self) -> None:
        """Set aside, unread, a store written in another record format: read as this format
        its records would all fail verification, and its objects can be recomputed."""
        with self._store.read() as txn:
            damage = self._catalog.meta_problem(txn)
            generation = self._store.generation
        if damage is not None:  # the format stamp itself cannot be trusted
            self._store.reset(damage, "damaged", generation)
            raise StoreDamaged(damage, damage, generation)
        found = self._store.write(lambda txn: self._catalog.format_version(txn, FORMAT_VERSION))
        if found != FORMAT_VERSION:
            self._store.reset(f"records in format {found}; this version reads format "
                              f"{FORMAT_VERSION} only", "retired")

    def _audit(self) -> None:
        """Verify every index entry and the derived lru and byte counter; repair what is
        wrong (counting quarantined entries as corruption). A malformed key sets the store
        aside as damaged (raises StoreDamaged once it is reset)."""
        with self._store.read() as txn:
            found = self._catalog.audit(txn)
            generation = self._store.generation
        if found.damage is not None:
            self._store.reset(found.damage, "damaged", generation)
            raise StoreDamaged(found.damage, found.damage, generation)
        if found.clean:
            return
        missed = self._store.write(lambda txn: self._catalog.repair(txn, found, time.time_ns()))
        if missed:  # keys a cursor walks but a search misses: a repair by key cannot finish
            damage = (f"the repair at open could not find {missed} keys its audit walked "
                      "(out of order in their pages)")
            self._store.reset(damage, "damaged", generation)
            raise StoreDamaged(damage, damage, generation)
        bad = len(found.corrupt) + len(found.orphans) + len(found.hollow)
        self._bump(corruption=bad, quarantined=len(found.corrupt) + len(found.orphans))
        log.warning("disk tier at %s: %d records failed verification at open and were "
                    "quarantined or dropped; lru and byte counter rebuilt (%d lru keys wrong, "
                    "counter %d, verified %d)", self._store.path, bad, found.lru_wrong,
                    found.used_stored, found.used_verified)

    # -- writes -------------------------------------------------------------------------

    def put(self, key: DiskKey, payload: Any, wait_s: float = 0.0) -> RecordMeta:
        """Store ``payload`` under ``key`` (replacing any record); durable when it returns."""
        return self.put_many([(key, payload)], wait_s)[0]

    def put_many(
        self, items: Sequence[tuple[DiskKey, Any]], wait_s: float = 0.0
    ) -> list[RecordMeta]:
        """Store many objects in write batches, each one transaction; durable on return.

        A batch holds one admission ticket from encoding to commit and is at most half the
        cap's objects and bytes and :data:`WRITE_BATCH_BYTES` (the first object always goes),
        so that two fit the cap: while one batch commits (LMDB's puts and fsync release the
        GIL) the helper thread checksums, probes and seals the next (:mod:`storage.helper`). A
        batch commits whole or not at all; the keys it evicted ride on its last
        ``RecordMeta``. An error in a later batch leaves earlier batches committed, which is
        safe: they are on disk, and a retried put of the same key replaces its record.
        """
        views = [(key, as_byte_view(payload)) for key, payload in items]
        metas: list[RecordMeta] = []
        held: _Batch | None = None  # admitted and encoded, not yet committed
        start = 0
        try:
            while start < len(views):
                ticket = self._admit_batch(views, start, wait_s, beside=held is not None)
                if ticket is None:  # the cap has no room beside the held batch: commit it first
                    assert held is not None
                    done, held = held, None
                    metas += self._commit(done)
                    continue
                chunk = views[start : start + ticket.objects]
                start += ticket.objects
                if held is None:  # nothing to overlap with: encode here
                    held = self._encoded(ticket, chunk)
                else:
                    done, held = held, None
                    committed, held = self._commit_beside(done, ticket, chunk)
                    metas += committed
            if held is not None:
                done, held = held, None
                metas += self._commit(done)
        finally:
            if held is not None:
                self.gate.release(held.ticket)
        return metas

    def _admit_batch(self, views: list[tuple[DiskKey, memoryview]], start: int, wait_s: float,
                     beside: bool) -> Ticket | None:
        """The next write batch's ticket. ``beside`` a held batch it must not wait (the room
        it waits for may be the held batch's own): None when the cap has none left."""
        cap = self.gate.cap
        sizes = [len(view) for _, view in views[start : start + max(1, cap.max_objects // 2)]]
        limit = min(self.budget_bytes, max(1, cap.max_bytes // 2), WRITE_BATCH_BYTES)
        if beside:
            return self.gate.try_acquire_many(sizes, limit)
        return self.gate.acquire_many(sizes, wait_s, limit)

    def _encoded(self, ticket: Ticket, chunk: list[tuple[DiskKey, memoryview]]) -> _Batch:
        """Checksum, probe and seal ``chunk``; on failure its ticket is returned."""
        try:
            encoded = [encode_record(key, view, self._clock.now(), self._streak(key))
                       for key, view in chunk]
            for record in encoded:
                if record.size > self.budget_bytes:
                    raise DiskFull(
                        f"object of {record.size} bytes exceeds the disk tier budget of "
                        f"{self.budget_bytes} bytes; it cannot be stored"
                    )
        except BaseException:
            self.gate.release(ticket)
            raise
        return _Batch(ticket, encoded)

    def _commit_beside(self, done: _Batch, ticket: Ticket,
                       chunk: list[tuple[DiskKey, memoryview]]) -> tuple[list[RecordMeta], _Batch]:
        """Commit ``done`` here; once its puts are in, the helper encodes ``chunk`` (admitted
        by ``ticket``) while the commit syncs.

        Not earlier: the puts release and retake the GIL several times per record, and an
        encoder running Python beside them competes for each retake; the sync holds no GIL
        for milliseconds. Measured against starting before the puts, alternating: 0.83 vs
        0.80-0.82 of a bare LMDB put on tmpfs (256 KiB objects), the same within noise on
        disk.
        """
        started: list[Future[_Batch]] = []

        def start_encoding() -> None:
            if not started:  # the write runs again after a map growth: start once
                started.append(run_beside(self._encoded, ticket, chunk))

        try:
            metas = self._commit(done, start_encoding)
        except BaseException:
            if not started:
                self.gate.release(ticket)
            else:  # the helper reads the caller's payloads: never leave before it ends
                wait_for(started)
                if started[0].exception() is None:
                    self.gate.release(started[0].result().ticket)
            raise
        return metas, started[0].result()  # an encoding error releases its own ticket

    def _commit(self, batch: _Batch, then: Callable[[], None] | None = None
                ) -> list[RecordMeta]:
        """One write transaction for ``batch``; its ticket is returned either way. ``then``
        runs inside it once the records are put, just before the commit syncs."""
        touched = self._take_touched()
        need = sum(record.size for record in batch.encoded)
        try:
            try:
                evicted, corrupt = self._store.write(
                    lambda txn: self._commit_batch(txn, batch, touched, then), need)
            except StoreDamaged:  # the store is empty and sound again: the batch goes there
                touched = {}
                evicted, corrupt = self._store.write(
                    lambda txn: self._commit_batch(txn, batch, {}, then), need)
        except BaseException:
            self._restore_touched(touched)
            raise
        finally:
            self.gate.release(batch.ticket)
        self._bump(puts=len(batch.encoded), evicted=len(evicted), corruption=corrupt)
        metas = [record.meta for record in batch.encoded]
        metas[-1] = replace(metas[-1], evicted=evicted)
        return metas

    def _streak(self, key: DiskKey) -> ProbeStreak:
        stream = (key.group, key.kind)
        streak = self._streaks.get(stream)
        if streak is None:  # a race makes two; one is kept, both are correct
            streak = self._streaks.setdefault(stream, ProbeStreak())
        return streak

    def _commit_batch(self, txn: lmdb.Transaction, batch: _Batch, touched: dict[bytes, int],
                      then: Callable[[], None] | None = None) -> tuple[tuple[DiskKey, ...], int]:
        """Replace, evict and insert; returns the evicted keys and how many removed entries
        failed verification."""
        self._apply_touched(txn, touched)
        # A key given twice in one batch: the later record wins, as if put one after the other.
        latest = {record.meta.key.to_bytes(): record for record in batch.encoded}
        removed = [self._catalog.remove(txn, kb) for kb in latest]  # their bytes make room too
        total = sum(record.size for record in latest.values())
        evicted, corrupt = self._make_room(txn, total, set(latest))
        for kb, record in latest.items():
            self._catalog.insert(txn, kb, record.header, record.stored, record.meta.last_used_ns)
        self._catalog.add_used(txn, total)
        if evicted and self._on_evict is not None:
            self._on_evict(tuple(evicted))
        if then is not None:
            then()
        return tuple(evicted), corrupt + removed.count(Removal.CORRUPT)

    def _make_room(self, txn: lmdb.Transaction, nbytes: int, keep: set[bytes]
                   ) -> tuple[list[DiskKey], int]:
        """Evict oldest first until ``nbytes`` more fit; returns the evicted keys and how many
        of them failed verification (removed all the same, never trusted for sizes)."""
        evicted: list[DiskKey] = []
        corrupt = 0
        while self._catalog.used_bytes(txn) + nbytes > self.budget_bytes:
            oldest = self._catalog.oldest(txn)
            if oldest is None or oldest[1] in keep:
                raise DiskFull(
                    f"batch does not fit the disk tier budget of {self.budget_bytes} bytes"
                )
            lru_key, victim = oldest
            removal = self._catalog.remove(txn, victim)
            if removal is Removal.ABSENT:  # an lru key naming no record: damage, drop it
                self._catalog.drop_lru(txn, lru_key)
                continue
            corrupt += removal is Removal.CORRUPT
            evicted.append(DiskKey.from_bytes(victim))
        return evicted, corrupt

    def delete(self, key: DiskKey) -> bool:
        """Remove ``key``'s record; True if there was one (False after damage reset the
        tier: it holds nothing then)."""
        kb = key.to_bytes()
        touched = self._take_touched()

        def run(txn: lmdb.Transaction) -> Removal:
            self._apply_touched(txn, touched)
            return self._catalog.remove(txn, kb)

        try:
            removal = self._store.write(run)
        except StoreDamaged:
            return False
        if removal is Removal.CORRUPT:
            self._bump(corruption=1)
        return removal is not Removal.ABSENT

    # -- last-use notes -----------------------------------------------------------------

    def _note_uses(self, kbs: Sequence[bytes]) -> None:
        """Count successful gets and note their keys' last use (one lock round trip)."""
        with self._lock:
            touched, now = self._touched, self._clock.now_locked
            for kb in kbs:
                touched[kb] = now()
            self._counts["gets"] += len(kbs)

    def _take_touched(self) -> dict[bytes, int]:
        with self._lock:
            touched, self._touched = self._touched, {}
            return touched

    def _restore_touched(self, touched: dict[bytes, int]) -> None:
        with self._lock:
            for kb, tick in touched.items():
                self._touched[kb] = max(tick, self._touched.get(kb, 0))

    def _apply_touched(self, txn: lmdb.Transaction, touched: dict[bytes, int]) -> None:
        for kb, tick in touched.items():
            self._catalog.touch(txn, kb, tick)

    # -- reads --------------------------------------------------------------------------

    def contains(self, key: DiskKey) -> bool:
        """Whether ``key`` has a record (unverified: a get may still find it corrupt)."""
        try:
            with self._store.read() as txn:
                return self._catalog.has(txn, key.to_bytes())
        except StoreDamaged:
            return False

    def get(self, key: DiskKey, wait_s: float = 0.0) -> bytes:
        """The verified raw bytes of ``key``. Raises NotOnDisk, CorruptEntry, AdmissionRefused."""
        return bytes(self._read_many((key,), [None], wait_s)[0])

    def get_into(self, key: DiskKey, out: Any, wait_s: float = 0.0) -> int:
        """Copy ``key``'s raw bytes into ``out[:n]``, verified; returns n.

        ``out`` is any writable C-contiguous buffer (e.g. a preallocated numpy array) of at
        least n bytes. After an exception its contents are unspecified and must not be used.
        """
        return int(self._read_many((key,), [_writable(out)], wait_s)[0])

    def get_many(self, keys: Sequence[DiskKey], wait_s: float = 0.0) -> list[bytes]:
        """``get`` for many keys, in batches that share one snapshot and one admission."""
        return self._read_many(keys, [None] * len(keys), wait_s)

    def get_many_into(self, keys: Sequence[DiskKey], outs: Sequence[Any],
                      wait_s: float = 0.0) -> list[int]:
        """``get_into`` for many keys, batched like :meth:`get_many`."""
        if len(keys) != len(outs):
            raise InvalidInput(f"{len(keys)} keys but {len(outs)} output buffers")
        dests: list[memoryview | None] = [_writable(out) for out in outs]
        return [int(n) for n in self._read_many(keys, dests, wait_s)]

    def _read_many(self, keys: Sequence[DiskKey], dests: list[memoryview | None],
                   wait_s: float) -> list[Any]:
        """Batches of up to READ_BATCH objects, each in one snapshot with one admission
        (``get`` and ``get_into`` are batches of one).

        Without a wait, each batch's tickets are taken inside its snapshot, sized from the
        verified headers, while the cap (read once per batch) has room; with a wait, sizes
        come from the index first and the first ticket may wait, outside any snapshot.

        Threads: from 512 KiB in all, half of a batch's payloads are copied and verified on
        the helper thread while this one does the other half (``record.load_batch``,
        :mod:`storage.verify`): one handoff per batch, each copy hashed while it is in its
        core's cache. Whole gets on a pool of 4 ran at 0.9x of one thread, and a
        two-stage pipeline (copy object i+1 while a helper hashes the copy of object i) at
        0.59x of raw LMDB against 0.63x serial for 1 MiB: a handoff per object, and the hash
        of a copy already out of cache.
        """
        kbs = [key.to_bytes() for key in keys]
        results: list[Any] = []
        try:
            self._read_batches(kbs, dests, wait_s, results)
        except StoreDamaged as exc:  # reset already: nothing is stored any more, a miss
            raise CorruptEntry(
                f"the disk tier's environment was found damaged ({exc.reason}) and was set "
                "aside; the tier started cold: treat as a miss and recompute",
                "env_damaged",
            ) from exc
        self._note_uses(kbs)
        return results

    def _read_batches(self, kbs: list[bytes], dests: list[memoryview | None], wait_s: float,
                      results: list[Any]) -> None:
        """The loop of :meth:`_read_many`: append every key's verified load to ``results``."""
        while len(results) < len(kbs):
            start = len(results)
            end = min(start + READ_BATCH, len(kbs))
            if wait_s <= 0:
                self._batch_read_admitting(kbs[start:end], dests[start:end], results)
                continue
            sizes = self._raw_sizes(kbs[start:end])
            ticket = self.gate.acquire_many(sizes, wait_s)
            try:
                end = start + ticket.objects
                self._batch_read(kbs[start:end], dests[start:end], results, None)
            finally:
                self.gate.release(ticket)

    def _raw_sizes(self, kbs: list[bytes]) -> list[int]:
        try:
            with self._store.read() as txn:
                sizes = [self._catalog.raw_len(txn, kb) for kb in kbs]
        except CorruptEntry as exc:
            self._quarantine(exc.key, exc.reason)
            raise
        for kb, size in zip(kbs, sizes, strict=True):
            if size is None:
                raise _missing(kb)
        return [size for size in sizes if size is not None]

    def _batch_read_admitting(self, kbs: list[bytes], dests: list[memoryview | None],
                              results: list[Any]) -> None:
        """Read a prefix of ``kbs`` (at least one) in one snapshot, admitting it there."""
        tickets: list[Ticket] = []
        try:
            self._batch_read(kbs, dests, results, tickets)
        finally:
            for ticket in tickets:
                self.gate.release(ticket)

    def _batch_read(self, kbs: list[bytes], dests: list[memoryview | None], results: list[Any],
                    tickets: list[Ticket] | None) -> None:
        """Append verified loads of ``kbs`` to ``results`` inside one snapshot.

        With ``tickets`` (a list to fill), the objects are admitted here, sized from their
        verified headers, by one :meth:`AdmissionGate.acquire_many` (no wait): the first may
        be refused, the batch is cut where the cap is full, and only as many headers are
        checked as the cap has room for. Without, the caller holds a ticket for all of ``kbs``.
        """
        if tickets is not None and len(kbs) > 1:  # a get of one key needs no room probe
            room = self.gate.cap.max_objects - self.gate.stats().in_transit_objects
            kbs = kbs[: max(1, room)]
        record = self._catalog.record
        try:
            with self._store.read() as txn:
                loads: list[Load] = []
                for kb, dest in zip(kbs, dests[: len(kbs)], strict=True):
                    found = record(txn, kb)
                    if found is None:
                        raise _missing(kb)
                    header, payload = found
                    loads.append((kb, payload, check_header(kb, header, len(payload)), dest))
                if tickets is not None:
                    tickets.append(self.gate.acquire_many([ld[2][F_RAW_LEN] for ld in loads]))
                    loads = loads[: tickets[0].objects]
                load_batch(loads, results)  # inside the snapshot: the payloads are its pages
        except CorruptEntry as exc:
            self._quarantine(exc.key, exc.reason)
            raise

    # -- corruption ---------------------------------------------------------------------

    def _quarantine(self, kb: bytes, reason: str) -> None:
        """Move a record that failed verification to quarantine, unless it was replaced."""
        self._bump(corruption=1)
        if not kb:  # no key to move (LMDB refuses an empty one, as it refuses damage)
            return

        def run(txn: lmdb.Transaction) -> bool:
            found = self._catalog.record(txn, kb)
            if found is None or _verifies(kb, *found):
                return False  # deleted or rewritten by another thread meanwhile
            header, payload = found
            kept = bytes(header) + bytes(payload[:QUARANTINE_KEEP])
            self._catalog.quarantine(txn, kb, kept, reason, self._clock.now())
            return True

        try:
            moved = self._store.write(run)
        except StoreDamaged:
            return  # the store was reset: the record is gone with it
        if moved:
            self._bump(quarantined=1)

    # -- index rebuild ------------------------------------------------------------------

    def scan(self, verify: bool = False) -> Iterator[RecordMeta]:
        """Every record the tier holds, in key order, for re-registration after a restart.

        Headers are always verified; ``verify=True`` also checks every payload checksum.
        Records that fail are quarantined and counted, and not yielded. Reads in chunks of
        short snapshots, so a slow consumer never pins old pages. Ends early when damage
        resets the tier (it holds nothing then).
        """
        start = b""
        while True:
            try:
                metas, bad, start_next = self._scan_chunk(start, verify)
            except StoreDamaged:
                return
            for kb, reason in bad:
                self._quarantine(kb, reason)
            yield from metas
            if start_next is None:
                return
            start = start_next

    def _scan_chunk(self, start: bytes, verify: bool
                    ) -> tuple[list[RecordMeta], list[tuple[bytes, str]], bytes | None]:
        metas: list[RecordMeta] = []
        bad: list[tuple[bytes, str]] = []
        with self._store.read() as txn:
            for kb, raw_header, payload in self._catalog.iter_records(txn, start):
                if len(metas) + len(bad) == SCAN_CHUNK:
                    return metas, bad, kb
                try:
                    fields = check_header(kb, raw_header, len(payload))
                    if verify:
                        load_bytes(kb, payload, fields)
                except CorruptEntry as exc:
                    bad.append((kb, exc.reason))
                    continue
                header = header_of(fields)
                metas.append(RecordMeta(DiskKey.from_bytes(kb), header.codec, header.raw_len,
                                        header.stored_len, header.checksum, header.created_ns,
                                        header.last_used_ns))
        return metas, bad, None

    # -- introspection and lifetime -----------------------------------------------------

    def _bump(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def _read_sound(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """``fn`` in a read snapshot; after damage (the store reset) once more, in the fresh
        environment."""
        try:
            with self._store.read() as txn:
                return fn(txn)
        except StoreDamaged:
            with self._store.read() as txn:
                return fn(txn)

    def stats(self) -> TierStats:
        entries, used = self._read_sound(
            lambda txn: (self._catalog.counts(txn)["records"], self._catalog.used_bytes(txn)))
        with self._lock:
            counts = dict(self._counts)
        labels = [aside.label for aside in self._store.set_aside]
        return TierStats(counts["puts"], counts["gets"], counts["corruption"],
                         counts["quarantined"], counts["evicted"], entries, used,
                         self.budget_bytes, self._store.map_size, self.gate.stats(),
                         labels.count("damaged"), labels.count("retired"))

    def quarantine_count(self) -> int:
        return self._read_sound(lambda txn: self._catalog.counts(txn)["quarantine"])

    def check_integrity(self) -> list[str]:
        """Problems with the catalog invariants (see ``storage.catalog``); empty if sound."""
        return self._read_sound(self._integrity)

    def _integrity(self, txn: lmdb.Transaction) -> list[str]:
        index = self._catalog.index_items(txn)
        verified = {kb: entry for kb, entry in index.items() if entry is not None}
        lru = set(self._catalog.lru_keys(txn))
        records = {kb for kb, _, _ in self._catalog.iter_records(txn, b"")}
        used = self._catalog.used_bytes(txn)
        problems = []
        if len(verified) < len(index):
            problems.append(f"{len(index) - len(verified)} index entries fail verification")
        if set(index) != records or lru != {Catalog.lru_key(kb, entry)
                                            for kb, entry in verified.items()}:
            problems.append("records, index and lru hold different key sets")
        if used != sum(entry.record_bytes for entry in verified.values()):
            problems.append(f"used_bytes {used} differs from the sum of record sizes")
        if used > self.budget_bytes:
            problems.append(f"used_bytes {used} exceeds the budget {self.budget_bytes}")
        return problems

    def close(self) -> None:
        """Fold pending last-use notes into LMDB and close the environment. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        touched = self._take_touched()
        if touched:
            with contextlib.suppress(HkvError):  # recency hints only: losing them is harmless
                self._store.write(lambda txn: self._apply_touched(txn, touched))
        self._store.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stamp_format(txn: lmdb.Transaction, dbs: dict[str, Any]) -> None:
    """Mark a new environment as holding records of this format (DiskStore's on_create)."""
    Catalog(dbs).format_version(txn, FORMAT_VERSION)


def _writable(out: Any) -> memoryview:
    try:
        dest = memoryview(out).cast("B")
    except TypeError as exc:
        raise InvalidInput(f"get_into needs a writable buffer, not {type(out).__name__}") from exc
    if dest.readonly:
        raise InvalidInput("get_into needs a writable buffer")
    return dest


def _missing(kb: bytes) -> NotOnDisk:
    return NotOnDisk(f"no disk record for {kb.hex()[:32]}... (never stored, evicted or deleted)")


def _verifies(kb: bytes, header: memoryview, payload: memoryview) -> bool:
    try:
        load_bytes(kb, payload, check_header(kb, header, len(payload)))
    except CorruptEntry:
        return False
    return True

