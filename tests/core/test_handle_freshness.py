"""A lookup's packed handles are never stale. The fast path packs COMPRESSED/INDEXER handles
from caches: a row per entry (``PrefixEntry.row``) and a packed run per full run of blocks
(``PrefixEntry.run``, packed from the rows the second time a lookup takes the run). A cache
that outlived a change would serve the wrong bytes: another object's block, a freed block's
old generation, a copy on a tier that no longer holds it. So after every kind of change to
what a handle says (block and generation, state, tier, shard, a lease, an owner's loss) the
next lookups' handles must be exactly what the general path packs from the live records
(``Packer.resolve`` + ``Packer.snapshot``, no cache), whether they come from rows (the first
lookup after the change) or from a run packed again (the second). The same holds with the
lookup memo and certified walk segments on (their own caches of the same bytes)."""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, Match, Params, StateConfig
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0, S1 = ShardId("s0"), ShardId("s1")
D = 64 + 10  # inside the second full run


# packed runs (the memo and walk segments off: every lookup packs, block by block), certified
# walk segments (their packed pieces), and the service's defaults (the memo answers repeats)
CONFIGS = {"runs": StateConfig(memo_capacity=0, segment_blocks=0),
           "segments": StateConfig(memo_capacity=0), "memo": StateConfig()}


@pytest.fixture(params=list(CONFIGS))
def st(request: pytest.FixtureRequest, spec, clock) -> CacheState:
    state = CacheState(spec, CONFIGS[request.param], clock=clock)
    for owner in (S0, S1):
        state.register_owner(owner, pools_for(state.layout, 1024))
    return state


def _n(st: CacheState) -> int:
    return 3 * st._packer.run_blocks + 6  # three full runs and a partial one (LCM-whole)


def _check(st: CacheState, hs: list[BlockHash], lookups: int = 3, **req: object) -> Match:
    """``lookups`` lookups in a row, each packing exactly what the general path packs from
    the live records now; the last one's match."""
    for _ in range(lookups):
        m = st.lookup(LookupRequest(hs, **req))  # type: ignore[arg-type]
        usable = m.usable_tokens
        entries = [st.index[h] for h in hs[: usable // st.layout.hash_block]]
        recs = st._packer.resolve(entries, usable, 1)
        assert dict(m.columns) == {name: st._packer.snapshot(r) for name, r in recs.items()}
        for column in m.columns.values():
            for h in column.handles():
                rec = st.objects[h.object_id]  # a live object, as it is now
                assert (h.block, h.generation) == (rec.block, rec.generation)
    return m


def _packed_runs(st: CacheState, hs: list[BlockHash]) -> int:
    size = st._packer.run_blocks
    return sum(st.index[hs[r + size - 1]].run is not None
               and st.index[hs[r + size - 1]].run.cols is not None  # type: ignore[union-attr]
               for r in range(0, len(hs) - size + 1, size))


@pytest.fixture
def filled(st: CacheState, spec) -> tuple[list[BlockHash], dict[tuple[int, str], ObjectId]]:
    hs = prompt_hashes(spec, _n(st))
    ids = commit_prefix(st, hs, S0)
    m = _check(st, hs, lookups=2)  # rows, then the runs packed from them
    assert m.usable_tokens == len(hs) * 64
    if st.config.segment_blocks == 0:
        assert _packed_runs(st, hs) == 3
    return hs, ids


def _rewrite(st: CacheState, hs: list[BlockHash], depth: int, column: str) -> ObjectId:
    (a,) = st.allocate(hs, [AllocRequest(depth, column)], S1)
    res = st.transition(a.handle.object_id, Event.WRITE_DONE)
    if column == "c4":  # its indexer went with it: a new one, synced to the new version
        (ia,) = st.allocate(hs, [AllocRequest(depth, "idx")], S1)
        st.transition(ia.handle.object_id, Event.WRITE_DONE)
        st.transition(ia.handle.object_id, Event.INDEXER_SYNC, Params(version=res.version))
    return a.handle.object_id


@pytest.mark.parametrize("column", ["c4", "c128", "idx"])
def test_block_and_generation(st: CacheState, filled, column: str) -> None:
    """Evicted, then written again on another block of another owner."""
    hs, ids = filled
    depth = D if column != "c128" else D + 1  # (a c128 block ends at odd depths)
    old = st.objects[ids[(depth, column)]]
    st.evict(old.object_id)
    assert _check(st, hs).usable_tokens < len(hs) * 64
    kv = st.objects.get(ids[(depth, "c4")])
    if column == "idx" and kv is not None:
        (ia,) = st.allocate(hs, [AllocRequest(depth, "idx")], S1)
        st.transition(ia.handle.object_id, Event.WRITE_DONE)
        st.transition(ia.handle.object_id, Event.INDEXER_SYNC, Params(version=kv.version))
        new = ia.handle.object_id
    elif column == "idx":  # (its KV went with it: both written again)
        _rewrite(st, hs, depth, "c4")
        new = st.objects.get(ids[(depth, "c4")]) or next(
            h.object_id for h in _check(st, hs, 1).handles["idx"] if h.shard == S1)
    else:
        new = _rewrite(st, hs, depth, column)
    m = _check(st, hs)
    assert m.usable_tokens == len(hs) * 64
    assert new in {h.object_id for h in m.handles[column]}
    if st.config.segment_blocks == 0:
        assert _packed_runs(st, hs) == 3  # packed again, from the new rows


def test_a_block_reused_by_the_same_owner_moves_its_generation(st: CacheState, filled
                                                                ) -> None:
    hs, ids = filled
    old = st.objects[ids[(D, "c4")]]
    block, generation = old.block, old.generation
    st.evict(old.object_id)
    (a,) = st.allocate(hs, [AllocRequest(D, "c4")], S0)  # the block just freed? (LIFO or not)
    res = st.transition(a.handle.object_id, Event.WRITE_DONE)
    (ia,) = st.allocate(hs, [AllocRequest(D, "idx")], S0)
    st.transition(ia.handle.object_id, Event.WRITE_DONE)
    st.transition(ia.handle.object_id, Event.INDEXER_SYNC, Params(version=res.version))
    m = _check(st, hs)
    (h,) = [h for h in m.handles["c4"] if h.object_id == a.handle.object_id]
    assert (h.block, h.generation) != (block, generation)


def test_state_a_corrupt_object_is_served_no_more(st: CacheState, filled) -> None:
    hs, ids = filled
    st.transition(ids[(D + 1, "c128")], Event.MARK_CORRUPT)
    m = _check(st, hs)
    assert m.usable_tokens <= (D + 1) * 64
    assert ids[(D + 1, "c128")] not in {h.object_id for h in m.handles["c128"]}


def test_tier_and_shard_disk_copy_at_rest_loaded_dropped_lost(st: CacheState, filled
                                                               ) -> None:
    """The memory copy goes, the disk copy at rest serves (no block); loaded onto s1 it
    serves from there; its loaded copy dropped, or its owner lost, it is at rest again."""
    hs, ids = filled
    oid = ids[(D, "c4")]
    disk = st.begin_offload(oid, S0)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    idx_disk = st.begin_offload(ids[(D, "idx")], S0)  # (its indexer, synced, copied too)
    st.transition(idx_disk.object_id, Event.OFFLOAD_COMMITTED)
    _check(st, hs)
    st.evict(oid)
    if st.objects.get(ids[(D, "idx")]) is not None:
        st.evict(ids[(D, "idx")])
    m = _check(st, hs)
    assert m.usable_tokens == len(hs) * 64
    (h,) = [h for h in m.handles["c4"] if h.object_id == disk.object_id]
    assert h.block < 0 and h.shard == S0  # at rest: ask the tier
    got = st.begin_load(disk.object_id, S1)
    st.transition(disk.object_id, Event.LOAD_VERIFIED, generation=got.generation)
    m = _check(st, hs)
    (h,) = [h for h in m.handles["c4"] if h.object_id == disk.object_id]
    assert (h.shard, h.block) == (S1, got.block)
    st.transition(disk.object_id, Event.DROP_COPY)
    m = _check(st, hs)
    (h,) = [h for h in m.handles["c4"] if h.object_id == disk.object_id]
    assert h.block < 0
    got = st.begin_load(disk.object_id, S1)
    st.transition(disk.object_id, Event.LOAD_VERIFIED, generation=got.generation)
    _check(st, hs)
    st.mark_owner_lost(S1)
    m = _check(st, hs)
    assert all(h.shard != S1 for column in m.handles.values() for h in column)


def test_lease_leased_handles_are_the_live_ones_and_stay_so(st: CacheState, filled) -> None:
    hs, ids = filled
    m = _check(st, hs, 1, lease_ttl_s=5)
    assert m.lease_id is not None
    _check(st, hs)  # the leased and the lease-free lookups pack the same
    st.release_lease(m.lease_id)
    st.evict(ids[(D, "c4")])
    new = _rewrite(st, hs, D, "c4")
    m = _check(st, hs, 1, lease_ttl_s=5)
    assert new in {h.object_id for h in m.handles["c4"]}
    _check(st, hs)


def test_owner_lost_none_of_its_handles_served(st: CacheState, filled) -> None:
    hs, ids = filled
    st.evict(ids[(D, "c4")])
    new = _rewrite(st, hs, D, "c4")  # on s1, inside a packed run of s0's
    assert new in {h.object_id for h in _check(st, hs).handles["c4"]}
    st.mark_owner_lost(S1)
    m = _check(st, hs)
    assert m.usable_tokens <= D * 64
    assert all(h.shard != S1 for column in m.handles.values() for h in column)
