"""The residency feed (core/kvevents.py): a stored change when an object becomes readable in
a tier, a removed change for every way it stops (issue 39), read from the transition log."""

from __future__ import annotations

from hkv_service.core.api import AllocRequest, Params, PoolConfig, StateConfig
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.kvevents import BlockChange, ResidencyFeed
from hkv_service.core.spec import CacheSpec, spec_from_dict
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0, S1, D0 = ShardId("s0"), ShardId("s1"), ShardId("d0")


def _state(spec: CacheSpec, log: int = 8192, device: str = "cpu") -> CacheState:
    st = CacheState(spec, StateConfig(log_capacity=log))
    pools = {k: PoolConfig(p.num_blocks, p.stride, p.base_align, device=device)
             for k, p in pools_for(st.layout, 128).items()}
    st.register_owner(S0, pools)
    st.register_owner(D0, {})
    return st


def _poll(st: CacheState, feed: ResidencyFeed) -> list[BlockChange]:
    return list(st.poll_residency(feed).changes)


def _started(st: CacheState) -> ResidencyFeed:
    feed = ResidencyFeed()
    first = st.poll_residency(feed)
    assert first.cleared and not first.changes
    return feed


def _keys(changes: list[BlockChange]) -> set[tuple[bool, str, int, BlockHash]]:
    return {(c.stored, c.medium, c.column, c.span[-1]) for c in changes}


def test_every_written_object_is_stored_once_with_its_span_and_parent(spec: CacheSpec) -> None:
    st = _state(spec, device="cuda")
    feed = _started(st)
    hs = prompt_hashes(spec, 4)
    ids = commit_prefix(st, hs)
    changes = _poll(st, feed)
    assert len(changes) == len(ids)  # one each: written (not readable) then ready
    lay = st.layout
    want = {(True, "GPU", lay.by_name[col], hs[d]) for d, col in ids}
    assert _keys(changes) == want
    c128 = next(c for c in changes if c.column == lay.by_name["c128"] and c.span[-1] == hs[3])
    assert c128.span == (hs[2], hs[3]) and c128.parent == hs[1]  # 128 tokens = 2 hash blocks
    c4 = next(c for c in changes if c.column == lay.by_name["c4"] and c.span[-1] == hs[0])
    assert c4.span == (hs[0],) and c4.parent is None
    assert _poll(st, feed) == []  # nothing new: nothing told twice


def test_evicted_and_corrupt_objects_are_removed(spec: CacheSpec) -> None:
    st = _state(spec)
    feed = _started(st)
    hs = prompt_hashes(spec, 2)
    ids = commit_prefix(st, hs)
    _poll(st, feed)
    swa, c4 = ids[(1, "swa")], ids[(0, "c4")]
    st.evict(swa)
    st.transition(c4, Event.MARK_CORRUPT)
    lay = st.layout
    assert _keys(_poll(st, feed)) == {(False, "CPU", lay.by_name["swa"], hs[1]),
                                      (False, "CPU", lay.by_name["c4"], hs[0])}


def test_a_lost_owners_objects_are_removed_as_the_reaper_buries_them(spec: CacheSpec) -> None:
    st = _state(spec)
    feed = _started(st)
    ids = commit_prefix(st, prompt_hashes(spec, 8))
    _poll(st, feed)
    st.mark_owner_lost(S0)
    removed: list[BlockChange] = []
    slices = 0
    while st.reap(budget=4):  # bounded slices: each poll sees what one slice buried
        slices += 1
        removed += _poll(st, feed)
    removed += _poll(st, feed)
    assert slices > 1
    assert all(not c.stored for c in removed)
    assert len(removed) == len(ids) == len({c.object_id for c in removed})


def test_disk_tier_stored_loaded_dropped_and_evicted(spec: CacheSpec) -> None:
    st = _state(spec)
    feed = _started(st)
    hs = prompt_hashes(spec, 2)
    oid = commit_prefix(st, hs)[(0, "c4")]
    _poll(st, feed)
    h = st.begin_offload(oid, D0)
    assert _poll(st, feed) == []  # OFFLOADING is not at rest
    st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(oid)  # the memory object goes (its indexer with it); its disk copy stays
    col, idx = st.layout.by_name["c4"], st.layout.by_name["idx"]
    assert _keys(_poll(st, feed)) == {(True, "DISK", col, hs[0]), (False, "CPU", col, hs[0]),
                                      (False, "CPU", idx, hs[0])}
    st.begin_load(h.object_id, S0)
    assert _poll(st, feed) == []  # loading: still (only) on disk
    st.transition(h.object_id, Event.LOAD_VERIFIED)
    assert _keys(_poll(st, feed)) == {(True, "CPU", col, hs[0])}  # back in memory too
    st.transition(h.object_id, Event.DROP_COPY)
    assert _keys(_poll(st, feed)) == {(False, "CPU", col, hs[0])}  # dropped from memory
    st.evict(h.object_id)
    assert _keys(_poll(st, feed)) == {(False, "DISK", col, hs[0])}  # dropped from disk


def test_a_corrupt_disk_copy_is_removed_from_the_disk_tier(spec: CacheSpec) -> None:
    st = _state(spec)
    feed = _started(st)
    hs = prompt_hashes(spec, 2)
    oid = commit_prefix(st, hs)[(0, "c4")]
    h = st.begin_offload(oid, D0)
    st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    _poll(st, feed)
    st.begin_load(h.object_id, S0)
    st.transition(h.object_id, Event.MARK_CORRUPT)  # the load found the checksum wrong
    col = st.layout.by_name["c4"]
    assert _keys(_poll(st, feed)) == {(False, "DISK", col, hs[0])}


def test_a_feed_the_bounded_log_left_behind_starts_over(spec: CacheSpec) -> None:
    st = _state(spec, log=16)
    feed = _started(st)
    ids = commit_prefix(st, prompt_hashes(spec, 8))  # far more than 16 transitions
    batch = st.poll_residency(feed)
    assert batch.cleared and batch.dropped > 0
    assert {c.object_id for c in batch.changes} == set(ids.values())
    assert all(c.stored for c in batch.changes)
    depths = [st.objects[c.object_id].entry.depth for c in batch.changes]
    assert depths == sorted(depths)  # parents before children
    assert _poll(st, feed) == []


def test_recurrent_states_are_stored_over_their_lcm_block() -> None:
    abi = {"dtype": "float32", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "fa"}
    spec = spec_from_dict({"model_id": "hybrid", "hash_block_size": 32, "groups": [
        {"name": "full", "kind": "COMPRESSED", "block_size": 64, "ratio": 1, "abi": abi},
        {"name": "gdn", "kind": "RECURRENT", "block_size": 64, "state_kind": "GDN",
         "layers": 2, "state": [{"shape": [4, 4], "dtype": "float32"}],
         "abi": {"dtype": "float32", "layout": "conv-then-ssm", "head_shape": [2],
                 "kernel_version": "gdn-1"}}]})
    st = _state(spec)
    feed = _started(st)
    hs = prompt_hashes(spec, 4)
    (a,) = st.allocate(hs, [AllocRequest(3, "gdn")])
    assert a.handle.kind is Kind.STATE
    res = st.transition(a.handle.object_id, Event.WRITE_DONE, Params())
    assert res.state is State.STATE_READY
    (c,) = _poll(st, feed)
    assert c.stored and c.column == st.layout.by_name["gdn"]
    assert c.span == (hs[2], hs[3]) and c.parent == hs[1]
    st.evict(a.handle.object_id)
    (r,) = _poll(st, feed)
    assert not r.stored and r.span == c.span


def test_a_loaded_copy_whose_owner_is_lost_leaves_memory_not_disk(spec: CacheSpec) -> None:
    st = _state(spec)
    st.register_owner(S1, pools_for(st.layout, 64))
    feed = _started(st)
    hs = prompt_hashes(spec, 2)
    oid = commit_prefix(st, hs, S0)[(0, "c4")]
    h = st.begin_offload(oid, D0)
    st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(oid)
    st.begin_load(h.object_id, S1)
    st.transition(h.object_id, Event.LOAD_VERIFIED)  # loaded onto s1's pool
    _poll(st, feed)
    st.mark_owner_lost(S1)
    st.reap_all()
    col = st.layout.by_name["c4"]
    assert _keys(_poll(st, feed)) == {(False, "CPU", col, hs[0])}  # the disk copy stays
    assert st.objects[h.object_id].state is State.ON_DISK


def test_starting_over_walks_the_table_in_slices_and_ends_current(spec: CacheSpec) -> None:
    st = _state(spec, log=16)
    hs = prompt_hashes(spec, 8)
    ids = commit_prefix(st, hs)
    feed = ResidencyFeed()
    first = st.poll_residency(feed, limit=8)  # 8 slots a hold
    assert first.cleared and 0 < len(first.changes) <= 8
    swa = ids[(5, "swa")]
    st.evict(swa)  # changed during the walk: in the log after the walk's start
    told: dict[int, bool] = {c.object_id: c.stored for c in first.changes}
    polls = 1
    while True:
        batch = st.poll_residency(feed, limit=8)
        assert not batch.cleared
        if not batch.changes:
            break
        polls += 1
        told.update({c.object_id: c.stored for c in batch.changes})
    assert polls > 2
    live = {oid for oid in ids.values() if oid != swa}
    assert {oid for oid, stored in told.items() if stored} == live  # each ends current
    assert told.get(swa) in (None, False)
