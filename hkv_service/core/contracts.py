"""Recovery contracts: per kind, what must hold for an object to be read, what is validated,
and what the fallback is. The funnel reads these; nothing relies on call order.

A column's verdict at an entry is READY (readable now), LOAD (readable after a disk load) or a
:class:`Reason` it is not usable. :func:`summarise` folds an entry's verdicts into the integer
``flags`` the funnel's hot walk tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .layout import Layout
from .memo import drop_memos
from .records import ObjRecord, PrefixEntry
from .states import Kind, Reason, State

__all__ = [
    "CONTRACTS",
    "F_LOAD_MONO",
    "F_LOAD_SWA",
    "F_LOAD_TAIL",
    "F_MONO",
    "F_SWA",
    "F_TAIL",
    "LOAD",
    "READY",
    "RecoveryContract",
    "Verdict",
    "column_verdict",
    "record_verdict",
    "summarise",
    "swa_cover",
]

READY = "READY"
LOAD = "LOAD"
Verdict = str | Reason  # READY, LOAD or the Reason it is unusable

F_MONO = 1  # every COMPRESSED/INDEXER column at this entry is READY or LOAD
F_TAIL = 2  # every TAIL column at this entry is READY or LOAD
F_SWA = 4  # every SWA column at this entry is READY or LOAD (range checked by the funnel)
F_LOAD_MONO = 8
F_LOAD_TAIL = 16
F_LOAD_SWA = 32

_NOT_YET = {State.ALLOCATED: Reason.NOT_WRITTEN, State.WRITING: Reason.NOT_WRITTEN}
_DISK_VERDICT: dict[State, Verdict] = {
    State.ON_DISK_READY: READY,
    State.ON_DISK: LOAD,
    State.ON_DISK_INFLIGHT: Reason.DISK_INFLIGHT,
    State.OFFLOADING: Reason.DISK_INFLIGHT,
    State.LOST: Reason.OWNER_LOST,
    State.CORRUPT: Reason.CORRUPT,
}


@dataclass(frozen=True, slots=True)
class RecoveryContract:
    kind: Kind
    readable_when: str
    validated: str
    fallback: str
    ready_states: frozenset[State]
    extra_check: Callable[[ObjRecord, PrefixEntry, Layout], Reason | None] | None = None


def _indexer_in_sync(rec: ObjRecord, entry: PrefixEntry, layout: Layout) -> Reason | None:
    kv_col = layout.columns[rec.column].indexes
    assert kv_col is not None, "INDEXER column without the column it indexes"
    kv = entry.mem[kv_col]
    kv_disk = entry.disk[kv_col] if entry.disk else None
    kv_version = kv.version if kv is not None else (kv_disk.version if kv_disk else None)
    return None if kv_version == rec.version else Reason.INDEXER_STALE


CONTRACTS: dict[Kind, RecoveryContract] = {
    Kind.COMPRESSED: RecoveryContract(
        Kind.COMPRESSED,
        "COMPRESSED_READY (or its disk copy ON_DISK_READY)",
        "ABI fingerprint of the reader; generation at read",
        "recompute from the block start",
        frozenset({State.COMPRESSED_READY}),
    ),
    Kind.TAIL: RecoveryContract(
        Kind.TAIL,
        "TAIL_COMPLETE holding every raw token its resume point needs",
        "length == tokens required at the boundary; TAIL_PARTIAL never read",
        "resume at the previous boundary whose tail is complete",
        frozenset({State.TAIL_COMPLETE}),
    ),
    Kind.SWA: RecoveryContract(
        Kind.SWA,
        "SWA_VALID(lo, hi) with lo <= max(block start, p-W) and hi >= block end",
        "only blocks intersecting [p-W, p) are checked",
        "shorter p whose window is whole",
        frozenset({State.SWA_VALID}),
    ),
    Kind.INDEXER: RecoveryContract(
        Kind.INDEXER,
        "INDEXER_SYNCED at the version of the KV it indexes",
        "synced version == KV version",
        "recompute the block (KV and index)",
        frozenset({State.INDEXER_SYNCED}),
        _indexer_in_sync,
    ),
    Kind.DISK: RecoveryContract(
        Kind.DISK,
        "ON_DISK_READY (loaded and checksum-verified); ON_DISK needs a load first",
        "xxh3-128 of raw bytes + length on every load",
        "recompute; corrupt copies quarantined",
        frozenset({State.ON_DISK_READY}),
    ),
}


def column_verdict(entry: PrefixEntry, column: int, layout: Layout) -> Verdict:
    rec = entry.mem[column]
    if rec is not None:
        verdict = record_verdict(rec, entry, layout)
        if verdict == READY:
            return verdict
    else:
        verdict = Reason.MISSING_COMPONENT
    disk = entry.disk[column] if entry.disk else None
    return verdict if disk is None else _disk_verdict(disk, entry, layout)


def _disk_verdict(disk: ObjRecord, entry: PrefixEntry, layout: Layout) -> Verdict:
    verdict = _DISK_VERDICT.get(disk.state, Reason.MISSING_COMPONENT)
    contract = CONTRACTS[disk.inner or Kind.DISK]
    if verdict in (READY, LOAD) and contract.extra_check is not None:
        return contract.extra_check(disk, entry, layout) or verdict
    return verdict


def swa_cover(entry: PrefixEntry, column: int, need_lo: int, need_hi: int,
              layout: Layout) -> ObjRecord | None:
    """The record that serves tokens ``[need_lo, need_hi)`` of this SWA block, or None: the
    memory object when it is valid over them, else the disk copy (loaded, or at rest and
    loadable) when that is. The funnel accepts the block with it and the handles point at the
    same record, so a partly rewritten memory object never hides a whole disk copy."""
    mem = entry.mem[column]
    if (mem is not None and record_verdict(mem, entry, layout) == READY
            and mem.lo <= need_lo and mem.hi >= need_hi):
        return mem
    disk = entry.disk[column] if entry.disk else None
    if (disk is not None and _disk_verdict(disk, entry, layout) in (READY, LOAD)
            and disk.lo <= need_lo and disk.hi >= need_hi):
        return disk
    return None


def record_verdict(rec: ObjRecord, entry: PrefixEntry, layout: Layout) -> Verdict:
    contract = CONTRACTS[rec.kind]
    if rec.state in contract.ready_states:
        return (contract.extra_check(rec, entry, layout) if contract.extra_check else None) or READY
    if rec.state is State.TAIL_PARTIAL:
        return Reason.TAIL_INCOMPLETE
    if rec.state is State.INDEXER_WRITTEN:
        return Reason.INDEXER_STALE
    return _NOT_YET.get(rec.state, Reason.MISSING_COMPONENT)


_BITS = {
    Kind.COMPRESSED: (F_MONO, F_LOAD_MONO),
    Kind.INDEXER: (F_MONO, F_LOAD_MONO),
    Kind.TAIL: (F_TAIL, F_LOAD_TAIL),
    Kind.SWA: (F_SWA, F_LOAD_SWA),
}


def summarise(entry: PrefixEntry, layout: Layout, align_of: Callable[[ObjRecord], int]) -> None:
    """Recompute ``entry.flags`` and ``entry.gate`` from its columns' verdicts; ``align_of``
    gives a placed record's byte alignment (its pool knows it). Drops the entry's packed
    handle row and lookup memos: every change to an entry's records passes through here."""
    entry.row = None
    if entry.memos:
        drop_memos(entry)
    flags = F_MONO | F_TAIL | F_SWA
    align = 1 << 30
    for col in layout.attached[entry.depth % layout.period]:
        ok_bit, load_bit = _BITS[layout.columns[col].kind]
        verdict = column_verdict(entry, col, layout)
        if verdict == LOAD:
            flags |= load_bit  # at rest on disk: its block (and alignment) is not chosen yet
            continue
        if verdict != READY:
            flags &= ~ok_bit
            continue
        rec = entry.mem[col]
        if rec is None or record_verdict(rec, entry, layout) != READY:
            rec = entry.disk[col] if entry.disk else None  # a loaded disk copy serves it
        assert rec is not None and rec.block >= 0, "a READY column without a memory block"
        align = min(align, align_of(rec))
    entry.flags = flags
    entry.gate = align if flags & F_MONO else 0
