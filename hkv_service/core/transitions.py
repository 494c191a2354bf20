"""The one transition table. Nothing else in hkv assigns ``ObjRecord.state``.

``TABLE[kind][(state, event)] -> next state``; a missing key is an illegal transition.
``PRECONDITIONS[(kind, event)]`` is checked next; it returns a sentence when the transition
must not happen. :func:`apply` raises :class:`IllegalTransition` for either and then leaves the
record exactly as it was. The docs' state diagrams are generated from ``TABLE``
(``hkv_service.core.diagram``), so they cannot drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .errors import IllegalTransition, VersionConflict
from .records import (
    DiskRecord,
    ObjRecord,
    SwaRecord,
    TailRecord,
    VersionedRecord,
    set_state,
)
from .states import Event, Kind, State

__all__ = [
    "APPLIED_FIELDS",
    "CORE_ONLY_EVENTS",
    "PRECONDITIONS",
    "TABLE",
    "Params",
    "TransitionContext",
    "apply",
]

S, E = State, Event

_LOSS = {
    (S.ALLOCATED, E.LOSE): S.LOST,
    (S.WRITING, E.LOSE): S.LOST,
}


# An object's bytes are written once: no event commits new bytes over an object that has
# some (a reader, a lease, a re-confirm or a tag may name them). A rewrite is a fresh object
# (``AllocRequest.replace`` retires the old one first); WRITE_DONE is a move out of
# ALLOCATED/WRITING only.
def _memory_kind(ready: State) -> dict[tuple[State, Event], State]:
    return {
        (S.ALLOCATED, E.BEGIN_WRITE): S.WRITING,
        (S.ALLOCATED, E.WRITE_DONE): ready,
        (S.WRITING, E.WRITE_DONE): ready,
        (S.ALLOCATED, E.EVICT): S.EVICTED,  # a writer gave up before writing anything
        (ready, E.EVICT): S.EVICTED,
        (ready, E.LOSE): S.LOST,
        (ready, E.MARK_CORRUPT): S.CORRUPT,
        **_LOSS,
    }


_INDEXER = {
    **_memory_kind(S.INDEXER_WRITTEN),
    (S.INDEXER_WRITTEN, E.INDEXER_SYNC): S.INDEXER_SYNCED,
    (S.INDEXER_SYNCED, E.INDEXER_SYNC): S.INDEXER_SYNCED,
    (S.INDEXER_SYNCED, E.EVICT): S.EVICTED,
    (S.INDEXER_SYNCED, E.LOSE): S.LOST,
    (S.INDEXER_SYNCED, E.MARK_CORRUPT): S.CORRUPT,
}

_TAIL = {
    (S.ALLOCATED, E.TAIL_APPEND): S.TAIL_PARTIAL,
    (S.ALLOCATED, E.TAIL_DONE): S.TAIL_COMPLETE,
    (S.ALLOCATED, E.EVICT): S.EVICTED,
    (S.TAIL_PARTIAL, E.TAIL_APPEND): S.TAIL_PARTIAL,
    (S.TAIL_PARTIAL, E.TAIL_DONE): S.TAIL_COMPLETE,
    (S.TAIL_PARTIAL, E.LOSE): S.LOST,
    # The eviction policy never picks a tail being written (allocator._EVICTABLE); a writer
    # that replaces a stalled one retires it (AllocRequest.replace).
    (S.TAIL_PARTIAL, E.EVICT): S.EVICTED,
    (S.TAIL_COMPLETE, E.EVICT): S.EVICTED,
    (S.TAIL_COMPLETE, E.LOSE): S.LOST,
    (S.TAIL_COMPLETE, E.MARK_CORRUPT): S.CORRUPT,
    **_LOSS,
}

_DISK = {
    (S.OFFLOADING, E.OFFLOAD_COMMITTED): S.ON_DISK,
    (S.OFFLOADING, E.OFFLOAD_FAILED): S.EVICTED,  # rolled back: never visible
    (S.OFFLOADING, E.LOSE): S.LOST,
    (S.ON_DISK, E.LOAD_BEGIN): S.ON_DISK_INFLIGHT,
    (S.ON_DISK, E.EVICT): S.EVICTED,
    (S.ON_DISK, E.MARK_CORRUPT): S.CORRUPT,
    (S.ON_DISK, E.LOSE): S.LOST,
    (S.ON_DISK_INFLIGHT, E.LOAD_VERIFIED): S.ON_DISK_READY,
    (S.ON_DISK_INFLIGHT, E.LOAD_FAILED): S.ON_DISK,
    (S.ON_DISK_INFLIGHT, E.MARK_CORRUPT): S.CORRUPT,
    (S.ON_DISK_INFLIGHT, E.LOSE): S.LOST,
    (S.ON_DISK_READY, E.DROP_COPY): S.ON_DISK,  # policy: refused while a reader holds it
    (S.ON_DISK_READY, E.COPY_LOST): S.ON_DISK,  # a fact: gone whatever holds it
    (S.ON_DISK_READY, E.EVICT): S.EVICTED,
    (S.ON_DISK_READY, E.MARK_CORRUPT): S.CORRUPT,
    (S.ON_DISK_READY, E.LOSE): S.LOST,
}

# Events only the core's own paths cause, never an owner's report: LOAD_BEGIN moves a copy at
# rest in flight together with the block and admission ticket begin_load reserves (reported,
# it left a copy in flight with neither, and a later LOAD_VERIFIED one "loaded" at block -1);
# OFFLOAD_BEGIN is begin_offload making the copy. Refused where reports come in.
CORE_ONLY_EVENTS = frozenset({Event.LOAD_BEGIN, Event.OFFLOAD_BEGIN})

TABLE: dict[Kind, dict[tuple[State, Event], State]] = {
    Kind.COMPRESSED: _memory_kind(S.COMPRESSED_READY),
    Kind.SWA: _memory_kind(S.SWA_VALID),
    Kind.INDEXER: _INDEXER,
    Kind.TAIL: _TAIL,
    # a recurrent state is written whole, once, as of its boundary (an engine hands it off
    # in the step that computed up to there), and read only to resume exactly there
    Kind.STATE: _memory_kind(S.STATE_READY),
    Kind.DISK: _DISK,
}


@dataclass(frozen=True, slots=True)
class Params:
    """Arguments an event may carry. Unused fields are ignored by events that don't need them."""

    version: int | None = None
    lo: int | None = None
    hi: int | None = None
    tail_len: int | None = None
    expect_seq: int | None = None  # compare-and-set: fail unless the record's seq matches


class TransitionContext(Protocol):
    """What preconditions may ask the state view; implemented by ``CacheState``."""

    def kv_version_for(self, record: ObjRecord) -> int | None: ...
    def block_range(self, record: ObjRecord) -> tuple[int, int]: ...
    def tail_required(self, record: ObjRecord) -> int: ...
    def holds_of(self, record: ObjRecord) -> tuple[int, int]: ...  # (leases, captures)


Check = Callable[[ObjRecord, Params, TransitionContext], str | None]


def _no_pins(rec: ObjRecord, _p: Params, ctx: TransitionContext) -> str | None:
    pins, captures = ctx.holds_of(rec)
    if pins:
        return f"object {rec.object_id} is leased by {pins} reader(s)"
    if captures:
        return f"object {rec.object_id} is pinned by {captures} graph capture(s)"
    return None


def _indexer_sync(rec: ObjRecord, p: Params, ctx: TransitionContext) -> str | None:
    kv = ctx.kv_version_for(rec)
    if kv is None:
        return "the compressed KV this indexer indexes is not COMPRESSED_READY"
    if p.version is None or p.version != kv:
        return f"indexer sync to version {p.version} but its KV is at version {kv}"
    return None


def _swa_range(rec: ObjRecord, p: Params, ctx: TransitionContext) -> str | None:
    start, end = ctx.block_range(rec)
    lo = start if p.lo is None else p.lo
    hi = end if p.hi is None else p.hi
    if not start <= lo <= hi <= end:
        return f"SWA range [{lo}, {hi}) must lie inside its block [{start}, {end})"
    return None


def _tail_append(rec: ObjRecord, p: Params, ctx: TransitionContext) -> str | None:
    need = ctx.tail_required(rec)
    if p.tail_len is None or not rec.hi < p.tail_len <= need:
        return f"tail length must grow from {rec.hi} up to at most {need}, got {p.tail_len}"
    return None


def _tail_done(rec: ObjRecord, p: Params, ctx: TransitionContext) -> str | None:
    need = ctx.tail_required(rec)
    have = rec.hi if p.tail_len is None else p.tail_len
    if have != need:
        return f"tail holds {have} raw tokens but its boundary needs {need}"
    return None


PRECONDITIONS: dict[tuple[Kind, Event], Check] = {
    **{(k, Event.EVICT): _no_pins for k in Kind},
    (Kind.DISK, Event.DROP_COPY): _no_pins,  # freeing a loaded copy is an eviction too
    (Kind.INDEXER, Event.INDEXER_SYNC): _indexer_sync,
    (Kind.SWA, Event.WRITE_DONE): _swa_range,
    (Kind.TAIL, Event.TAIL_APPEND): _tail_append,
    (Kind.TAIL, Event.TAIL_DONE): _tail_done,
}


def _write_fields(rec: ObjRecord, event: Event, p: Params, ctx: TransitionContext) -> None:
    # Each kind's class stores only its own fields (see records.new_record).
    if isinstance(rec, SwaRecord) and event is Event.WRITE_DONE:
        start, end = ctx.block_range(rec)
        rec.lo = start if p.lo is None else p.lo
        rec.hi = end if p.hi is None else p.hi
    elif isinstance(rec, TailRecord) and p.tail_len is not None:
        rec.hi = p.tail_len
    elif isinstance(rec, VersionedRecord | DiskRecord) and (
        event is Event.INDEXER_SYNC or (rec.kind is Kind.COMPRESSED and p.version is not None)
    ):
        rec.version = rec.version if p.version is None else p.version


# Every record field :func:`apply` may assign (``_write_fields`` and the state); a rehearsal
# (``CacheState.transition_many``) puts exactly these back.
APPLIED_FIELDS = ("state", "seq", "version", "lo", "hi")


def apply(rec: ObjRecord, event: Event, params: Params, ctx: TransitionContext) -> State:
    """Move ``rec`` by ``event`` or raise, changing nothing. Returns the new state."""
    if params.expect_seq is not None and params.expect_seq != rec.seq:
        raise VersionConflict(
            f"object {rec.object_id} changed concurrently (seq {rec.seq}, "
            f"expected {params.expect_seq}); re-read and retry"
        )
    target = TABLE[rec.kind].get((rec.state, event))
    if target is None:
        raise IllegalTransition(
            f"{rec.kind.value} object {rec.object_id}: {event.value} is not allowed "
            f"in state {rec.state.value}", state=rec.state, event=event,
        )
    check = PRECONDITIONS.get((rec.kind, event))
    why = check(rec, params, ctx) if check else None
    if why:
        raise IllegalTransition(f"{rec.kind.value} object {rec.object_id}: {event.value}: {why}",
                                state=rec.state, event=event, precondition=why)
    _write_fields(rec, event, params, ctx)
    set_state(rec, target)
    rec.seq += 1
    return target
