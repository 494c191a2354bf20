"""Walk the whole transition table: every legal move applies, every other raises and changes
nothing. Preconditions each get a case of their own."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hkv_service.core.allocator import _EVICTABLE
from hkv_service.core.api import Params
from hkv_service.core.errors import IllegalTransition, VersionConflict
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.records import ObjRecord, PrefixEntry, new_record
from hkv_service.core.states import Event, Kind, State
from hkv_service.core.transitions import TABLE, apply


class Ctx:
    kv_version = 7
    holds = (0, 0)  # (leases, captures) on every record

    def kv_version_for(self, record: ObjRecord) -> int | None:
        return self.kv_version

    def block_range(self, record: ObjRecord) -> tuple[int, int]:
        return (0, 64)

    def tail_required(self, record: ObjRecord) -> int:
        return 4

    def holds_of(self, record: ObjRecord) -> tuple[int, int]:
        return self.holds


def record(kind: Kind, state: State) -> ObjRecord:
    entry = PrefixEntry(BlockHash(bytes(16)), None, 0, [None])
    return new_record(kind, 0, ObjectId(1), entry, state, ShardId("s"), 0, 0)


GOOD = Params(version=7, lo=0, hi=64, tail_len=4)
APPEND = Params(tail_len=3)


def snapshot(rec: ObjRecord) -> dict[str, object]:
    # (state and shard are the record's class's: records.set_state)
    return {f.name: getattr(rec, f.name) for f in dataclasses.fields(rec) if f.name != "entry"
            } | {"state": rec.state, "shard": rec.shard}


@pytest.mark.parametrize(
    ("kind", "state", "event"),
    [(k, s, e) for k in TABLE for (s, e) in TABLE[k]],
    ids=lambda v: str(v),
)
def test_every_legal_transition_applies(kind: Kind, state: State, event: Event) -> None:
    rec = record(kind, state)
    params = APPEND if event is Event.TAIL_APPEND else GOOD
    assert apply(rec, event, params, Ctx()) is TABLE[kind][(state, event)]
    assert rec.state is TABLE[kind][(state, event)] and rec.seq == 1


ILLEGAL = [(k, s, e) for k, s, e in itertools.product(Kind, State, Event) if (s, e) not in TABLE[k]]


@pytest.mark.parametrize(("kind", "state", "event"), ILLEGAL, ids=lambda v: str(v))
def test_every_illegal_transition_raises_and_changes_nothing(
    kind: Kind, state: State, event: Event
) -> None:
    rec = record(kind, state)
    before = snapshot(rec)
    with pytest.raises(IllegalTransition, match=event.value):
        apply(rec, event, GOOD, Ctx())
    assert snapshot(rec) == before


def test_table_covers_examples_from_the_reliability_matrix() -> None:
    assert (State.ON_DISK_READY, Event.TAIL_APPEND) not in TABLE[Kind.DISK]
    # a tail being written is never the eviction policy's victim (only a writer replacing a
    # stalled one retires it, AllocRequest.replace)
    assert State.TAIL_PARTIAL not in _EVICTABLE


@pytest.mark.parametrize("kind", [Kind.COMPRESSED, Kind.SWA, Kind.INDEXER, Kind.TAIL])
def test_no_event_commits_new_bytes_over_an_object_that_has_some(kind: Kind) -> None:
    """An object's bytes are written once (issue 35, item 1): from any state past the first
    write no WRITE_DONE / TAIL_DONE is legal, so a rewrite can only be a fresh object."""
    written = {s for (s, e), _ in TABLE[kind].items()
               if e in (Event.WRITE_DONE, Event.TAIL_DONE, Event.TAIL_APPEND)}
    assert written <= {State.ALLOCATED, State.WRITING, State.TAIL_PARTIAL}


@pytest.mark.parametrize(
    ("kind", "state", "event", "params", "phrase"),
    [
        (Kind.INDEXER, State.INDEXER_WRITTEN, Event.INDEXER_SYNC, Params(version=6), "version 7"),
        (Kind.TAIL, State.TAIL_PARTIAL, Event.TAIL_DONE, Params(tail_len=3), "needs 4"),
        (Kind.TAIL, State.ALLOCATED, Event.TAIL_APPEND, Params(tail_len=9), "at most 4"),
        (Kind.SWA, State.ALLOCATED, Event.WRITE_DONE, Params(lo=-1, hi=10), "inside its block"),
        (Kind.SWA, State.ALLOCATED, Event.WRITE_DONE, Params(lo=20, hi=10), "inside its block"),
    ],
)
def test_preconditions(kind, state, event, params, phrase) -> None:
    rec = record(kind, state)
    before = snapshot(rec)
    with pytest.raises(IllegalTransition, match=phrase):
        apply(rec, event, params, Ctx())
    assert snapshot(rec) == before


def test_indexer_sync_before_compressed_ready_is_refused() -> None:
    ctx = Ctx()
    ctx.kv_version = None  # type: ignore[assignment]
    rec = record(Kind.INDEXER, State.INDEXER_WRITTEN)
    with pytest.raises(IllegalTransition, match="not COMPRESSED_READY"):
        apply(rec, Event.INDEXER_SYNC, Params(version=1), ctx)


def test_an_swa_range_never_changes_once_valid() -> None:
    rec = record(Kind.SWA, State.ALLOCATED)
    apply(rec, Event.WRITE_DONE, Params(lo=0, hi=40), Ctx())
    for lo, hi in ((8, 40), (0, 64)):  # narrower or wider: new bytes, a fresh object
        with pytest.raises(IllegalTransition, match="WRITE_DONE is not allowed"):
            apply(rec, Event.WRITE_DONE, Params(lo=lo, hi=hi), Ctx())
    assert (rec.lo, rec.hi) == (0, 40)


def test_eviction_refused_while_leased_or_captured() -> None:
    for holds, word in (((1, 0), "leased"), ((0, 1), "graph capture")):
        rec = record(Kind.COMPRESSED, State.COMPRESSED_READY)
        ctx = Ctx()
        ctx.holds = holds
        with pytest.raises(IllegalTransition, match=word):
            apply(rec, Event.EVICT, Params(), ctx)
        assert rec.state is State.COMPRESSED_READY


def test_compare_and_set() -> None:
    rec = record(Kind.COMPRESSED, State.ALLOCATED)
    apply(rec, Event.BEGIN_WRITE, Params(expect_seq=0), Ctx())
    with pytest.raises(VersionConflict):
        apply(rec, Event.WRITE_DONE, Params(expect_seq=0), Ctx())
    assert rec.state is State.WRITING
