"""Every handle a Match serves is safe on the copy it names, whichever copy that is (memory,
loaded disk copy, disk copy at rest), and blocks a reader does not need never stop the walk.

Regressions of issue 15 (each failed on the code before it): layer 4 checked on a copy other
than the one served (item 2), the indexer compared with a memory KV that was not served and a
version 0 that matched by accident (item 3), a misaligned SWA block before the window or a
tail at an earlier resume point stopping the walk (item 5), a disk KV and disk indexer synced
to each other given up (item 8), an empty lookup counted as a miss (item 9), an OFFLOADING
SWA copy reported as an incomplete window (item 11)."""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, Match, ObjectReport, Params
from hkv_service.core.errors import BadHash, UnsetVersion
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, Reason, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

N = 8
S0, S1 = ShardId("s0"), ShardId("s1")  # s1: pools based at 64, no block aligns above
ALIGN = 128  # the smallest object (a c128 block) is 128 bytes


@pytest.fixture
def st(spec, clock) -> CacheState:
    state = CacheState(spec, clock=clock)
    state.register_owner(S0, pools_for(state.layout, 64))
    state.register_owner(S1, pools_for(state.layout, 64, base_align=64))
    return state


def offload(st: CacheState, oid: ObjectId, disk_owner: ShardId = S0) -> ObjectId:
    dh = st.begin_offload(oid, disk_owner)
    st.transition(dh.object_id, Event.OFFLOAD_COMMITTED)
    return dh.object_id


def load(st: CacheState, disk_oid: ObjectId, owner: ShardId) -> None:
    h = st.begin_load(disk_oid, owner)
    st.transition(disk_oid, Event.LOAD_VERIFIED, generation=h.generation)


def assert_every_handle_aligned(m: Match, align: int) -> None:
    for hs in m.handles.values():
        for h in hs:
            if h.block >= 0:
                assert h.address % align == 0 and h.nbytes % align == 0, h


def reasons(m: Match) -> set[Reason]:
    return {d.reason for d in m.downgrades}


def test_a_misaligned_loaded_swa_copy_is_never_served(st: CacheState, spec) -> None:
    """Item 2: the memory SWA block is aligned but covers only part of the window; the disk
    copy covering it is loaded into s1. The gate saw the memory copy, the funnel served the
    disk copy: a handle at alignment 64 in a 128-aligned match."""
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(st, hs, S0)
    disk = offload(st, ids[(7, "swa")])
    st.evict(ids[(7, "swa")])
    load(st, disk, S1)
    (a,) = st.allocate(hs, [AllocRequest(7, "swa")], S0)
    st.transition(a.handle.object_id, Event.WRITE_DONE, Params(lo=448, hi=500))
    m = st.lookup(LookupRequest(hs, alignment=ALIGN))
    assert_every_handle_aligned(m, ALIGN)
    assert m.usable_tokens == 384 and Reason.MISALIGNED in reasons(m)
    assert st.lookup(LookupRequest(hs)).usable_tokens == 512  # alignment 1: the disk copy


def test_a_misaligned_loaded_monotone_copy_stops_the_walk(st: CacheState, spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(st, hs, S0)
    disk = offload(st, ids[(3, "c128")])
    st.evict(ids[(3, "c128")])
    load(st, disk, S1)
    m = st.lookup(LookupRequest(hs, alignment=ALIGN))
    assert_every_handle_aligned(m, ALIGN)
    assert m.usable_tokens == 128


def test_blocks_the_reader_does_not_need_never_stop_the_walk(st: CacheState, spec) -> None:
    """Item 5: a misaligned SWA block wholly before the window and a misaligned tail at an
    earlier resume point are not read by a reader resuming at 512."""
    hs = prompt_hashes(spec, N)
    for depth, col in ((0, "swa"), (1, "c4.tail")):
        (a,) = st.allocate(hs, [AllocRequest(depth, col)], S1)
        p = Params(tail_len=4) if col.endswith("tail") else Params()
        st.transition(a.handle.object_id,
                      Event.TAIL_DONE if col.endswith("tail") else Event.WRITE_DONE, p)
    commit_prefix(st, hs, S0)  # the rest, aligned
    m = st.lookup(LookupRequest(hs, alignment=ALIGN))
    assert m.usable_tokens == 512 and m.downgrades == ()
    assert_every_handle_aligned(m, ALIGN)
    short = st.lookup(LookupRequest(hs, resume_tokens=128, alignment=ALIGN))
    assert short.usable_tokens == 0 and Reason.MISALIGNED in reasons(short)  # 128 needs both


def test_disk_kv_and_indexer_synced_to_each_other_serve_together(st: CacheState,
                                                                   spec) -> None:
    """Items 3 and 8: both disk copies at one version; the memory KV is re-allocated (no
    version) or rewritten with other bytes. The pair of disk copies is served, loaded both."""
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(st, hs, S0)
    kv_disk, ix_disk = offload(st, ids[(7, "c4")]), offload(st, ids[(7, "idx")])
    st.evict(ids[(7, "c4")])  # its indexer goes with it
    (a,) = st.allocate(hs, [AllocRequest(7, "c4")], S0)  # re-allocated: ALLOCATED, no version
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512, m.downgrades
    assert {h.object_id for h in m.load} >= {kv_disk, ix_disk}
    st.transition(a.handle.object_id, Event.WRITE_DONE, Params(version=(1 << 62) + 99))
    m = st.lookup(LookupRequest(hs))  # memory KV of other bytes: the disk pair still serves
    assert m.usable_tokens == 512
    kv_h, ix_h = m.handles["c4"][7], m.handles["idx"][7]
    assert (kv_h.object_id, ix_h.object_id) == (kv_disk, ix_disk)


def test_an_indexer_is_never_served_beside_a_kv_of_another_version(st: CacheState,
                                                                   spec) -> None:
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(st, hs, S0)
    kv_disk = offload(st, ids[(7, "c4")])
    st.evict(ids[(7, "c4")])
    # a new KV of other bytes, and an indexer synced to it
    a, b = st.allocate(hs, [AllocRequest(7, "c4"), AllocRequest(7, "idx")], S0)
    v2 = st.transition(a.handle.object_id, Event.WRITE_DONE, Params(version=(1 << 62) + 5))
    st.transition(b.handle.object_id, Event.WRITE_DONE)
    st.transition(b.handle.object_id, Event.INDEXER_SYNC, Params(version=v2.version))
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512
    served_kv = st.objects[m.handles["c4"][7].object_id]
    served_ix = st.objects[m.handles["idx"][7].object_id]
    assert served_kv.version == served_ix.version == v2.version
    assert served_kv.object_id != kv_disk


def test_version_zero_is_refused_where_it_could_match(st: CacheState, spec) -> None:
    """Item 3: an unset proto field reads 0. An indexer confirmed "synced at 0" matched a
    re-allocated memory KV (version 0) and was served beside a disk KV of another version."""
    hs = prompt_hashes(spec, 2)
    ids = commit_prefix(st, hs, S0)
    with pytest.raises(UnsetVersion):
        st.transition(ids[(1, "idx")], Event.INDEXER_SYNC, Params(version=0))
    (a,) = st.allocate(prompt_hashes(spec, 1, seed=4), [AllocRequest(0, "c4")], S0)
    with pytest.raises(UnsetVersion):
        st.transition(a.handle.object_id, Event.WRITE_DONE, Params(version=0))
    inc = st.register_owner(ShardId("s2"), pools_for(st.layout, 8))
    for column, state in (("idx", State.INDEXER_SYNCED), ("c4", State.COMPRESSED_READY),
                          ("c4", State.ON_DISK)):
        report = ObjectReport(hs[0], None, 0, column, state, block=1, version=0)
        with pytest.raises(UnsetVersion):
            st.confirm(ShardId("s2"), [report], inc)


def test_an_swa_copy_in_flight_is_reported_as_such(st: CacheState, spec) -> None:
    """Item 11: the block's only copy is OFFLOADING."""
    hs = prompt_hashes(spec, N)
    ids = commit_prefix(st, hs, S0)
    st.begin_offload(ids[(7, "swa")], S0)
    st.evict(ids[(7, "swa")])
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 384
    assert Reason.DISK_INFLIGHT in reasons(m) and Reason.SWA_WINDOW_INCOMPLETE not in reasons(m)


def test_an_empty_lookup_is_refused_and_counts_nothing(st: CacheState) -> None:
    """Item 9: Allocate refused no hashes; Lookup answered OK and counted a miss."""
    before = st.stats()
    with pytest.raises(BadHash, match="at least one"):
        st.lookup(LookupRequest([]))
    assert st.stats() == before


def test_a_group_without_overlap_has_no_tail(st: CacheState, spec) -> None:
    """Item 4: c128's tail holds nothing at any resume point (multiples of 128): it is no
    column, is never allocated or required, and its eviction costs nothing."""
    names = [c.name for c in st.layout.columns]
    assert "c4.tail" in names and "c128.tail" not in names
    assert all(c.nbytes for c in st.layout.columns)
    tail = st.layout.columns[st.layout.by_name["c4.tail"]]
    assert tail.kind is Kind.TAIL and tail.nbytes == 4 * tail.group.element_bytes  # overlap
    hs = prompt_hashes(spec, N)
    commit_prefix(st, hs, S0)
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 512 and set(m.handles) == {"c4", "c128", "swa", "idx", "c4.tail"}


def test_a_misaligned_tail_at_the_resume_point_is_never_served(st: CacheState, spec) -> None:
    """The tail a reader resuming at 512 reads lives in s1: that resume point is refused, the
    one before it (its tail aligned) is taken."""
    hs = prompt_hashes(spec, N)
    (a,) = st.allocate(hs, [AllocRequest(7, "c4.tail")], S1)
    st.transition(a.handle.object_id, Event.TAIL_DONE, Params(tail_len=4))
    commit_prefix(st, hs, S0)
    m = st.lookup(LookupRequest(hs, alignment=ALIGN))
    assert m.usable_tokens == 384 and Reason.MISALIGNED in reasons(m)
    assert_every_handle_aligned(m, ALIGN)
    assert st.lookup(LookupRequest(hs)).usable_tokens == 512
