"""A disk object's loaded memory copy is held like any readable object.

Regression: ``evict`` of a loaded disk copy (ON_DISK_READY) applied DROP_COPY, which had no
hold check: it freed the memory block under a reader's lease and under a graph capture that
recorded its address (the block could then be reused by another object while the captured
graph still read it: a silent error). The copy's owner being lost is different: that memory
is gone whatever holds it, so the copy is dropped and the captures are invalidated.
"""

from __future__ import annotations

import pytest

from hkv_service.core.api import Handle, LookupRequest
from hkv_service.core.errors import IllegalTransition, StaleHandle
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0, S1 = ShardId("s0"), ShardId("s1")
N = 4


def _loaded(depth: int = 1) -> tuple[CacheState, list[BlockHash], ObjectId]:
    """A prefix whose c4 KV (and its indexer) at ``depth`` was offloaded, evicted from memory,
    then loaded back onto S1: its disk object is ON_DISK_READY."""
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 64))
    st.register_owner(S1, pools_for(st.layout, 64))
    hs = prompt_hashes(st.spec, N)
    ids = commit_prefix(st, hs, owner=S0)
    disks = {}
    for col in ("c4", "idx"):
        h = st.begin_offload(ids[(depth, col)], S0)
        st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
        disks[col] = h.object_id
    st.evict(ids[(depth, "c4")])
    for oid in disks.values():
        mh = st.begin_load(oid, S1)
        st.transition(oid, Event.LOAD_VERIFIED, None, mh.generation)
    assert st.objects[disks["c4"]].state is State.ON_DISK_READY
    return st, hs, disks["c4"]


def _copy_handle(st: CacheState, handles: dict[str, list[Handle]], oid: ObjectId) -> Handle:
    return next(h for hs in handles.values() for h in hs if h.object_id == oid)


def _snapshot(st: CacheState, oid: ObjectId) -> tuple[State, int, int]:
    rec = st.objects[oid]
    return rec.state, rec.block, rec.seq


def test_a_leased_loaded_copy_is_not_dropped() -> None:
    st, hs, oid = _loaded()
    m = st.lookup(LookupRequest(hs, lease_ttl_s=30))
    assert m.usable_tokens == N * 64 and m.lease_id is not None
    handle = _copy_handle(st, m.handles, oid)
    before = _snapshot(st, oid)
    with pytest.raises(IllegalTransition, match="leased"):
        st.evict(oid)
    with pytest.raises(IllegalTransition, match="leased"):
        st.transition(oid, Event.DROP_COPY)  # as a shard would report it
    assert _snapshot(st, oid) == before
    st.check_read(handle, m.lease_id)  # the reader's bytes are still there
    st.release_lease(m.lease_id)
    st.evict(oid)
    assert st.objects[oid].state is State.ON_DISK and st.objects[oid].block == -1


def test_a_captured_loaded_copy_is_not_dropped() -> None:
    st, hs, oid = _loaded()
    m = st.lookup(LookupRequest(hs))
    cap, epoch = st.register_capture([_copy_handle(st, m.handles, oid)])
    before = _snapshot(st, oid)
    with pytest.raises(IllegalTransition, match="graph capture"):
        st.evict(oid)
    assert _snapshot(st, oid) == before
    assert st.capture_status(cap) == (True, epoch)
    st.release_capture(cap)
    st.evict(oid)
    assert st.objects[oid].state is State.ON_DISK


@pytest.mark.parametrize("reaped", [False, True])
def test_losing_the_copys_owner_drops_it_whatever_holds_it(reaped: bool) -> None:
    """Unreaped (the loss was O(1), the copy not buried yet) or reaped, the copy is gone."""
    st, hs, oid = _loaded()
    m = st.lookup(LookupRequest(hs, lease_ttl_s=30))
    assert m.lease_id is not None
    handle = _copy_handle(st, m.handles, oid)
    cap, epoch = st.register_capture([handle])
    st.mark_owner_lost(S1)  # the memory the copy was in is gone: a fact, not a policy
    if reaped:
        st.reap_all()
        rec = st.objects[oid]
        assert rec.kind is Kind.DISK and rec.state is State.ON_DISK and rec.block == -1
    valid, new_epoch = st.capture_status(cap)
    assert not valid and new_epoch > epoch
    with pytest.raises(StaleHandle, match="stale"):
        st.check_read(handle, m.lease_id)
    assert st.objects[oid].state is State.ON_DISK  # touched: buried back to rest
    again = st.lookup(LookupRequest(hs))
    assert all(h.object_id != oid or h.block != handle.block or h.shard != S1
               for hs_ in again.handles.values() for h in hs_)


@pytest.mark.parametrize("event", [Event.LOSE, Event.MARK_CORRUPT])
def test_a_reported_loss_or_corruption_invalidates_the_captures_on_it(event: Event) -> None:
    """Regression: only the service's own owner-loss verdict invalidated captures; an owner
    reporting an object LOST or CORRUPT (a fact: the bytes are gone or wrong) left a graph
    captured over it valid, to be replayed over a block about to be reused."""
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 64))
    hs = prompt_hashes(st.spec, N)
    ids = commit_prefix(st, hs, owner=S0)
    m = st.lookup(LookupRequest(hs))
    oid = ids[(1, "c4")]
    cap, epoch = st.register_capture([_copy_handle(st, m.handles, oid)])
    st.transition(oid, event)
    valid, new_epoch = st.capture_status(cap)
    assert not valid and new_epoch > epoch


def test_a_reported_copy_loss_drops_a_held_copy_and_invalidates_its_captures() -> None:
    st, hs, oid = _loaded()
    m = st.lookup(LookupRequest(hs, lease_ttl_s=30))
    cap, epoch = st.register_capture([_copy_handle(st, m.handles, oid)])
    st.transition(oid, Event.COPY_LOST)  # the shard says the copy's memory is gone: a fact
    assert st.objects[oid].state is State.ON_DISK and st.objects[oid].block == -1
    assert st.capture_status(cap) == (False, epoch + 1)
