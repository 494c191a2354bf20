"""Every case where the hash hits but the state is incomplete: the funnel must downgrade."""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, Params, PoolConfig, StateConfig
from hkv_service.core.errors import (
    IllegalTransition,
    MisplacedHash,
    PositionBeyondHashes,
    StaleHandle,
    UnknownGroup,
)
from hkv_service.core.ids import ShardId
from hkv_service.core.spec import spec_from_dict
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Reason, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

N = 8  # hash blocks of 64 tokens -> 512 tokens, resume points every 128


def reasons(match) -> set[Reason]:
    return {d.reason for d in match.downgrades}


def test_full_hit(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512 and m.downgrades == ()
    assert len(m.handles["c4"]) == 8 and len(m.handles["c128"]) == 4
    assert len(m.handles["swa"]) == 2  # only the blocks meeting [512-128, 512)
    assert len(m.handles["c4.tail"]) == 1 and not m.needs_load


def test_unknown_prefix_is_a_plain_miss(state: CacheState, spec) -> None:
    m = state.lookup(LookupRequest(prompt_hashes(spec, N, seed=9)))
    assert m.usable_tokens == 0 and m.downgrades == ()


def test_compressed_present_but_tail_partial(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs, skip=frozenset({(7, "c4.tail")}))
    (alloc,) = state.allocate(hs, [AllocRequest(7, "c4.tail")])
    state.transition(alloc.handle.object_id, Event.TAIL_APPEND, Params(tail_len=2))
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 384  # the previous resume point, whose tail is complete
    assert Reason.TAIL_INCOMPLETE in reasons(m)


def test_swa_window_not_covering_resume_position(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    state.evict(ids[(6, "swa")])  # tokens [384, 448): inside the window of p=512 and p=448..
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 384 and Reason.SWA_WINDOW_INCOMPLETE in reasons(m)


def test_swa_readiness_is_not_monotone(state: CacheState, spec) -> None:
    """Window broken at a shorter position but whole at a longer one: take the longer."""
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    state.evict(ids[(2, "swa")])  # tokens [128, 192): needed by p=256, not by p=512
    assert state.lookup(LookupRequest(hs)).usable_tokens == 512
    m = state.lookup(LookupRequest(hs, resume_tokens=256))
    assert m.usable_tokens == 128 and Reason.SWA_WINDOW_INCOMPLETE in reasons(m)


def test_indexer_at_old_version(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs, skip=frozenset({(3, "idx")}))
    (alloc,) = state.allocate(hs, [AllocRequest(3, "idx")])
    state.transition(alloc.handle.object_id, Event.WRITE_DONE)  # written, never synced
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 128 and Reason.INDEXER_STALE in reasons(m)


def test_indexer_goes_with_its_kv_on_every_rewrite(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    state.evict(ids[(5, "c4")])  # takes its indexer with it (an indexer goes with its KV)
    assert state.objects.get(ids[(5, "idx")]) is None
    kv, idx = state.allocate(hs, [AllocRequest(5, "c4"), AllocRequest(5, "idx")])
    v = state.transition(kv.handle.object_id, Event.WRITE_DONE).version
    state.transition(idx.handle.object_id, Event.WRITE_DONE)
    state.transition(idx.handle.object_id, Event.INDEXER_SYNC, Params(version=v))
    assert state.lookup(LookupRequest(hs)).usable_tokens == 512
    # the KV is rewritten (new version) but the indexer is not re-synced: stale
    state.evict(kv.handle.object_id)
    (kv2,) = state.allocate(hs, [AllocRequest(5, "c4")])
    state.transition(kv2.handle.object_id, Event.WRITE_DONE)
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 256  # the indexer went with its KV again: missing, not stale
    assert reasons(m) == {Reason.MISSING_COMPONENT}


def test_prefix_in_flight_from_disk(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    disk = state.begin_offload(ids[(4, "c4")], ShardId("s0"))
    state.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    state.evict(ids[(4, "c4")])  # free the memory copy; idx goes with it
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 256  # idx at depth 4 went with its KV
    assert Reason.MISSING_COMPONENT in reasons(m)
    # re-create the indexer from the disk KV's version, then the prefix needs a load
    (idx,) = state.allocate(hs, [AllocRequest(4, "idx")])
    state.transition(idx.handle.object_id, Event.WRITE_DONE)
    with pytest.raises(Exception, match="not COMPRESSED_READY"):
        state.transition(idx.handle.object_id, Event.INDEXER_SYNC, Params(version=disk.object_id))
    target = state.begin_load(disk.object_id)
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 256 and Reason.DISK_INFLIGHT in reasons(m)
    state.transition(disk.object_id, Event.LOAD_VERIFIED)
    version = state.objects[disk.object_id].version
    state.transition(idx.handle.object_id, Event.INDEXER_SYNC, Params(version=version))
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512 and target.block >= 0


def test_at_rest_on_disk_needs_load(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    disk = state.begin_offload(ids[(7, "swa")], ShardId("s0"))
    state.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    state.evict(ids[(7, "swa")])
    m = state.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512 and m.needs_load
    assert [h.object_id for h in m.load] == [disk.object_id]


def test_partial_block_is_never_complete(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs, resume_tokens=500))
    assert m.usable_tokens == 384 and Reason.PARTIAL_BLOCK in reasons(m)
    m = state.lookup(LookupRequest(hs[:7]))  # 448 tokens: 448 is not a multiple of 128
    assert m.usable_tokens == 384


def test_abi_mismatch_makes_the_hit_unusable(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs)
    good = {g.name: g.abi.fingerprint() for g in spec.groups}
    assert state.lookup(LookupRequest(hs, reader_abi=good)).usable_tokens == 512
    m = state.lookup(LookupRequest(hs, reader_abi={**good, "c4": good["c4"] ^ 1}))
    assert m.usable_tokens == 0 and reasons(m) == {Reason.ABI_MISMATCH}
    with pytest.raises(UnknownGroup):
        state.lookup(LookupRequest(hs, reader_abi={"nope": 1}))


def test_misaligned_handle(spec, clock) -> None:
    st = CacheState(spec, clock=clock)
    odd = {
        n: PoolConfig(p.num_blocks, p.stride + 8, p.base_align)
        for n, p in pools_for(st.layout, 64).items()
    }
    st.register_owner(ShardId("odd"), odd)
    hs = prompt_hashes(spec, N)
    commit_prefix(st, hs)
    assert st.lookup(LookupRequest(hs, alignment=8)).usable_tokens == 512
    m = st.lookup(LookupRequest(hs, alignment=256))
    assert m.usable_tokens == 0 and Reason.MISALIGNED in reasons(m)


def test_block_evicted_between_lookup_and_read(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs))
    handle = m.handles["c4"][3]
    state.evict(ids[(3, "c4")])
    state.allocate(prompt_hashes(spec, 1, seed=5), [AllocRequest(0, "c4")])  # reuse blocks
    with pytest.raises(StaleHandle, match="recompute"):
        state.check_read(handle)


def test_lease_pins_against_eviction(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs, lease_ttl_s=5))
    assert m.lease_id is not None
    with pytest.raises(Exception, match="leased"):
        state.evict(ids[(3, "c4")])
    state.check_read(m.handles["c4"][3], m.lease_id)
    state.release_lease(m.lease_id)
    state.evict(ids[(3, "c4")])
    assert state.objects.get(ids[(3, "c4")]) is None


def test_position_beyond_hashes_is_invalid(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 2)
    with pytest.raises(PositionBeyondHashes):
        state.lookup(LookupRequest(hs, resume_tokens=129))


def test_owner_lost_means_miss_never_hit(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    commit_prefix(state, hs)
    state.mark_owner_lost(ShardId("s0"))
    assert state.lookup(LookupRequest(hs)).usable_tokens == 0
    # the lookup buried what its walk read (the first block); the reaper buries the rest
    state.reap_all()
    assert all(r.state is not State.COMPRESSED_READY for r in state.objects.values())


def test_stale_indexer_can_be_refreshed(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs, lease_ttl_s=5))  # a reader pins the indexer...
    state.release_lease(m.lease_id)  # ...then lets go; the KV moves on, the indexer stays
    idx = state.objects[ids[(5, "idx")]]
    state.holds.pins[idx] = 1  # a reader holds the indexer alone
    state.evict(ids[(5, "c4")])
    del state.holds.pins[idx]
    (kv,) = state.allocate(hs, [AllocRequest(5, "c4")])
    v = state.transition(kv.handle.object_id, Event.WRITE_DONE).version
    (again,) = state.allocate(hs, [AllocRequest(5, "idx")])
    assert again.existing and again.version != v  # the writer can see it is stale
    assert state.lookup(LookupRequest(hs)).usable_tokens == 256
    with pytest.raises(IllegalTransition):  # its keys are never rewritten in place...
        state.transition(again.handle.object_id, Event.WRITE_DONE)
    (fresh,) = state.allocate(hs, [AllocRequest(5, "idx", replace=again.handle.object_id)])
    assert not fresh.existing and fresh.handle.object_id != again.handle.object_id
    assert again.handle.object_id not in state.objects  # ...it is retired for a fresh one
    state.transition(fresh.handle.object_id, Event.WRITE_DONE)
    state.transition(fresh.handle.object_id, Event.INDEXER_SYNC, Params(version=v))
    assert state.lookup(LookupRequest(hs)).usable_tokens == 512


def test_a_replace_leaves_a_held_object_and_names_only_the_one_seen(
        state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    idx = ids[(5, "idx")]
    m = state.lookup(LookupRequest(hs, lease_ttl_s=5))
    (held,) = state.allocate(hs, [AllocRequest(5, "idx", replace=idx)])
    assert held.existing and held.handle.object_id == idx  # leased: not retired
    state.release_lease(m.lease_id)
    (other,) = state.allocate(hs, [AllocRequest(5, "idx", replace=idx + 1)])
    assert other.existing and other.handle.object_id == idx  # another id: not this one
    (fresh,) = state.allocate(hs, [AllocRequest(5, "idx", replace=idx)])
    assert not fresh.existing


def test_read_refused_while_load_in_flight(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(state, hs)
    disk = state.begin_offload(ids[(7, "swa")], ShardId("s0"))
    state.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    state.evict(ids[(7, "swa")])
    target = state.begin_load(disk.object_id)  # block reserved, bytes not verified yet
    with pytest.raises(StaleHandle):
        state.check_read(target)
    state.transition(disk.object_id, Event.LOAD_VERIFIED)
    state.check_read(state.lookup(LookupRequest(hs)).handles["swa"][-1])


@pytest.mark.parametrize(
    ("where", "resume"),
    [("first", None), ("after the matched prefix", None), ("beyond the resume point", 128),
     ("in the middle", None)],
)
def test_a_malformed_hash_is_refused_wherever_it_is(
    state: CacheState, spec, where: str, resume: int | None
) -> None:
    """The view checks hash lengths only past what the walk found (every index key is 16
    bytes): a bad hash anywhere is still BadHash, and the refused lookup changes nothing."""
    from hkv_service.core.errors import BadHash

    hs = prompt_hashes(spec, 8)
    commit_prefix(state, hs)
    bad = {"first": 0, "after the matched prefix": 8, "beyond the resume point": 6,
           "in the middle": 3}[where]
    hashes = [*hs, prompt_hashes(spec, 9)[8]]
    hashes[bad] = hashes[bad][:15] if bad % 2 else hashes[bad] + b"x"
    before = dict(state.counters.lookups)
    with pytest.raises(BadHash, match="16 bytes"):
        state.lookup(LookupRequest(hashes, resume_tokens=resume))
    assert dict(state.counters.lookups) == before


@pytest.mark.parametrize("bad", [b"", "sixteen chars!!!", 7], ids=["empty", "str16", "int"])
def test_what_is_not_a_hash_at_all_is_refused_in_the_walk(
    state: CacheState, spec, bad: object
) -> None:
    """The walk reads a hash's first byte to find its part of the index: an empty hash, or
    no bytes at all, stops it there (no IndexError, no TypeError) and is refused as BadHash
    with nothing changed. (An int raised TypeError from the length check, and a 16-character
    str passed it: the lookup answered a miss there instead of refusing it.)"""
    from hkv_service.core.errors import BadHash

    hs = prompt_hashes(spec, 8)
    commit_prefix(state, hs)
    before = dict(state.counters.lookups)
    with pytest.raises(BadHash, match="16 bytes"):
        state.lookup(LookupRequest([*hs[:3], bad, *hs[4:]]))  # type: ignore[list-item]
    assert dict(state.counters.lookups) == before


FULL_ATTENTION = spec_from_dict({"model_id": "full-attention", "hash_block_size": 64, "groups": [
    {"name": "kv", "kind": "COMPRESSED", "block_size": 64, "ratio": 1,
     "abi": {"dtype": "float16", "layout": "NHD", "head_shape": [2, 16], "kernel_version": "fa"}}]})


@pytest.mark.parametrize("segment_blocks", [0, 4])
@pytest.mark.parametrize("how", ["shifted", "shifted by a run", "one out of place", "range"])
def test_a_hash_of_another_depth_is_refused_not_served(segment_blocks: int, how: str) -> None:
    """The hash matched, but it is another block's: a client that sends its hashes from
    some offset (it skipped blocks it already holds) without saying so would be served the
    KV of block d + k as block d. Full attention only, so no SWA range or tail length
    happens to stop it; by block and over runs certified by earlier walks."""
    range_blocks = 16 if how == "range" else 0
    st = CacheState(FULL_ATTENTION, StateConfig(memo_capacity=0, segment_blocks=segment_blocks,
                                                range_blocks=range_blocks))
    st.register_owner(ShardId("s0"), pools_for(st.layout, 64))
    hs = prompt_hashes(st.spec, 32)
    if range_blocks:
        commit_prefix(st, hs[:16])
        commit_prefix(st, hs[16:], first_block=16)
    else:
        commit_prefix(st, hs)
    for _ in range(3):  # (certified runs: the second walk certifies them)
        assert st.lookup(LookupRequest(hs[:16])).usable_tokens == 16 * 64
    asked, at, known = {
        "shifted": (hs[1:17], 0, 1),
        "shifted by a run": (hs[4:20], 0, 4),
        "one out of place": ([*hs[:5], hs[9], *hs[6:16]], 5, 9),
        "range": (hs[16:32], 0, 16),  # the second range's hashes, first_block not said
    }[how]
    with pytest.raises(MisplacedHash, match=f"block {at}.* block {known}") as err:
        st.lookup(LookupRequest(asked))
    assert (err.value.depth, err.value.known_depth) == (at, known)
    assert st.lookup(LookupRequest(hs[:16])).usable_tokens == 16 * 64  # nothing changed
