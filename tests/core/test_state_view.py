"""Owners, restarts, captures, disk transfers under the admission cap."""

from __future__ import annotations

import sys

import pytest

from hkv_service.core.api import (
    AdmissionCap,
    AllocRequest,
    LookupRequest,
    ObjectReport,
    StateConfig,
)
from hkv_service.core.errors import (
    AdmissionRefused,
    IllegalTransition,
    UnknownCapture,
    UnknownLease,
    UnknownObject,
    UnknownOwner,
)
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, Reason, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes
from tests.helpers import reports_of

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
    state.reap_all()  # (a lookup buries only what its walk reads)
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
    inc = new.register_owner(S0, pools_for(new.layout, 64))
    assert new.lookup(LookupRequest(hs)).usable_tokens == 0
    first = [r for r in reports if r.depth < 2]
    assert new.confirm(S0, first, inc) == len(first)
    assert new.lookup(LookupRequest(hs)).usable_tokens == 128
    assert new.confirm(S0, reports, inc) == len(reports) - len(first)  # idempotent for the rest
    assert new.lookup(LookupRequest(hs)).usable_tokens == 256


def test_kv_versions_issued_after_a_restart_never_repeat_confirmed_ones(spec, clock) -> None:
    """Regression: the version counter restarted at 1, so a KV rewritten after a service
    restart could get the very version an old indexer was synced to, and that stale indexer
    then passed as synced (a hit over keys computed for other bytes)."""
    hs = prompt_hashes(spec, 8)
    old = CacheState(spec, clock=clock)
    old.register_owner(S0, pools_for(old.layout, 64))
    ids = commit_prefix(old, hs)
    synced = old.objects[ids[(3, "idx")]].version
    new = CacheState(spec, clock=clock)
    inc = new.register_owner(S0, pools_for(new.layout, 64))
    reports = reports_of(old)
    assert new.confirm(S0, reports, inc) == len(reports)
    idx = next(r for r in new.objects.values() if r.kind is Kind.INDEXER and r.entry.depth == 3)
    new.holds.pins[idx] = 1  # a reader holds the indexer: each KV goes alone
    kv = next(r for r in new.objects.values() if r.kind is Kind.COMPRESSED
              and r.entry.depth == 3 and new.layout.columns[r.column].name == "c4")
    new.evict(kv.object_id)
    issued = set()
    for _ in range(2 * synced + 2):  # rewrite the KV as often as it takes to reach `synced`
        (a,) = new.allocate(hs, [AllocRequest(3, "c4")])
        issued.add(new.transition(a.handle.object_id, Event.WRITE_DONE).version)
        m = new.lookup(LookupRequest(hs))
        assert m.usable_tokens <= 3 * 64, "a stale indexer passed as synced"
        assert any(d.reason is Reason.INDEXER_STALE for d in m.downgrades)
        new.evict(a.handle.object_id)
    assert synced not in issued and idx.state is State.INDEXER_SYNCED


@pytest.mark.parametrize("same_bytes", [True, False])
def test_a_kv_rewritten_with_the_same_bytes_keeps_its_indexer(
    state: CacheState, spec, same_bytes: bool
) -> None:
    """Content versions: the KV evicted under a held indexer and written again with the very
    same bytes has the very same version, so the indexer is still in sync; other bytes make
    it INDEXER_STALE. Content versions never move the view's own counter."""
    from hkv_service.core.api import Params
    from hkv_service.core.hashing import CONTENT_VERSION_BASE, content_version

    hs = prompt_hashes(spec, 8)
    ids = commit_prefix(state, hs)
    kv_bytes = bytes(range(256)) * 4
    kv_id, idx = ids[(3, "c4")], state.objects[ids[(3, "idx")]]
    first = content_version(kv_bytes)
    assert CONTENT_VERSION_BASE <= first < 1 << 63
    kv = state.objects[kv_id]
    state.holds.pins[idx] = 1  # a reader holds the indexer: the KV goes alone
    state.evict(kv_id)
    (a,) = state.allocate(hs, [AllocRequest(3, "c4")])
    state.transition(a.handle.object_id, Event.WRITE_DONE, Params(version=first))
    state.transition(idx.object_id, Event.INDEXER_SYNC, Params(version=first))
    state.evict(a.handle.object_id)  # and once more: rewritten from the same tokens, or not
    (b,) = state.allocate(hs, [AllocRequest(3, "c4")])
    again = content_version(kv_bytes if same_bytes else kv_bytes[::-1])
    state.transition(b.handle.object_id, Event.WRITE_DONE, Params(version=again))
    del state.holds.pins[idx]
    m = state.lookup(LookupRequest(hs))
    if same_bytes:
        assert m.usable_tokens == 8 * 64 and not m.downgrades
    else:
        assert m.usable_tokens == 3 * 64 - 64 and m.downgrades[0].reason is Reason.INDEXER_STALE
    assert kv.version < CONTENT_VERSION_BASE  # issued by the view
    (c,) = state.allocate(prompt_hashes(spec, 1, seed=5), [AllocRequest(0, "c4")])
    assert state.transition(c.handle.object_id, Event.WRITE_DONE).version < CONTENT_VERSION_BASE


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


def test_refused_eviction_leaves_the_partner_indexer(state: CacheState, spec) -> None:
    """Regression (found by the stateful test): evicting a captured KV is refused, and the
    refusal must change nothing. The indexer that goes with the KV used to be evicted first,
    so the refused call still destroyed it and the prefix stopped being a hit."""
    hs = prompt_hashes(spec, 2)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs))
    state.register_capture(m.handles["c4"][:1])  # the KV of depth 0
    before = (state.stats(), m.usable_tokens)
    with pytest.raises(IllegalTransition, match="capture"):
        state.evict(ids[(0, "c4")])
    assert state.objects[ids[(0, "idx")]].state is State.INDEXER_SYNCED
    assert (state.stats(), state.lookup(LookupRequest(hs)).usable_tokens) == before


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
    # Regression: a from_seq near 2**63 gave islice() a stop beyond sys.maxsize (ValueError:
    # a Watch RPC ended UNKNOWN); sequence numbers come off the wire as uint64.
    for far in (sys.maxsize - 1000, sys.maxsize, 2**64 - 1):
        assert state.events_since(far) == []
    assert state.events_since(events[0].seq, limit=1) == events[1:2]


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
