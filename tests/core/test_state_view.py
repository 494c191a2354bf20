"""Owners, restarts, captures, disk transfers under the admission cap."""

from __future__ import annotations

import pytest

from hkv_service.core.admission import AdmissionCap
from hkv_service.core.errors import (
    AdmissionRefused,
    IllegalTransition,
    UnknownCapture,
    UnknownLease,
    UnknownObject,
    UnknownOwner,
)
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.state_view import AllocRequest, CacheState, ObjectReport, StateConfig
from hkv_service.core.states import Event, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0 = ShardId("s0")


def test_heartbeat_expiry_marks_objects_lost(state: CacheState, spec, clock) -> None:
    hs = prompt_hashes(spec, 4)
    commit_prefix(state, hs)
    inc = state.owners[S0].incarnation
    clock.advance(5)
    state.heartbeat(S0, inc)
    clock.advance(9)
    assert state.expire_owners() == []
    clock.advance(2)
    assert state.expire_owners() == [S0]
    assert state.lookup(LookupRequest(hs)).usable_tokens == 0
    with pytest.raises(UnknownOwner, match="re-register"):
        state.heartbeat(S0, inc)


def test_restarted_owner_comes_back_empty(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 4)
    commit_prefix(state, hs)
    state.register_owner(S0, pools_for(state.layout, 128))
    assert state.lookup(LookupRequest(hs)).usable_tokens == 0
    assert state.stats()["gauges"]["objects"] == 0  # type: ignore[index]
    commit_prefix(state, hs)
    assert state.lookup(LookupRequest(hs)).usable_tokens == 256


def test_rebuild_only_from_confirmed_objects(spec, clock) -> None:
    """After a service restart, only what owners re-confirm is a hit."""
    hs = prompt_hashes(spec, 4)
    old = CacheState(spec, clock=clock)
    old.register_owner(S0, pools_for(old.layout, 64))
    commit_prefix(old, hs)
    reports = [
        ObjectReport(
            r.entry.block_hash,
            r.entry.parent.block_hash if r.entry.parent else None,
            r.entry.depth,
            old.layout.columns[r.column].name,
            r.state,
            r.block,
            r.generation,
            r.version,
            r.lo,
            r.hi,
        )
        for r in old.objects.values()
    ]
    new = CacheState(spec, clock=clock)
    new.register_owner(S0, pools_for(new.layout, 64))
    assert new.lookup(LookupRequest(hs)).usable_tokens == 0
    first = [r for r in reports if r.depth < 2]
    assert new.confirm(S0, first) == len(first)
    assert new.lookup(LookupRequest(hs)).usable_tokens == 128
    assert new.confirm(S0, reports) == len(reports) - len(first)  # idempotent for the rest
    assert new.lookup(LookupRequest(hs)).usable_tokens == 256


def test_offload_burst_admits_exactly_cap(spec, clock) -> None:
    st = CacheState(spec, StateConfig(admission=AdmissionCap(max_objects=3)), clock=clock)
    st.register_owner(S0, pools_for(st.layout, 64))
    ids = commit_prefix(st, prompt_hashes(spec, 8))
    c4 = [ids[(d, "c4")] for d in range(8)]
    handles, refused = [], 0
    for oid in c4:
        try:
            handles.append(st.begin_offload(oid, S0))
        except AdmissionRefused:
            refused += 1
    assert len(handles) == 3 and refused == 5
    inflight = [r for r in st.objects.values() if r.state is State.OFFLOADING]
    assert len(inflight) == 3
    for h in handles:
        st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    assert st.admission.stats().in_transit_objects == 0


def test_capture_pins_and_topology_epoch(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 4)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs))
    cap, epoch = state.register_capture(m.handles["c4"])
    with pytest.raises(IllegalTransition, match="capture"):
        state.evict(ids[(1, "c4")])
    assert state.capture_status(cap) == (True, epoch)
    state.mark_owner_lost(S0)  # the memory under the capture is gone: epoch moves on
    valid, new_epoch = state.capture_status(cap)
    assert not valid and new_epoch > epoch
    state.release_capture(cap)
    with pytest.raises(UnknownCapture):
        state.capture_status(cap)


def test_unknown_things_are_not_found(state: CacheState) -> None:
    with pytest.raises(UnknownObject):
        state.transition(ObjectId(99999), Event.WRITE_DONE)
    with pytest.raises(UnknownLease):
        state.release_lease(12345)  # type: ignore[arg-type]


def test_rejected_transition_changes_nothing(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 2)
    (a,) = state.allocate(hs, [AllocRequest(1, "c4.tail")])
    before = state.stats()
    with pytest.raises(IllegalTransition):
        state.transition(a.handle.object_id, Event.INDEXER_SYNC)
    assert state.stats() == before
    assert state.objects[a.handle.object_id].state is State.ALLOCATED


def test_allocate_is_idempotent(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 2)
    (a,) = state.allocate(hs, [AllocRequest(0, "c4")])
    (b,) = state.allocate(hs, [AllocRequest(0, "c4")])
    assert b.existing and b.handle == a.handle
    assert state.stats()["gauges"]["objects"] == 1  # type: ignore[index]


def test_watch_log_records_transitions(state: CacheState, spec) -> None:
    commit_prefix(state, prompt_hashes(spec, 2))
    events = state.events_since(0)
    assert events and [e.seq for e in events] == sorted(e.seq for e in events)
    assert state.events_since(events[-1].seq) == []


def test_owner_lost_mid_load_releases_the_admission_ticket(spec, clock) -> None:
    st = CacheState(spec, clock=clock)
    st.register_owner(S0, pools_for(st.layout, 64))
    st.register_owner(ShardId("s1"), pools_for(st.layout, 64))
    ids = commit_prefix(st, prompt_hashes(spec, 2), owner=S0)
    disk = st.begin_offload(ids[(1, "c4")], S0)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(ids[(1, "c4")])
    st.begin_load(disk.object_id, ShardId("s1"))
    assert st.admission.stats().in_transit_objects == 1
    st.mark_owner_lost(ShardId("s1"))  # the memory the load was going to is gone
    assert st.objects[disk.object_id].state is State.ON_DISK
    assert st.admission.stats().in_transit_objects == 0
