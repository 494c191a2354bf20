"""Five-type routing: each kind's own eviction path, and generations on every free."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies

from hkv_service.core.api import AllocRequest, LookupRequest, Params, PoolConfig
from hkv_service.core.errors import PoolExhausted
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes


def small_state(spec, clock, blocks: int) -> CacheState:
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), pools_for(st.layout, blocks))
    return st


def test_generation_moves_on_every_free(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 1)
    (a,) = state.allocate(hs, [AllocRequest(0, "c4")])
    pool = state.owners[ShardId("s0")].pools[0]
    gen = pool.generation_of(a.handle.block)
    state.transition(a.handle.object_id, Event.WRITE_DONE)
    state.evict(a.handle.object_id)
    assert pool.generation_of(a.handle.block) == gen + 1


def test_compressed_leaves_go_before_parents(spec, clock) -> None:
    st = small_state(spec, clock, 8)
    hs = prompt_hashes(spec, 8)
    ids = commit_prefix(st, hs)
    other = prompt_hashes(spec, 1, seed=3)
    (a,) = st.allocate(other, [AllocRequest(0, "c4")])  # pool full: evict a leaf
    assert st.objects.get(ids[(7, "c4")]) is None  # the deepest block went
    assert all(st.objects.get(ids[(d, "c4")]) is not None for d in range(7))
    assert st.objects.get(ids[(7, "idx")]) is None  # and its indexer went with it
    assert a.state is State.ALLOCATED


def test_swa_out_of_window_first(spec, clock) -> None:
    """Resume points only at 384 and 512: SWA blocks before 256 are in no live window
    ([p-128, p) for p in {384, 512} covers depths 4..7), so one of them must go first."""
    st = small_state(spec, clock, 8)
    hs = prompt_hashes(spec, 8)
    no_tails = frozenset((d, t) for d in (1, 3) for t in ("c4.tail", "c128.tail"))
    ids = commit_prefix(st, hs, skip=no_tails)
    st.allocate(prompt_hashes(spec, 1, seed=3), [AllocRequest(0, "swa")])
    gone = [d for d in range(8) if st.objects.get(ids[(d, "swa")]) is None]
    assert len(gone) == 1 and gone[0] < 4, gone
    assert st.lookup(LookupRequest(hs)).usable_tokens == 512  # the live window is untouched


def test_tail_being_written_is_never_evicted(spec, clock) -> None:
    st = small_state(spec, clock, 1)
    hs = prompt_hashes(spec, 2)
    (t,) = st.allocate(hs, [AllocRequest(1, "c4.tail")])
    st.transition(t.handle.object_id, Event.TAIL_APPEND, Params(tail_len=1))
    with pytest.raises(PoolExhausted, match=r"c4\.tail"):
        st.allocate(prompt_hashes(spec, 2, seed=4), [AllocRequest(1, "c4.tail")])
    assert st.objects[t.handle.object_id].state is State.TAIL_PARTIAL


def test_leased_blocks_are_not_evicted(spec, clock) -> None:
    st = small_state(spec, clock, 8)
    hs = prompt_hashes(spec, 8)
    commit_prefix(st, hs)
    m = st.lookup(LookupRequest(hs, lease_ttl_s=10))
    with pytest.raises(PoolExhausted):
        st.allocate(prompt_hashes(spec, 1, seed=3), [AllocRequest(0, "c4")])
    clock.advance(11)  # the lease expires: the next lookup reaps it
    st.lookup(LookupRequest(hs[:1]))
    st.allocate(prompt_hashes(spec, 1, seed=3), [AllocRequest(0, "c4")])
    assert m.lease_id is not None and m.lease_id not in st.leases.leases


def test_alignment_from_pool_layout() -> None:
    from hkv_service.core.allocator import BlockPool

    pool = BlockPool(PoolConfig(4, 2048 + 8, 4096), nbytes=2048)
    assert pool.alignment_of(0) == 2048
    assert pool.alignment_of(1) == 8
    assert BlockPool(PoolConfig(4, 0, 4096), nbytes=0).alignment_of(3) == 4096  # all at 0


_POW = strategies.integers(0, 34).map(lambda i: 1 << i)


@settings(max_examples=3000, deadline=None)
@given(block=strategies.one_of(strategies.integers(0, 1 << 40), _POW, _POW.map(lambda p: 3 * p)),
       stride=strategies.one_of(strategies.integers(0, 1 << 24), _POW, _POW.map(lambda p: 5 * p)),
       nbytes=strategies.one_of(strategies.integers(0, 1 << 24), _POW), base_align=_POW)
def test_a_pools_alignment_is_the_rule(block: int, stride: int, nbytes: int,
                                       base_align: int) -> None:
    """The pool's precomputed split (one multiply per block, for the summaries) answers
    what the rule gives for the block's address, for every block, stride and size."""
    from hkv_service.core.allocator import BlockPool, alignment

    pool = BlockPool(PoolConfig(1, stride, base_align), nbytes=nbytes)
    assert pool.alignment_of(block) == alignment(block * stride, nbytes, base_align)


def test_allocate_is_all_or_nothing(spec, clock) -> None:
    st = small_state(spec, clock, 2)
    hs = prompt_hashes(spec, 4)
    with pytest.raises(PoolExhausted):
        st.allocate(hs, [AllocRequest(d, "c4") for d in range(4)])  # 4 blocks, pool of 2
    assert len(st.objects) == 0
    assert st.owners[ShardId("s0")].pools[0].free_count() == 2  # nothing leaked


def _pools(st: CacheState, **sizes: int) -> dict[str, PoolConfig]:
    pools = pools_for(st.layout, 32)
    for name, n in sizes.items():
        pools[name] = PoolConfig(n, pools[name].stride, pools[name].base_align)
    return pools


def test_a_block_goes_before_the_blocks_of_its_column_it_leads_to(spec, clock) -> None:
    """Regression (issue 15, item 6): an entry was a leaf only without child entries, so
    c128 at depth 3 (whose child holds c4 only) tied with c128 at depth 1, and the one at
    depth 1 went: every prompt through it lost all of its c128 reuse."""
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), _pools(st, c128=2))
    hs = prompt_hashes(spec, 5)  # c128 at depths 1 and 3
    ids = commit_prefix(st, hs)
    assert st.lookup(LookupRequest(hs)).usable_tokens == 256
    st.allocate(prompt_hashes(spec, 2, seed=3), [AllocRequest(1, "c128")])  # pool full
    assert st.objects.get(ids[(1, "c128")]) is not None
    assert st.objects.get(ids[(3, "c128")]) is None
    assert st.lookup(LookupRequest(hs)).usable_tokens == 128


def test_a_shared_root_goes_last(spec, clock) -> None:
    """Regression (issue 15, item 6): last use was set on a lookup's last entry only, so the
    interior entries tied at 0 and the shared root went first once the leaves were gone."""
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), _pools(st, c4=6))
    toks = np.random.default_rng(1).integers(0, 50_000, 4 * 64)
    toks_b = np.concatenate([toks[:128], np.random.default_rng(2).integers(0, 50_000, 128)])
    a, b = (hash_blocks(t, 64, ExtraKeys(spec.model_id)) for t in (toks, toks_b))  # share 2
    ids_a, ids_b = commit_prefix(st, a), commit_prefix(st, b)
    st.lookup(LookupRequest(a))
    st.lookup(LookupRequest(b))
    for seed in (5, 6, 7):  # three more blocks: three evictions
        st.allocate(prompt_hashes(spec, 1, seed=seed), [AllocRequest(0, "c4")])
    live = {d for d in range(4) if st.objects.get(ids_a[(d, "c4")]) is not None}
    assert live == {0, 1}, live  # A's own blocks, then B's deepest: the shared two stay
    assert st.objects.get(ids_b[(2, "c4")]) is not None
    assert st.objects.get(ids_b[(3, "c4")]) is None


def test_each_swa_group_is_protected_by_its_own_window(clock) -> None:
    """Regression (issue 15, item 7): resume points protected ceil(max_window / H) entries
    for every SWA column, so with windows 128 and 512 every block of the narrow group looked
    needed, and a block its live window needs could go first."""
    from hkv_service.core.spec import spec_from_dict
    from hkv_service.specs import default_spec

    raw = default_spec().to_dict()
    wide = next(dict(g) for g in raw["groups"] if g["name"] == "swa")
    raw["groups"].append({**wide, "name": "swa_wide", "window": 512})
    spec = spec_from_dict(raw)
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), _pools(st, swa=8))
    hs = prompt_hashes(spec, 8)
    (first,) = st.allocate(hs, [AllocRequest(7, "swa")])  # the narrow window's, block 0
    st.transition(first.handle.object_id, Event.WRITE_DONE)
    no_tails = frozenset((d, "c4.tail") for d in (1, 3, 5))  # one resume point: 512
    ids = commit_prefix(st, hs, skip=no_tails)
    st.allocate(prompt_hashes(spec, 1, seed=3), [AllocRequest(0, "swa")])  # pool full
    gone = [d for d in range(8) if st.objects.get(ids[(d, "swa")]) is None]
    assert len(gone) == 1 and gone[0] < 6, gone  # [384, 512) is what the window needs
    assert st.lookup(LookupRequest(hs)).usable_tokens == 512


def test_a_fresh_write_is_as_recent_as_a_lookup(spec, clock) -> None:
    """A prefix written after another was last looked up is the more recent one: the write
    ages the path it made, so the older prefix's deepest block goes first."""
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), _pools(st, c4=8))
    a, b = prompt_hashes(spec, 4, seed=1), prompt_hashes(spec, 4, seed=2)
    ids_a = commit_prefix(st, a)
    for _ in range(3):
        st.lookup(LookupRequest(a))
    ids_b = commit_prefix(st, b)
    st.allocate(prompt_hashes(spec, 1, seed=3), [AllocRequest(0, "c4")])  # pool full
    assert st.objects.get(ids_a[(3, "c4")]) is None
    assert all(st.objects.get(ids_b[(d, "c4")]) is not None for d in range(4))


def test_a_claim_far_ahead_costs_one_block_of_metadata() -> None:
    """A re-confirm naming the last block of a 16M-block pool materialised every block before
    it (hundreds of MiB from one report); now only the claimed block has an entry, and the
    blocks before it are handed out around it."""
    from hkv_service.core.allocator import BlockPool

    pool = BlockPool(PoolConfig(1 << 24, 256), nbytes=256)
    last = (1 << 24) - 1
    assert pool.claim(last) and not pool.claim(last)
    assert pool.tracked() == 1 and pool.free_count() == (1 << 24) - 1
    assert not pool._books and list(pool.books()) == [(last, 0, None)]  # no list for it
    assert [pool.take() for _ in range(3)] == [0, 1, 2]
    assert pool.claim(5) and pool.take() == 3 and pool.take() == 4 and pool.take() == 6
    pool.release(last)
    assert pool.take() == last  # released blocks go out first


def test_a_claim_keeps_the_greater_generation() -> None:
    """``claim_at``: a re-confirmed block's generation is the greater of the pool's and the
    owner's (a generation issued stays issued: a handle read before the restart must not
    match the block's next object); None for a block in use or outside the pool, and then
    nothing changes."""
    from hkv_service.core.allocator import BlockPool

    pool = BlockPool(PoolConfig(64, 256, first=8), nbytes=256)
    assert pool.claim_at(9, 7) == 7 and pool.generation_of(9) == 7  # never handed out
    assert pool.claim_at(9, 1) is None  # in use
    assert pool.claim_at(7, 1) is None and pool.claim_at(64, 1) is None  # outside
    for _ in range(4):
        pool.release(9)
        pool.claim_at(9, 0)
    pool.release(9)
    assert pool.generation_of(9) == 12
    assert pool.claim_at(9, 3) == 12 and pool.generation_of(9) == 12  # the pool's is greater
    pool.release(9)
    assert pool.claim_at(9, 40) == 40 and pool.generation_of(9) == 40  # the owner's is
    assert not pool.handed_out(7) and not pool.handed_out(64)
    assert pool.span == 10 and pool.take() == 8 and pool.take() == 10  # 9 stepped over


def _full_and_swa(overlap: int = 0) -> CacheSpec:
    """Full attention + two sliding windows, H = 8 (every vLLM connector geometry has no
    tail: its COMPRESSED group has no overlap)."""
    from hkv_service.core.spec import spec_from_dict

    abi = {"dtype": "float16", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "k"}
    full = {"name": "full", "kind": "COMPRESSED", "block_size": 64, "ratio": 1, "abi": abi}
    if overlap:
        full["overlap"] = overlap
    return spec_from_dict({"model_id": "full-swa", "hash_block_size": 8, "groups": [
        full,
        {"name": "wide", "kind": "SWA", "block_size": 64, "window": 512, "abi": abi},
        {"name": "narrow", "kind": "SWA", "block_size": 8, "window": 8, "abi": abi}]})


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_resume_point_protects_its_swa_blocks_without_a_tail(clock, overlap: int) -> None:
    """Regression (issue 35, item 2): resume points were learnt from complete tails only, so
    in a spec without tails SWA eviction was plain LRU and a checkpoint died under churn: b's
    first narrow allocation evicted a's narrow@7 while 14 narrow blocks no resume point needs
    remained. A resume point is known from whatever completes it."""
    spec = _full_and_swa(overlap)
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), pools_for(st.layout, 16))
    a = prompt_hashes(spec, 16, seed=1)
    skip = frozenset((d, "narrow") for d in (7, 15))
    first = commit_prefix(st, a, skip=frozenset((d, n) for d in range(16)
                                                for n in ("full", "wide", "narrow", "full.tail")
                                                if (d, n) not in skip))
    ids = {**commit_prefix(st, a), **first}  # narrow@7 and @15 first, then the rest of a
    assert st.lookup(LookupRequest(a)).usable_tokens == 128
    b = prompt_hashes(spec, 16, seed=2)
    commit_prefix(st, b, skip=frozenset((d, "narrow") for d in range(16)))  # full + wide
    for d in range(12):  # b's narrow blocks, one at a time: a's unneeded ones go first
        (n,) = st.allocate(b, [AllocRequest(d, "narrow")])
        st.transition(n.handle.object_id, Event.WRITE_DONE)
        for keep in (7, 15):
            assert st.objects.get(ids[(keep, "narrow")]) is not None, (d, keep)
    assert st.lookup(LookupRequest(a)).usable_tokens == 128


def test_an_incomplete_resume_point_protects_nothing(clock) -> None:
    """A resume point counts while every object it needs is ready: with the full block at
    64 evicted, narrow@7 is no checkpoint any more and goes in its LRU turn."""
    spec = _full_and_swa()
    st = CacheState(spec, clock=clock)
    st.register_owner(ShardId("s0"), pools_for(st.layout, 16))
    a = prompt_hashes(spec, 16, seed=1)
    ids = commit_prefix(st, a)
    narrow = st.layout.swa_columns.index(st.layout.by_name["narrow"])

    def need(depth: int) -> int:  # the narrow lane of swa_need at ``depth``
        return st.objects[ids[(depth, "narrow")]].entry.swa_need >> (32 * narrow) & 0xFFFFFFFF

    assert need(7) == need(15) == 1 and need(6) == 0
    st.evict(ids[(7, "full")])
    assert need(7) == 0
    st.evict(ids[(15, "wide")])  # a count goes back exactly to zero: no lane underflows
    assert need(15) == 0 and st.objects[ids[(15, "narrow")]].entry.swa_need == 0
    st.allocate(prompt_hashes(spec, 16, seed=2), [AllocRequest(0, "narrow")])
    assert st.objects.get(ids[(0, "narrow")]) is None  # the least recently used went


def test_books_of_blocks_claimed_far_ahead_move_into_the_list() -> None:
    """A re-confirm claims blocks in any order: one far past the arrays' end keeps its books
    aside, and when blocks going out in order reach it they move into the list with its
    generation; every block handed out has books exactly once, and take() never hands out a
    block with books."""
    import random

    from hkv_service.core.allocator import BlockPool

    pool = BlockPool(PoolConfig(1 << 16, 256, first=16), nbytes=256)
    far = [5000, 3000, 9000]
    for g, b in enumerate(far, start=1):
        assert pool.claim_at(b, g) == g
    assert sorted(b for b, _, _ in pool.books()) == sorted(far) and not pool._books
    taken = [pool.take() for _ in range(5000)]
    assert 3000 not in taken and 5000 not in taken  # stepped over
    assert pool.generation_of(3000) == 2 and pool.generation_of(5000) == 1
    assert not pool._far.keys() & {3000, 5000}  # in the list now
    assert pool.generation_of(9000) == 3 and 9000 in pool._far
    rng = random.Random(7)
    held: set[int] = set(far) | {b for b in taken if b is not None}
    for _ in range(3000):
        b = rng.choice(sorted(held))
        gen = pool.generation_of(b)
        pool.release(b)
        assert pool.generation_of(b) == gen + 1 and pool.owner_of(b) is None
        assert pool.claim_at(b, 0) == gen + 1 and pool.claim_at(b, 0) is None
    books = sorted(b for b, _, _ in pool.books())
    assert books == sorted(held) and pool.tracked() == len(held)


def test_forgetting_a_retired_pool_counts_only_blocks_with_books() -> None:
    """The reaper forgets every block below the span, a gap a claim ahead left among them
    too: only blocks with books are counted off, so the pool ends with none and every
    declared block free."""
    from hkv_service.core.allocator import BlockPool

    pool = BlockPool(PoolConfig(4096, 256), nbytes=256)
    taken = [pool.take() for _ in range(5)]
    assert pool.claim(40) and pool.claim(3000) and pool.tracked() == 7
    pool.release(taken[2])
    for block in range(pool.span):
        pool.forget(block)
    assert pool.tracked() == 0 and not list(pool.books())
    assert pool.free_count() == 4096 and pool.occupied() == 0


def test_generations_above_a_floor_stay_shared_ints() -> None:
    """A registration's floor is a large int (workers/generations.py); every block freed n
    times under it must hold the same int object for ``floor + n`` (as small ints were before
    floors): a fresh int per freed block is 32 bytes more per record at steady churn."""
    from hkv_service.core.allocator import BlockPool

    floor = 123_456_789 << 24
    pool = BlockPool(PoolConfig(num_blocks=64, stride=4096, generation_floor=floor),
                     nbytes=4096)
    blocks = [pool.take() for _ in range(64)]
    assert None not in blocks
    for _ in range(3):
        for b in blocks:
            pool.release(b)
        for b in blocks:
            assert pool.claim(b)
    gens = [pool.generation_of(b) for b in blocks]  # type: ignore[arg-type]
    assert gens == [floor + 3] * 64
    assert len({id(g) for g in gens}) == 1, "each freed block made its own generation int"


def test_a_reconfirmed_block_takes_the_pools_shared_generation() -> None:
    from hkv_service.core.allocator import BlockPool

    floor = 99 << 24
    pool = BlockPool(PoolConfig(num_blocks=8, stride=4096, generation_floor=floor), nbytes=4096)
    got = [pool.claim_at(b, int(str(floor))) for b in range(8)]  # fresh int objects, as decoded
    assert got == [floor] * 8 and len({id(g) for g in got}) == 1
