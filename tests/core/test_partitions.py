"""Metadata partitions in the core: routing is a pure function of root, id and lease; a view
issues only ids and leases that name it, hands out only its own range of a pool, and refuses a
chain whose root is another partition's (a client listing partitions in another order)."""

from __future__ import annotations

import collections
import itertools

import pytest

from hkv_service.core.allocator import BlockPool
from hkv_service.core.api import AllocRequest, LookupRequest, PoolConfig, StateConfig
from hkv_service.core.errors import InvalidInput, WrongPartition
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import (
    MAX_PARTITIONS,
    Partition,
    block_range,
    jump_hash,
    partition_of_block,
    partition_of_id,
    partition_of_lease,
    partition_of_root,
)
from hkv_service.core.state_view import CacheState
from hkv_service.settings import MAX_PARTITIONS as SETTINGS_MAX
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for

SPEC = default_spec()


def _chain(seed: int, n: int = 4) -> list[bytes]:
    return hash_blocks(list(range(seed * 1000, seed * 1000 + 64 * n)), 64, ExtraKeys("t"))


def test_the_settings_bound_is_the_cores() -> None:
    assert SETTINGS_MAX == MAX_PARTITIONS


def test_jump_hash_spreads_and_moves_little_when_a_partition_is_added() -> None:
    keys = range(0, 20_000 * 7919, 7919)
    four = [jump_hash(k * 0x9E3779B97F4A7C15 & (1 << 64) - 1, 4) for k in keys]
    five = [jump_hash(k * 0x9E3779B97F4A7C15 & (1 << 64) - 1, 5) for k in keys]
    counts = collections.Counter(four)
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 0.2 * len(four)
    moved = sum(a != b for a, b in zip(four, five, strict=True))
    assert moved < 0.3 * len(four)  # ~1/5 move; a modulo would move ~4/5
    assert all(b == 4 for a, b in zip(four, five, strict=True) if a != b)


def test_block_ranges_tile_the_pool_and_invert() -> None:
    for n_blocks, count in [(10, 3), (256, 4), (7, 7), (1000, 64)]:
        spans = [block_range(n_blocks, i, count) for i in range(count)]
        assert spans[0][0] == 0 and spans[-1][1] == n_blocks
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        for b in range(n_blocks):
            i = partition_of_block(b, n_blocks, count)
            assert spans[i][0] <= b < spans[i][1]


def test_partition_parse_refuses_what_is_not_i_of_n() -> None:
    assert Partition.parse("2/4") == Partition(2, 4)
    for bad in ("4/4", "1", "a/b", "-1/2", f"0/{MAX_PARTITIONS + 1}"):
        with pytest.raises(InvalidInput):
            Partition.parse(bad)


@pytest.mark.parametrize("count", [2, 3])
def test_a_partition_issues_ids_and_leases_that_name_it(count: int) -> None:
    for index in range(count):
        state = CacheState(SPEC, StateConfig(partition=Partition(index, count)))
        state.register_owner("s0", pools_for(Layout(SPEC), 64))
        mine = next(c for s in range(200) if partition_of_root((c := _chain(s))[0], count)
                    == index)
        ids = commit_prefix(state, mine, "s0")
        assert {partition_of_id(oid, count) for oid in ids.values()} == {index}
        m = state.lookup(LookupRequest(mine, lease_ttl_s=5.0))
        assert m.lease_id is not None and partition_of_lease(m.lease_id, count) == index


def test_a_chain_of_another_partition_is_refused() -> None:
    state = CacheState(SPEC, StateConfig(partition=Partition(0, 2)))
    state.register_owner("s0", pools_for(Layout(SPEC), 64))
    other = next(c for s in range(200) if partition_of_root((c := _chain(s))[0], 2) == 1)
    with pytest.raises(WrongPartition) as err:
        state.lookup(LookupRequest(other))
    assert err.value.expected == 1 and err.value.partition == "0/2"
    with pytest.raises(WrongPartition):
        state.allocate(other, [AllocRequest(0, "c4")], "s0")
    assert state.object_count() == 0 and not state.index  # refused before touching anything


def test_a_pool_range_hands_out_and_takes_back_only_its_own_blocks() -> None:
    pool = BlockPool(PoolConfig(num_blocks=10, stride=64, first=6), nbytes=64)
    assert pool.free_count() == 4
    taken = [pool.take() for _ in range(5)]
    assert taken == [6, 7, 8, 9, None]
    other = BlockPool(PoolConfig(num_blocks=10, stride=64, first=6), nbytes=64)
    assert not other.claim(5) and not other.claim(10)  # another partition's / beyond
    assert other.claim(8) and other.free_count() == 3


def test_a_pool_range_outside_the_pool_is_refused() -> None:
    state = CacheState(SPEC)
    bad = {name: PoolConfig(cfg.num_blocks, cfg.stride, cfg.base_align, first=cfg.num_blocks)
           for name, cfg in pools_for(Layout(SPEC), 64).items()}
    with pytest.raises(InvalidInput, match="first block"):
        state.register_owner("s0", bad)


def test_a_restarted_view_never_issues_a_lease_id_of_the_one_before() -> None:
    """Regression: lease ids started at the same value in every view, so after a restart a
    client releasing its old lease released another client's new one (its objects no longer
    pinned). A view's lease ids now start from a random base, as object ids do."""
    for partition in (Partition(), Partition(1, 2)):
        firsts = set()
        for _ in range(8):
            state = CacheState(SPEC, StateConfig(partition=partition))
            state.register_owner("s0", pools_for(Layout(SPEC), 64))
            chain = next(c for s in range(200)
                         if partition.owns_root((c := _chain(s))[0]))
            commit_prefix(state, chain, "s0")
            m = state.lookup(LookupRequest(chain, lease_ttl_s=5.0))
            assert m.lease_id is not None
            assert partition_of_lease(m.lease_id, partition.count) == partition.index
            firsts.add(m.lease_id)
        assert len(firsts) == 8  # (a collision has odds of about 2**-32 per pair)


def test_an_allocation_before_any_owner_registered_says_so() -> None:
    """A partition restarted a moment ago holds no owner yet: the refusal says to wait for
    the shards' re-registration, not that every block is pinned."""
    from hkv_service.core.errors import PoolExhausted

    state = CacheState(SPEC)
    with pytest.raises(PoolExhausted, match=r"no owner .* is registered"):
        state.allocate(_chain(0), [AllocRequest(0, "c4")])


def test_a_restarted_view_never_issues_a_capture_id_of_the_one_before() -> None:
    """As lease ids: capture ids counted from 1 in every view, so after a restart releasing
    an old capture released another client's new one (its blocks no longer pinned)."""
    firsts = set()
    for _ in range(8):
        state = CacheState(SPEC)
        state.register_owner("s0", pools_for(Layout(SPEC), 64))
        chain = _chain(1)
        commit_prefix(state, chain, "s0")
        m = state.lookup(LookupRequest(chain))
        handles = [h for hs in m.handles.values() for h in hs]
        firsts.add(state.register_capture(handles)[0])
    assert len(firsts) == 8


def test_a_range_request_must_match_where_the_view_splits_chains() -> None:
    """A view keeping chains whole refuses a request from another depth; a splitting view
    refuses one that crosses a range's end or starts inside a range (a client with another
    range_blocks fails loudly, never splits a chain elsewhere), and an allocate likewise."""
    period = Layout(SPEC).period
    whole = CacheState(SPEC)
    with pytest.raises(InvalidInput, match="keeps a chain whole"):
        whole.lookup(LookupRequest(_chain(1, period), first_block=period))
    split = CacheState(SPEC, StateConfig(range_blocks=period))
    with pytest.raises(InvalidInput, match="splits chains"):
        split.lookup(LookupRequest(_chain(2, period + 1)))
    with pytest.raises(InvalidInput, match="splits chains"):
        split.lookup(LookupRequest(_chain(3, 1), first_block=1))
    with pytest.raises(InvalidInput, match="splits chains"):
        split.allocate(_chain(4, 2 * period), [AllocRequest(0, "c4")])
    assert split.lookup(LookupRequest(_chain(5, period), first_block=period)).usable_tokens \
        == period * Layout(SPEC).hash_block  # nothing of its own needed: the range's start
    with pytest.raises(InvalidInput, match="range_blocks must be 0"):
        CacheState(SPEC, StateConfig(range_blocks=period + 1))
