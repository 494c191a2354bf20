"""The event log is a ring of slots and builds its events when read: it must answer exactly
what a bounded deque of the events built at once answers (the log it replaced), for every
batch size, capacity and read, and make no object a collection would walk."""

from __future__ import annotations

import gc
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_service.core.api import TransitionEvent
from hkv_service.core.events import EventLog
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.records import ObjRecord, PrefixEntry, new_record, set_state
from hkv_service.core.states import Kind, State

NAMES = ("c4", "swa")
KINDS = (Kind.COMPRESSED, Kind.SWA)
STATES = {Kind.COMPRESSED: (State.ALLOCATED, State.WRITING, State.COMPRESSED_READY),
          Kind.SWA: (State.ALLOCATED, State.SWA_VALID, State.LOST)}


def _record(i: int, col: int, state_at: int) -> ObjRecord:
    entry = PrefixEntry(BlockHash(i.to_bytes(16, "little")), None, 0, [None, None])
    kind = KINDS[col]
    return new_record(kind, col, ObjectId(1000 + i), entry, STATES[kind][state_at],
                      ShardId("s"), i, 0, version=1)


def _built(rec: ObjRecord, seq: int, at: float) -> TransitionEvent:
    return TransitionEvent(seq, rec.object_id, rec.kind, rec.state, NAMES[rec.column],
                           rec.entry.block_hash, at)


batches = st.lists(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2)), max_size=25),
                   max_size=12)  # (a batch past the capacity too: only its newest are kept)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 20), batches=batches, reads=st.lists(
    st.tuples(st.integers(-2, 80), st.integers(0, 25)), max_size=6))
def test_the_log_answers_as_a_bounded_deque_of_built_events(
        capacity: int, batches: list[list[tuple[int, int]]],
        reads: list[tuple[int, int]]) -> None:
    log = EventLog(capacity, NAMES)
    ref: deque[TransitionEvent] = deque(maxlen=capacity)
    made = 0
    for t, batch in enumerate(batches):
        recs = [_record(made + j, col, at) for j, (col, at) in enumerate(batch)]
        made += len(recs)
        log.add(recs, [r.state for r in recs], float(t))
        ref.extend(_built(r, log.last_seq - len(recs) + 1 + j, float(t))
                   for j, r in enumerate(recs))
        for r in recs:  # a record moves on after it was logged: its event does not
            set_state(r, State.EVICTED)
        assert len(log) == len(ref) and list(log) == list(ref)
        # it keeps no record it no longer needs (a record named is kept alive): one a held
        # event, each held event's its own
        assert sum(r is not None for r in log._records) == len(log)
        assert log.last_seq == made
        if ref:
            assert log[0] == ref[0] and log[-1] == ref[-1] and log.first_seq == ref[0].seq
        for seq, limit in reads:
            want = [e for e in ref if e.seq > seq][:limit]
            assert log.since(seq, limit) == want


def test_an_empty_log_and_bad_index() -> None:
    log = EventLog(4, NAMES)
    assert len(log) == 0 and list(log) == [] and log.since(0, 10) == []
    assert log.first_seq == 1
    with pytest.raises(IndexError):
        log[0]
    log.add([], [], 0.0)
    assert log.last_seq == 0
    with pytest.raises(ValueError, match="at least one"):
        EventLog(0, NAMES)


def test_logging_makes_no_object_for_the_collector() -> None:
    """A write logs its transitions one call each: each object the log made would be one
    more for every bounded collection of the service to walk (chunks and their tuples were
    2/3 of them). One transition, a batch, a batch past the ring's end: none."""
    log = EventLog(8, NAMES)
    recs = [_record(i, 0, 0) for i in range(20)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = len(gc.get_objects())
        log.add(recs[:1], [State.WRITING], 1.0)
        log.add(recs[1:6], [State.WRITING] * 5, 2.0)
        log.add(recs[6:11], [State.ALLOCATED] * 5, 3.0)  # wraps
        made = len(gc.get_objects()) - before
    finally:
        if enabled:
            gc.enable()
    assert made == 0
    assert [e.seq for e in log] == list(range(4, 12))
    assert [e.object_id for e in log] == [r.object_id for r in recs[3:11]]
    assert [e.at for e in log] == [2.0, 2.0, 2.0] + [3.0] * 5
