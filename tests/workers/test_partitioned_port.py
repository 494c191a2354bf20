"""workers/partitioned.py on its own: what goes where, and what a client is told when the
partitions are listed wrong, one is down, or a pool is too small to split."""

from __future__ import annotations

from typing import Any

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, ObjectTransitions, Params, StateConfig
from hkv_service.core.errors import InvalidInput, Unavailable, UnknownOwner, WrongPartition
from hkv_service.core.ids import ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import Partition, partition_of_id, partition_of_root
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for
from workers.local import LocalMetadata, connect
from workers.partitioned import PartitionedMetadata, PartitionsLost

SPEC = default_spec()
LAYOUT = Layout(SPEC)
OWNER = ShardId("s0")


def _parts(n: int) -> list[LocalMetadata]:
    return [LocalMetadata(CacheState(SPEC, StateConfig(partition=Partition(i, n))))
            for i in range(n)]


def _rooted(w: Any, n: int, want: int) -> list[bytes]:
    return next(h for s in range(500) if partition_of_root((h := w.prompt(2, seed=s))[0], n)
                == want)


class Down:
    """A partition that cannot be reached (every call: UNAVAILABLE)."""

    def __init__(self, inner: LocalMetadata) -> None:
        self.inner, self.down = inner, False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)

        def call(*a: Any, **k: Any) -> Any:
            if self.down:
                raise Unavailable("partition down")
            return method(*a, **k)
        return call


def test_a_list_in_another_order_is_refused_before_any_call() -> None:
    parts = _parts(2)
    with pytest.raises(InvalidInput, match="says it is partition 1/2"):
        PartitionedMetadata(parts[::-1]).get_spec()
    assert PartitionedMetadata(parts).get_spec() == SPEC


def test_a_chain_sent_to_the_wrong_partition_is_refused(w: Any) -> None:
    parts = _parts(2)
    with pytest.raises(WrongPartition):
        parts[0].lookup(LookupRequest(_rooted(w, 2, 1)))


def test_every_partition_gets_its_own_range_of_every_pool() -> None:
    parts = _parts(3)
    meta = PartitionedMetadata(parts)
    meta.register_owner(OWNER, pools_for(LAYOUT, 30))
    ranges = [{(p.config.first, p.config.num_blocks)
               for p in part.state.owners[OWNER].pools.values()} for part in parts]
    assert ranges == [{(0, 10)}, {(10, 20)}, {(20, 30)}]


def test_a_pool_smaller_than_the_partition_count_is_refused() -> None:
    with pytest.raises(InvalidInput, match="fewer than the 3 metadata partitions"):
        PartitionedMetadata(_parts(3)).register_owner(OWNER, pools_for(LAYOUT, 2))


def test_transition_many_is_split_by_partition_and_answered_in_order(w: Any) -> None:
    meta = PartitionedMetadata(_parts(2))
    meta.register_owner(OWNER, pools_for(LAYOUT, 16))
    oids = []
    for k, i in enumerate((0, 1, 0, 1)):
        a = meta.allocate(_rooted(w, 2, i), [AllocRequest(k // 2, "c4")], OWNER)[0]
        oids.append(a.handle.object_id)
    assert [partition_of_id(o, 2) for o in oids] == [0, 1, 0, 1]
    items = [ObjectTransitions(o, (Event.WRITE_DONE,), (Params(version=7 + k),))
             for k, o in enumerate(oids)]
    items.insert(1, ObjectTransitions(oids[1], (Event.TAIL_DONE,)))  # refused: wrong kind
    got = meta.transition_many(items)
    assert [type(r).__name__ for r in got][1] == "IllegalTransition"
    ok = [r for k, r in enumerate(got) if k != 1]
    assert [r.object_id for r in ok] == oids  # type: ignore[union-attr]


def test_a_partition_down_fails_only_its_own_items(w: Any) -> None:
    """transition_many is per item: the items of a partition that answered were applied and
    say so. (Raising for all made the data plane forget the bytes of commits that had
    landed: objects READY over blocks their shard no longer vouched for.)"""
    parts = _parts(2)
    down = Down(parts[1])
    meta = PartitionedMetadata([parts[0], down])  # type: ignore[list-item]
    meta.register_owner(OWNER, pools_for(LAYOUT, 16))
    oids = [meta.allocate(_rooted(w, 2, i), [AllocRequest(d, "c4")], OWNER)[0].handle.object_id
            for i, d in ((0, 0), (1, 0), (0, 1))]
    down.down = True
    got = meta.transition_many([ObjectTransitions(o, (Event.WRITE_DONE,), (Params(version=9),))
                                for o in oids])
    assert isinstance(got[1], Unavailable)
    assert [r.object_id for r in (got[0], got[2])] == [oids[0], oids[2]]  # type: ignore[union-attr]
    assert {parts[0].state.objects[o].state for o in (oids[0], oids[2])} == {
        State.COMPRESSED_READY}


def test_heartbeat_names_the_partitions_that_forgot_the_owner() -> None:
    parts = _parts(3)
    meta = PartitionedMetadata(parts)
    inc = meta.register_owner(OWNER, pools_for(LAYOUT, 9))
    meta.heartbeat(OWNER, inc)
    parts[2].swap(CacheState(SPEC, StateConfig(partition=Partition(2, 3))))
    with pytest.raises(PartitionsLost) as lost:
        meta.heartbeat(OWNER, inc)
    assert lost.value.partitions == frozenset({2})
    again = meta.register_owner(OWNER, pools_for(LAYOUT, 9), partitions=lost.value.partitions)
    meta.heartbeat(OWNER, again)
    with pytest.raises(UnknownOwner):
        meta.heartbeat(OWNER, inc)  # the old number is not current any more
    assert parts[0].state.owners[OWNER].incarnation == 1  # the others never re-registered


def _committed(meta: PartitionedMetadata, w: Any, seed: int) -> list[int]:
    hashes = w.prompt(2, seed=seed)
    alloc = meta.allocate(hashes, [AllocRequest(0, "c4")], OWNER)
    oid = alloc[0].handle.object_id
    meta.transition_many([ObjectTransitions(oid, [Event.WRITE_DONE], [Params()])])
    return [int(oid)]


def test_a_stale_loss_report_ends_the_successor_in_no_partition(w: Any) -> None:
    """The witness's partition judges the report; the others (which cannot) follow it."""
    parts = _parts(3)
    meta = PartitionedMetadata(parts)
    meta.register_owner(OWNER, pools_for(LAYOUT, 9))
    old = _committed(meta, w, 1)
    inc = meta.register_owner(OWNER, pools_for(LAYOUT, 9))  # the restarted shard
    assert meta.mark_owner_lost(OWNER, old) is None
    meta.heartbeat(OWNER, inc)  # current in every partition
    assert all(p.state.owners[OWNER].alive for p in parts)
    mine = _committed(meta, w, 2)
    assert meta.mark_owner_lost(OWNER, mine) == 1  # current: declared in every partition
    assert not any(p.state.owners[OWNER].alive for p in parts)


def test_a_partition_down_fails_its_calls_and_not_the_others(w: Any) -> None:
    parts = _parts(2)
    flaky = Down(parts[1])
    meta = PartitionedMetadata([parts[0], flaky])  # type: ignore[list-item]
    inc = meta.register_owner(OWNER, pools_for(LAYOUT, 8))
    flaky.down = True
    with pytest.raises(Unavailable):
        meta.heartbeat(OWNER, inc)
    assert meta.lookup(LookupRequest(_rooted(w, 2, 0))).usable_tokens == 0  # answered
    with pytest.raises(Unavailable):
        meta.lookup(LookupRequest(_rooted(w, 2, 1)))


def test_connect_takes_a_comma_separated_list_and_a_single_endpoint_stays_plain() -> None:
    parts = _parts(2)
    assert isinstance(connect(parts), PartitionedMetadata)
    assert connect([parts[0]]) is parts[0]
    meta = connect("127.0.0.1:1, 127.0.0.1:2")
    try:
        assert isinstance(meta, PartitionedMetadata) and meta.count == 2
    finally:
        meta.close()  # type: ignore[attr-defined]


def test_stats_are_summed_and_kept_per_partition(w: Any) -> None:
    parts = _parts(2)
    meta = PartitionedMetadata(parts)
    meta.register_owner(OWNER, pools_for(LAYOUT, 8))
    stats = meta.stats()
    each = stats["partitions"]
    assert [p["partition"] for p in each] == ["0/2", "1/2"]  # type: ignore[index]
    assert stats["gauges"]["owners_alive"] == 2  # type: ignore[index]  # one per partition


def test_a_split_allocate_is_all_or_nothing_across_ranges(w: Any) -> None:
    """An allocate over two ranges of a split chain whose second range's partition refuses
    (its pools exhausted) leaves nothing of the first range allocated either, as one
    partition's allocate does."""
    from hkv_service.core.errors import PoolExhausted

    period = LAYOUT.period
    parts = [LocalMetadata(CacheState(SPEC, StateConfig(partition=Partition(i, 2),
                                                        range_blocks=period)))
             for i in range(2)]
    hs = next(h for h in (w.prompt(2 * period, seed=s) for s in range(500))
              if partition_of_root(h[0], 2) != partition_of_root(h[period], 2))
    down = Down(parts[partition_of_root(hs[period], 2)])
    wrapped = [down if p is down.inner else p for p in parts]
    meta = PartitionedMetadata(wrapped)
    meta.register_owner(OWNER, pools_for(LAYOUT, 30))
    assert meta.range_blocks == period
    slots = [AllocRequest(d, LAYOUT.columns[c].name) for d in range(2 * period)
             for c in LAYOUT.attached[d % period]]
    real = down.inner.allocate

    def exhausted(*a: Any, **k: Any) -> Any:
        raise PoolExhausted("no free block")

    down.inner.allocate = exhausted  # type: ignore[method-assign]
    with pytest.raises(PoolExhausted):
        meta.allocate(hs, slots)
    assert [p.state.object_count() for p in parts] == [0, 0]
    down.inner.allocate = real  # type: ignore[method-assign]
    got = meta.allocate(hs, slots)
    assert len(got) == len(slots) and not any(a.existing for a in got)
    assert all(p.state.object_count() > 0 for p in parts)


def test_every_partition_is_told_whatever_one_answers(w: Any) -> None:
    """Regression (issue 35, item 4): a witness partition that did not know the owner (just
    restarted) raised UnknownOwner, and the partitions without a witness were never told.
    With the instance every partition judges alone; one that does not know the owner, or
    is down, stops none of the others."""
    parts = _parts(3)
    flaky = Down(parts[2])
    meta = PartitionedMetadata([parts[0], parts[1], flaky])  # type: ignore[list-item]
    meta.register_owner(OWNER, pools_for(LAYOUT, 9), instance=7)
    mine = _committed(meta, w, 1)
    parts[partition_of_id(mine[0], 3)].swap(  # the witness's partition restarted
        CacheState(SPEC, StateConfig(partition=Partition(partition_of_id(mine[0], 3), 3))))
    flaky.down = True
    assert meta.mark_owner_lost(OWNER, mine, instance=8) is None  # another process: stale
    assert all(p.state.owners[OWNER].alive for p in parts if OWNER in p.state.owners)
    meta.mark_owner_lost(OWNER, mine, instance=7)  # current: every partition that can hear
    told = [p for p in parts if OWNER in p.state.owners and p is not parts[2]]
    assert told and not any(p.state.owners[OWNER].alive for p in told)


def test_a_split_allocate_gives_each_range_its_own_tokens(w: Any) -> None:
    """The KV events' token ids (issue 39): each range's partition is told the tokens of the
    blocks it is given, hash_block per hash, aligned with them."""
    period = LAYOUT.period
    parts = [LocalMetadata(CacheState(SPEC, StateConfig(partition=Partition(i, 2),
                                                        range_blocks=period)))
             for i in range(2)]
    hs = next(h for h in (w.prompt(2 * period, seed=s) for s in range(500))
              if partition_of_root(h[0], 2) != partition_of_root(h[period], 2))
    told: list[tuple[int, list[bytes], Any]] = []
    for p in parts:
        real = p.allocate

        def recording(hashes: Any, requests: Any, owner: Any = None, first_block: int = 0,
                      token_ids: Any = None, real: Any = real) -> Any:
            told.append((first_block, list(hashes), token_ids))
            return real(hashes, requests, owner, first_block, token_ids)

        p.allocate = recording  # type: ignore[method-assign]
    meta = PartitionedMetadata(parts, inline=True)
    meta.register_owner(OWNER, pools_for(LAYOUT, 30))
    hb = LAYOUT.hash_block
    tokens = list(range(len(hs) * hb))
    slots = [AllocRequest(d, LAYOUT.columns[c].name) for d in range(2 * period)
             for c in LAYOUT.attached[d % period]]
    meta.allocate(hs, slots, token_ids=tokens)
    assert sorted(lo for lo, _, _ in told) == [0, period]
    for lo, hashes, toks in told:
        assert hashes == hs[lo:lo + len(hashes)]
        assert toks == tokens[lo * hb:(lo + len(hashes)) * hb]
