"""Owner loss is O(1) under the lock; a lost owner's objects are buried later, in slices.

Between the loss and the burial its objects linger in the view, dead. These tests are the
window the lazy reap opens: the hash still matches and the record still reads READY, but
nothing may serve it, report it as existing, sync to it or block a re-confirm with it.
"""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest, Handle, LookupRequest, ObjectReport, Params
from hkv_service.core.errors import IllegalTransition, StaleHandle, UnknownObject, UnknownOwner
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0, S1 = ShardId("s0"), ShardId("s1")
BLOCKS = 24


def _state() -> tuple[CacheState, list[BlockHash], dict[tuple[int, str], ObjectId]]:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    hashes = prompt_hashes(st.spec, BLOCKS)
    ids = commit_prefix(st, hashes, owner=S1)
    assert st.lookup(LookupRequest(hashes)).usable_tokens > 0
    return st, hashes, ids


def _handles(st: CacheState, hashes: list[BlockHash]) -> list[Handle]:
    m = st.lookup(LookupRequest(hashes))
    return [h for hs in m.handles.values() for h in hs]


def test_the_loss_buries_nothing_under_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    st, _, ids = _state()
    buried: list[object] = []
    monkeypatch.setattr(st._tables, "bury", buried.append)
    held = st.mark_owner_lost(S1)
    assert held == len(ids)  # it says what the owner held ...
    assert buried == [] and len(st.objects) == len(ids)  # ... and touched none of it


def test_a_lost_owners_objects_are_never_served_before_they_are_buried() -> None:
    st, hashes, _ = _state()
    before = _handles(st, hashes)
    st.mark_owner_lost(S1)
    m = st.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert m.usable_tokens == 0 and not any(m.handles.values()) and m.lease_id is None
    for h in before:
        with pytest.raises((StaleHandle, UnknownObject)):
            st.check_read(h)


def test_a_lost_owners_object_is_not_existing_to_a_writer() -> None:
    st, hashes, ids = _state()
    st.mark_owner_lost(S1)
    lay = st.layout
    reqs = [AllocRequest(d, lay.columns[c].name) for d in range(BLOCKS)
            for c in lay.attached[d % lay.period]]
    allocs = st.allocate(hashes, reqs, S0)
    assert not any(a.existing for a in allocs)
    assert {a.handle.shard for a in allocs} == {S0}
    assert all(a.handle.object_id not in ids.values() for a in allocs)


def test_transitions_of_a_lost_owners_objects_are_refused() -> None:
    st, _, ids = _state()
    st.mark_owner_lost(S1)
    oid = next(iter(ids.values()))
    with pytest.raises(UnknownObject):
        st.transition(oid, Event.EVICT)
    with pytest.raises(UnknownObject):
        st.begin_offload(oid, S0)


def test_an_indexer_is_not_synced_to_a_lost_owners_kv() -> None:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    hashes = prompt_hashes(st.spec, 4)
    lay = st.layout
    kv_col = next(c for c in lay.columns if c.kind is Kind.COMPRESSED and any(
        i.indexes == c.index for i in lay.columns))
    idx_col = next(i for i in lay.columns if i.indexes == kv_col.index)
    d = next(d for d in range(4) if lay.lives_at(kv_col.index, d))
    (kv,) = st.allocate(hashes, [AllocRequest(d, kv_col.name)], S1)
    version = st.transition(kv.handle.object_id, Event.WRITE_DONE).version
    (idx,) = st.allocate(hashes, [AllocRequest(d, idx_col.name)], S0)
    st.transition(idx.handle.object_id, Event.WRITE_DONE)
    st.mark_owner_lost(S1)
    with pytest.raises(IllegalTransition):
        st.transition(idx.handle.object_id, Event.INDEXER_SYNC, Params(version=version))
    assert st.objects[idx.handle.object_id].state is State.INDEXER_WRITTEN


def test_the_restarted_owner_re_confirms_the_slots_its_lost_incarnation_held() -> None:
    st, hashes, ids = _state()
    records = {k: st.objects[oid] for k, oid in ids.items()}
    inc = st.register_owner(S1, pools_for(st.layout, 256))  # lost, then back: nothing reaped
    reports = [ObjectReport(hashes[d], hashes[d - 1] if d else None, d, col, r.state,
                            r.block, r.generation, r.version, r.lo, r.hi)
               for (d, col), r in records.items()]
    assert st.confirm(S1, reports, inc) == len(reports)
    again = _handles(st, hashes)
    assert again and {h.shard for h in again} == {S1}
    assert not {h.object_id for h in again} & set(ids.values())  # new objects, not the dead
    assert st.lookup(LookupRequest(hashes)).usable_tokens > 0


def test_reaping_goes_in_slices_and_buries_only_the_lost_owner() -> None:
    st, _, _ = _state()
    other = commit_prefix(st, prompt_hashes(st.spec, 8, seed=1), owner=S0)
    st.mark_owner_lost(S1)
    counts = [len(st.objects)]
    while st.reap(budget=16):
        counts.append(len(st.objects))
        assert counts[-2] - counts[-1] <= 16
    assert len(st.objects) == len(other)
    assert all(oid in st.objects for oid in other.values())
    assert st.stats()["gauges"]["owners_reaping"] == 0  # type: ignore[index]
    assert len(counts) > 3  # it took several slices


def test_a_disk_copy_on_a_lost_tier_is_not_offered_and_a_new_one_can_be_made() -> None:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    hashes = prompt_hashes(st.spec, 4)
    ids = commit_prefix(st, hashes, owner=S0)
    oid = next(o for (d, c), o in ids.items() if st.objects[o].kind is Kind.COMPRESSED)
    disk = st.begin_offload(oid, S1)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    st.mark_owner_lost(S1)  # the tier holding the copy
    again = st.begin_offload(oid, S0)
    assert again.object_id != disk.object_id and again.shard in (S0, "")
    with pytest.raises(UnknownOwner):
        st.begin_offload(oid, S1)  # a lost tier takes no copies until it registers again


def _counting_burials(st: CacheState, monkeypatch: pytest.MonkeyPatch) -> list[ObjectId]:
    buried: list[ObjectId] = []
    bury = st._tables.bury

    def counted(rec):  # type: ignore[no-untyped-def]
        buried.append(rec.object_id)
        bury(rec)

    monkeypatch.setattr(st._tables, "bury", counted)
    return buried


def test_a_lookup_buries_only_up_to_where_its_walk_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup after a loss cleans its path, not the whole question: at 1M objects a
    2,048-block question buried a thousand records past its stop under the lock (24 ms), and
    lookups behind it stalled 60-300 ms (hkv bench scale, owner loss at 1M-4M)."""
    st, hashes, ids = _state()
    buried = _counting_burials(st, monkeypatch)
    st.mark_owner_lost(S1)
    assert st.lookup(LookupRequest(hashes)).usable_tokens == 0  # stops at the first block
    at_root = {oid for (d, _), oid in ids.items() if d == 0}
    assert set(buried) == at_root  # the walk's stop, and nothing past it
    st.reap_all()  # the rest is the reaper's
    assert len(st.objects) == 0


def test_a_write_after_a_loss_buries_only_the_slots_it_asks_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A follow-up turn extends a prompt whose blocks a lost owner held: the write buries the
    dead records of the slots it allocates (a lost owner's object is not existing to it),
    not every one along the path above them. Along the whole path, a write extending a
    1,000-block prompt buried ~2,000 records in one hold (`hkv bench scale`, owner loss at
    1M: a 50.7 ms hold of the mutation thread, the 54 ms lookup stall of run M)."""
    st, hashes, ids = _state()
    more = prompt_hashes(st.spec, BLOCKS + 4, seed=5)  # (another prompt's blocks, unrelated)
    follow = [*hashes, *more[BLOCKS:]]  # ... the same prefix, 4 new blocks after it
    st.allocate(follow, [AllocRequest(BLOCKS, "c4")], S1)  # one slot of it, S1's too
    buried = _counting_burials(st, monkeypatch)
    st.mark_owner_lost(S1)
    lay = st.layout
    reqs = [AllocRequest(d, lay.columns[c].name) for d in range(BLOCKS, BLOCKS + 4)
            for c in lay.attached[d % lay.period]]
    allocs = st.allocate(follow, reqs, S0)
    assert not any(a.existing for a in allocs) and {a.handle.shard for a in allocs} == {S0}
    assert len(buried) == 1  # S1's slot at depth BLOCKS: the path above is the reaper's
    assert all(st.objects.get(oid) is not None for oid in ids.values())
    st.reap_all()
    assert all(st.objects.get(oid) is None for oid in ids.values())
    assert st.lookup(LookupRequest(follow)).usable_tokens == 0  # (the prefix is gone)


def test_a_lookup_after_a_loss_cleans_as_far_as_its_walk_reaches() -> None:
    """The live prefix (another owner's) is served whole, and the walk stops exactly where
    the lost owner's blocks begin: the entry it stops at was cleaned, so its dead records,
    still READY, are never read as a hit. The answer is the one after every burial."""
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    hashes = prompt_hashes(st.spec, BLOCKS)
    live = 12
    commit_prefix(st, hashes[:live], owner=S0)
    commit_prefix(st, hashes, owner=S1)  # the rest on S1
    whole = st.lookup(LookupRequest(hashes[:live])).usable_tokens
    assert 0 < whole < st.lookup(LookupRequest(hashes)).usable_tokens
    st.mark_owner_lost(S1)
    m = st.lookup(LookupRequest(hashes))
    assert m.usable_tokens == whole
    assert {h.shard for hs in m.handles.values() for h in hs} == {S0}
    st.reap_all()
    assert st.lookup(LookupRequest(hashes)).usable_tokens == whole


@pytest.mark.parametrize("how", ["lost", "re-registered"])
def test_a_reaped_incarnations_pools_hold_nothing_per_block(how: str) -> None:
    """The reaper lets go of a lost incarnation's per-block books as it passes each block: a
    reap that ended by dropping them all at once (one incarnation's pools: 125k blocks at 1M
    objects) held the GIL 51 ms, ~200 ms at 4M, and every lookup waited."""
    st, hashes, _ = _state()
    old = st.owners[S1]
    if how == "lost":
        st.mark_owner_lost(S1)
    else:
        st.register_owner(S1, pools_for(st.layout, 256))
    before = sum(p.tracked() for p in old.pools.values())
    assert before > 0
    assert st.reap(budget=8)  # one slice: its blocks' books go now, not when the reap ends
    assert before - 8 <= sum(p.tracked() for p in old.pools.values()) < before
    st.reap_all()
    for pool in old.pools.values():
        assert not list(pool.books()) and not pool.tracked() and not pool._free and not pool.free
    assert st.lookup(LookupRequest(hashes)).usable_tokens == 0


@pytest.mark.parametrize("then", ["verified", "inflight"])
def test_a_copy_loaded_again_after_its_holder_restarted_is_not_reaped(then: str) -> None:
    """A disk copy's loaded memory copy sat on s1; s1 restarts (its old incarnation is
    queued for reaping, its old pool still names the record at that block). The copy is
    loaded again, onto the new s1. The reaper, passing the old pool's block, must not bury
    the record: it lives elsewhere now. (Found by the stateful test: the load in flight was
    failed under the loader, its ticket and new block released; a verified one went back to
    rest.)"""
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    hashes = prompt_hashes(st.spec, BLOCKS)
    ids = commit_prefix(st, hashes, owner=S0)
    kv = next(oid for (d, _), oid in ids.items()
              if d == 0 and st.objects[oid].kind is Kind.COMPRESSED)
    disk = st.begin_offload(kv, S0)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(kv)  # only the disk copy stays ...
    first = st.begin_load(disk.object_id, S1)  # ... loaded onto s1
    st.transition(first.object_id, Event.LOAD_VERIFIED)
    st.register_owner(S1, pools_for(st.layout, 256))  # s1 restarts: that loaded copy is gone
    again = st.begin_load(disk.object_id, S1)  # loaded again, onto the new s1
    assert again.shard == S1
    if then == "verified":
        st.transition(again.object_id, Event.LOAD_VERIFIED)
    st.reap_all()
    rec = st.objects[disk.object_id]
    want = State.ON_DISK_READY if then == "verified" else State.ON_DISK_INFLIGHT
    assert (rec.state, rec.shard, rec.block, rec.generation) == (
        want, S1, again.block, again.generation)
    assert st.admission.stats().in_transit_objects == (then == "inflight")
    if then == "inflight":
        st.transition(again.object_id, Event.LOAD_VERIFIED)  # the loader finishes it
        assert st.objects[disk.object_id].state is State.ON_DISK_READY
    st.check_read(again)  # its handle reads


def test_a_reap_buries_a_tiers_copies_in_a_fixed_order() -> None:
    """A lost tier's disk copies are buried in an order fixed by the steps that made them
    (the last first), not by where the records sit in memory: a set of records iterated by
    address, so a replay of the same steps reaped in another order, placed later loads on
    other blocks, and the stateful tests' rule choices went Flaky."""
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    ids = commit_prefix(st, prompt_hashes(st.spec, BLOCKS), owner=S0)
    copies = []
    for oid in ids.values():
        if st.objects[oid].kind is Kind.COMPRESSED:
            disk = st.begin_offload(oid, S1)
            st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
            copies.append(disk.object_id)
    assert len(copies) > 16
    st.mark_owner_lost(S1)  # the tier
    seq = st.log[-1].seq
    st.reap_all()
    buried = [e.object_id for e in st.events_since(seq, limit=10_000)
              if e.object_id in set(copies)]
    assert buried == copies[::-1]


# -- loss reports with witnesses (the data plane's, fenced by what the failed call named) --

def _witnesses(handles: list[Handle]) -> list[int]:
    return [int(h.object_id) for h in handles]


def test_a_loss_report_about_a_replaced_incarnation_is_ignored() -> None:
    """Ray reports a crashed call's failure once the restarted shard is up: by then its new
    incarnation has registered (ending the old one). The report names the old handles; it
    must not end the successor and what it vouched for."""
    st, hashes, _ = _state()
    old = _handles(st, hashes)
    inc = st.register_owner(S1, pools_for(st.layout, 256))  # the restarted shard
    # the old records linger, dead, until the reaper gets to them: the report may come first
    assert all(int(h.object_id) in st.objects for h in old)
    new = prompt_hashes(st.spec, 4, seed=9)
    ids = commit_prefix(st, new, owner=S1)  # what the successor holds
    assert st.mark_owner_lost(S1, _witnesses(old)) is None
    st.heartbeat(S1, inc)  # still current: no UnknownOwner
    assert all(not st._tables.dead(st.objects[o]) for o in ids.values())
    assert st.lookup(LookupRequest(new)).usable_tokens > 0
    assert st.stats()["events"]["stale_loss_report"] == 1  # type: ignore[index]


def test_a_loss_report_about_the_current_incarnation_declares_it() -> None:
    st, hashes, ids = _state()
    handles = _handles(st, hashes)
    evicted = handles[0]
    st.evict(evicted.object_id)  # one witness gone meanwhile: another still proves it
    held = st.mark_owner_lost(S1, _witnesses(handles[:3]))
    assert held is not None and 0 < held < len(ids)  # what the evict left it
    with pytest.raises(UnknownOwner):
        st.heartbeat(S1, 2)
    assert st.lookup(LookupRequest(hashes)).usable_tokens == 0


def test_a_disk_copy_at_rest_witnesses_its_tier() -> None:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256))
    st.register_owner(S1, pools_for(st.layout, 256))
    ids = commit_prefix(st, prompt_hashes(st.spec, 4), owner=S0)
    oid = next(o for o in ids.values() if st.objects[o].kind is Kind.COMPRESSED)
    disk = st.begin_offload(oid, S1)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    rec = st.objects[disk.object_id]
    witness = [int(rec.object_id)]
    assert st.mark_owner_lost(S0, witness) is None  # not S0's: it proves nothing about S0
    assert st.mark_owner_lost(S1, witness) is not None  # the tier that holds it: declared
    with pytest.raises(UnknownOwner):
        st.begin_offload(oid, S1)


# -- loss reports that name the owner's instance (issue 35, item 4) ------------------------

P1, P2 = 0x1111, 0x2222  # two processes of shard S1: its instances


def _instance_state() -> tuple[CacheState, list[BlockHash], dict[tuple[int, str], ObjectId]]:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 256), instance=0x0F0F)
    st.register_owner(S1, pools_for(st.layout, 256), instance=P1)
    hashes = prompt_hashes(st.spec, BLOCKS)
    return st, hashes, commit_prefix(st, hashes, owner=S1)


def test_a_report_naming_the_current_instance_is_declared_whatever_was_evicted() -> None:
    """Regression: judged by witnesses alone, a real loss whose witnesses were all evicted
    before the report arrived was ignored, and the dead owner's other chains stayed hits
    until its heartbeat expired."""
    st, hashes, _ = _instance_state()
    handles = _handles(st, hashes)[:3]
    for h in handles:
        st.evict(h.object_id)
    assert st.mark_owner_lost(S1, _witnesses(handles), instance=P1) is not None
    assert st.lookup(LookupRequest(hashes)).usable_tokens == 0


def test_a_report_naming_an_earlier_instance_is_stale_even_if_a_witness_moved_on() -> None:
    """Regression: a disk copy keeps its id across loads, so a stale report whose witness is
    a copy later loaded onto the successor ended the successor."""
    st, _, ids = _instance_state()
    kv = next(o for o in ids.values() if st.objects[o].kind is Kind.COMPRESSED)
    disk = st.begin_offload(kv, S0)  # S0's tier holds the copy
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    st.begin_load(disk.object_id, S1)  # loaded onto P1
    st.transition(disk.object_id, Event.LOAD_VERIFIED)
    witness = [int(disk.object_id)]  # what a failed read on P1 names
    inc = st.register_owner(S1, pools_for(st.layout, 256), instance=P2)  # P1 died
    st.reap_all()  # the copy on P1 went back to rest; it loads onto P2, same id
    assert st.objects[disk.object_id].state is State.ON_DISK
    st.begin_load(disk.object_id, S1)
    st.transition(disk.object_id, Event.LOAD_VERIFIED)
    assert st.mark_owner_lost(S1, witness, instance=P1) is None  # about P1: stale
    st.heartbeat(S1, inc)  # P2 is still current
    assert st.mark_owner_lost(S1, witness, instance=P2) is not None  # about P2: declared
    with pytest.raises(UnknownOwner):
        st.heartbeat(S1, inc)


def test_a_report_about_an_owner_registered_without_an_instance_goes_by_witnesses() -> None:
    st, hashes, _ = _state()  # registered without instances (an older shard)
    old = _handles(st, hashes)
    st.register_owner(S1, pools_for(st.layout, 256))
    assert st.mark_owner_lost(S1, _witnesses(old), instance=P1) is None  # witnesses judge
    assert st.mark_owner_lost(S1, instance=P1) is not None  # nothing to judge by: declared
