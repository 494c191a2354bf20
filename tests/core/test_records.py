"""Records carry only what their kind uses; leases and captures are counted beside them."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest

from hkv_service.core.api import HandleColumn, LookupRequest, Params
from hkv_service.core.errors import IllegalTransition
from hkv_service.core.ids import BlockHash, GroupName, ObjectId, ShardId
from hkv_service.core.records import (
    _PRUNE_AT,
    PrefixEntry,
    drop_memos,
    new_record,
    record_type,
    register,
    set_shard,
    set_state,
)
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, State
from hkv_service.testing import commit_prefix, prompt_hashes


def _entry() -> PrefixEntry:
    return PrefixEntry(BlockHash(bytes(16)), None, 0, [None])


@pytest.mark.parametrize("kind", list(Kind))
def test_kind_column_and_shard_are_class_attributes(kind: Kind) -> None:
    rec = new_record(kind, 3, ObjectId(1), _entry(), State.ALLOCATED, ShardId("s"), 0, 0)
    assert (rec.kind, rec.column, rec.shard, rec.state) == (kind, 3, "s", State.ALLOCATED)
    assert type(rec) is record_type(kind, 3, ShardId("s"), State.ALLOCATED)
    assert not hasattr(rec, "__dict__")  # slots only: nothing can be added per record
    with pytest.raises(AttributeError):
        rec.shard = ShardId("t")  # type: ignore[misc]  # only set_shard moves it
    with pytest.raises(AttributeError):
        rec.state = State.WRITING  # type: ignore[misc]  # only set_state moves it
    set_shard(rec, ShardId("t"))  # (a disk copy loaded onto another owner's pool)
    set_state(rec, State.WRITING)
    assert type(rec) is record_type(kind, 3, ShardId("t"), State.WRITING)
    assert (rec.kind, rec.column, rec.shard, rec.state, rec.object_id, rec.block) == (
        kind, 3, "t", State.WRITING, 1, 0)


def test_a_field_the_kind_lacks_is_dropped_and_cannot_be_written() -> None:
    rec = new_record(Kind.COMPRESSED, 0, ObjectId(1), _entry(), State.ALLOCATED, ShardId("s"),
                     0, 0, version=4, lo=9, hi=12)
    assert (rec.version, rec.lo, rec.hi) == (4, 0, 0)
    with pytest.raises(AttributeError):
        rec.lo = 5  # type: ignore[misc]  # a silent write to a shared default would be a bug
    swa = new_record(Kind.SWA, 2, ObjectId(2), _entry(), State.ALLOCATED, ShardId("s"), 0, 0,
                     version=4, lo=9, hi=12)
    assert (swa.version, swa.lo, swa.hi) == (0, 9, 12)


@pytest.mark.parametrize("kind", list(Kind))
def test_every_field_a_kind_stores_reads_back_what_was_given(kind: Kind) -> None:
    """new_record builds positionally, in each class's field order: a field out of place
    would give a KV the version of its range, or a disk copy the owner of another."""
    given = {"version": 7, "lo": 3, "hi": 11, "inner": Kind.SWA,
             "disk_owner": ShardId("tier")}
    rec = new_record(kind, 2, ObjectId(9), _entry(), State.ALLOCATED, ShardId("s"), 5, 6,
                     **given)  # type: ignore[arg-type]
    stored = set(given) & {f.name for f in dataclasses.fields(rec)}
    assert {f: getattr(rec, f) for f in stored} == {f: given[f] for f in stored}
    assert all(getattr(rec, f) in (0, None) for f in set(given) - stored)
    assert (rec.object_id, rec.state, rec.shard, rec.block, rec.generation, rec.seq) == (
        9, State.ALLOCATED, "s", 5, 6, 0)
    assert stored == {Kind.COMPRESSED: {"version"}, Kind.INDEXER: {"version"},
                      Kind.SWA: {"lo", "hi"}, Kind.TAIL: {"hi"}, Kind.STATE: set(),
                      Kind.DISK: set(given)}[kind]


def test_holds_empty_again_after_leases_and_captures_end(state: CacheState, spec) -> None:
    hs = prompt_hashes(spec, 8)
    ids = commit_prefix(state, hs)
    m = state.lookup(LookupRequest(hs, lease_ttl_s=5))
    cap, _ = state.register_capture(m.handles["c4"][:2])
    c4 = state.objects[ids[(1, "c4")]]
    assert state.holds_of(c4) == (1, 1)
    with pytest.raises(IllegalTransition, match="leased by 1"):
        state.transition(c4.object_id, Event.EVICT, Params())
    state.release_lease(m.lease_id)
    with pytest.raises(IllegalTransition, match="graph capture"):
        state.transition(c4.object_id, Event.EVICT, Params())
    state.release_capture(cap)
    assert not state.holds.pins and not state.holds.captures  # nothing left behind
    state.transition(c4.object_id, Event.EVICT, Params())
    assert c4.state is State.EVICTED


def test_a_malformed_handle_column_from_the_wire_is_refused() -> None:
    from hkv_service.core.api import HandleColumn
    from hkv_service.core.ids import GroupName

    def col(records: bytes, names: tuple[str, ...], strides: tuple[int, ...]) -> HandleColumn:
        return HandleColumn(0, GroupName("c4"), Kind.COMPRESSED, 64, 1, records,
                            tuple(ShardId(n) for n in names), strides)

    good = HandleColumn.pack(0, GroupName("c4"), Kind.COMPRESSED, 64, 1, [7, 8], [0, 3], [0, 1],
                             [5, -1], (ShardId("a"), ShardId("b")), (128, 256))
    assert good.check() is good
    assert good.handles()[0].address == 5 * 128 and good.handles()[1].address == 0
    assert good.shards == ("a", "b") and good.blocks == (5, -1)
    with pytest.raises(ValueError, match="whole"):
        col(good.records[:-1], ("a", "b"), (128, 256)).check()
    with pytest.raises(ValueError, match="outside the table"):
        col(good.records, ("a",), (128,)).check()
    with pytest.raises(ValueError, match="one stride per shard"):
        col(good.records, ("a", "b"), (128,)).check()


def _column(names: tuple[str, ...], rows: list[tuple[int, int, int, int]]) -> HandleColumn:
    ids, gens, shards, blocks = (list(x) for x in zip(*rows, strict=True)) if rows else \
        ([], [], [], [])
    return HandleColumn.pack(3, GroupName("c4"), Kind.COMPRESSED, 64, 7, ids, gens, shards,
                             blocks, tuple(ShardId(n) for n in names),
                             tuple(16 * (int(n[1:]) + 1) for n in names))  # a shard's own


@pytest.mark.parametrize("second_names", [("s0", "s1"), ("s1", "s2", "s0")])
def test_columns_of_split_ranges_join_in_order_over_one_shard_table(
        second_names: tuple[str, ...]) -> None:
    """HandleColumn.concat: the pieces' handles in order, each still naming its own shard
    and stride, whether the partitions' shard tables agree (bytes joined) or not (remapped)."""
    a = _column(("s0", "s1"), [(10, 1, 0, 5), (11, 2, 1, 6)])
    b = _column(second_names, [(20, 3, 0, 7), (21, 4, 2 if len(second_names) > 2 else 1, 8)])
    empty = _column(second_names, [])
    joined = HandleColumn.concat([a, empty, b])
    assert joined.handles() == a.handles() + b.handles()
    assert [joined.strides[joined.shard_names.index(h.shard)] for h in joined.handles()] == [
        c.strides[c.shard_names.index(h.shard)] for c in (a, b) for h in c.handles()]
    joined.check()
    with pytest.raises(ValueError, match="do not join"):
        HandleColumn.concat([a, replace(b, column=4)])


class _Counted:
    """A memo stand-in that counts how often its liveness is read (what pruning costs)."""

    reads = 0

    def __init__(self) -> None:
        self._live = True

    @property
    def live(self) -> bool:
        _Counted.reads += 1
        return self._live

    def drop(self) -> None:
        self._live = False


def test_an_entry_many_memos_share_is_registered_on_in_linear_time() -> None:
    """A hot root's entries are on every memo through them (up to the table's 1,024): each
    registration copied and filtered the entry's whole tuple, O(n^2) over n memos (a hot root
    lookup repeated once made its memo ~3x slower than a walk, `hkv bench service`
    hot_root). Now the list is appended to and pruned of dropped ones at each doubling."""
    entry = PrefixEntry(BlockHash(b"r" * 16), None, 0, [])
    items = [_Counted() for _ in range(2000)]
    _Counted.reads = 0
    for it in items:
        register(it, [entry])  # type: ignore[arg-type]
    assert entry.memos is not None and list(entry.memos) == items  # all live, in order
    assert _Counted.reads < 4 * len(items)  # (the tuple rebuilt each time: ~2M reads)
    for it in items[:1900]:
        it.drop()
    more = [_Counted() for _ in range(100)]
    for it in more:
        register(it, [entry])  # type: ignore[arg-type]
    live = [m for m in entry.memos if m.live]
    assert live == items[1900:] + more  # nothing live lost
    assert len(entry.memos) <= 2 * len(live) + _PRUNE_AT  # the dropped ones' shells went
    drop_memos(entry)
    assert entry.memos is None and not any(m.live for m in live)
