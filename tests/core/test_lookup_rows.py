"""The lookup fast path packs COMPRESSED/INDEXER handles from per-entry cached rows. A row
must never outlive the records it was built from: every handle a lookup returns names the
live record's object, block, generation and shard."""

from __future__ import annotations

from hkv_service.core.api import AllocRequest, LookupRequest, Match, Params
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

N = 16


def _assert_live(state: CacheState, m: Match) -> int:
    n = 0
    for name, column in m.handles.items():
        for h in column:
            rec = state.objects.get(h.object_id)
            assert rec is not None, f"{name}: handle names a dead object {h.object_id}"
            assert (h.block, h.generation, h.shard) == (rec.block, rec.generation, rec.shard)
            pool = state.owners[rec.shard].pools[rec.column]
            assert h.address == rec.block * pool.config.stride
            n += 1
    return n


def test_rows_follow_eviction_and_reallocation(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    first = state.lookup(LookupRequest(hs))
    assert first.usable_tokens == N * 64 and _assert_live(state, first) > 2 * N
    old = state.objects[ids[(5, "c4")]]
    old_id, old_block, old_gen = old.object_id, old.block, old.generation
    state.evict(old_id)  # the row of depth 5 was built by the lookup above
    (again,) = state.allocate(hs, [AllocRequest(5, "c4")])
    state.transition(again.handle.object_id, Event.WRITE_DONE)
    idx = state.objects.get(ids[(5, "idx")])
    if idx is None:  # the indexer went with its KV: write and sync a new one
        (ia,) = state.allocate(hs, [AllocRequest(5, "idx")])
        state.transition(ia.handle.object_id, Event.WRITE_DONE)
        v = state.objects[again.handle.object_id].version
        state.transition(ia.handle.object_id, Event.INDEXER_SYNC, Params(version=v))
    second = state.lookup(LookupRequest(hs))
    assert second.usable_tokens == N * 64
    _assert_live(state, second)
    c4 = {h.object_id: h for h in second.handles["c4"]}
    assert old_id not in c4 and again.handle.object_id in c4
    h = c4[again.handle.object_id]
    assert (h.block, h.generation) != (old_block, old_gen)  # a reused block moved on


def test_rows_identical_to_the_general_path(spec) -> None:
    """Same state, two views of it: the packed rows (the lookup fast path, with or without a
    lease) and the per-record snapshot (the general path a disk copy forces) give the very
    same handles."""
    state = CacheState(spec)
    state.register_owner(ShardId("a"), pools_for(state.layout, 2 * N + 8))
    state.register_owner(ShardId("b"), pools_for(state.layout, 2 * N + 8))
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs[: N // 2], ShardId("a"))
    commit_prefix(state, hs, ShardId("b"))  # the second half lives on another shard
    fast = state.lookup(LookupRequest(hs))
    leased = state.lookup(LookupRequest(hs, lease_ttl_s=5))
    assert fast.handles == leased.handles and _assert_live(state, fast)
    assert {h.shard for hs_ in fast.handles.values() for h in hs_} == {"a", "b"}
    entries = [state.index[h] for h in hs]
    rows = state._packer.packed_columns(entries, N * 64)
    recs = state._packer.resolve(entries, N * 64, 1)
    assert rows == {name: state._packer.snapshot(r) for name, r in recs.items()}
