"""The admission cap at the state level, for loads from disk (reliability row 12).

``tests/core/test_admission.py`` drives the gate alone and ``test_state_view.py`` the offload
side; here a burst of ``CacheState.begin_load`` calls, ten times the cap, runs against one view.
"""

from __future__ import annotations

import threading

import pytest

from hkv_service.core.api import AdmissionCap, Handle, StateConfig
from hkv_service.core.errors import AdmissionRefused, PoolExhausted, ResourceExhausted
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0 = ShardId("s0")
CAP = 3
BURST = 10 * CAP
C4_BYTES = 2048  # nbytes of the reference spec's c4 column


def _on_disk(spec: CacheSpec, clock: object, cap: AdmissionCap, n: int) -> tuple[CacheState,
                                                                                 list[ObjectId]]:
    """A view holding ``n`` c4 objects at rest on disk (ON_DISK), their memory copies evicted."""
    st = CacheState(spec, StateConfig(admission=cap), clock=clock)  # type: ignore[arg-type]
    st.register_owner(S0, pools_for(st.layout, 64))
    ids = commit_prefix(st, prompt_hashes(spec, n, seed=3))
    disk: list[ObjectId] = []
    for first in range(0, n, CAP):  # offload in waves the cap admits
        wave = [st.begin_offload(ids[(d, "c4")], S0) for d in range(first, min(first + CAP, n))]
        for h in wave:
            st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
        disk += [h.object_id for h in wave]
    for d in range(n):
        st.evict(ids[(d, "c4")])
    assert all(st.objects[oid].state is State.ON_DISK for oid in disk)
    assert st.admission.stats().in_transit_objects == 0
    return st, disk


def _burst(st: CacheState, oids: list[ObjectId]) -> tuple[list[Handle], list[BaseException]]:
    """Every ``begin_load`` at once, from one thread each, released together."""
    admitted: list[Handle] = []
    refused: list[BaseException] = []
    start = threading.Barrier(len(oids))

    def load(oid: ObjectId) -> None:
        start.wait()
        try:
            admitted.append(st.begin_load(oid, S0))
        except BaseException as exc:  # sorted out by the caller
            refused.append(exc)

    threads = [threading.Thread(target=load, args=(oid,)) for oid in oids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return admitted, refused


def _free_c4(st: CacheState) -> int:
    return st.owners[S0].pools[st.layout.by_name["c4"]].free_count()


@pytest.mark.parametrize(
    "cap",
    [AdmissionCap(max_objects=CAP), AdmissionCap(max_objects=1000, max_bytes=CAP * C4_BYTES)],
    ids=["object_cap", "byte_cap"],
)
def test_load_burst_admits_exactly_cap_and_refusals_change_nothing(
    spec: CacheSpec, clock: object, cap: AdmissionCap
) -> None:
    st, disk = _on_disk(spec, clock, cap, BURST)
    free_before = _free_c4(st)
    admitted, refused = _burst(st, disk)

    assert len(admitted) == CAP and len(refused) == BURST - CAP
    for exc in refused:
        assert isinstance(exc, AdmissionRefused) and isinstance(exc, ResourceExhausted)
        assert exc.retry_after_s > 0 and "retry" in str(exc)
    loading = {h.object_id for h in admitted}
    inflight = [r for r in st.objects.values() if r.state is State.ON_DISK_INFLIGHT]
    assert {r.object_id for r in inflight} == loading
    for oid in set(disk) - loading:  # refused: still at rest, no block reserved
        rec = st.objects[oid]
        assert rec.state is State.ON_DISK and rec.block == -1 and rec.seq == 1
    assert _free_c4(st) == free_before - CAP  # only the admitted loads took memory blocks
    gauges = st.stats()["gauges"]
    assert isinstance(gauges, dict)
    assert gauges["in_transit_objects"] == CAP and gauges["in_transit_on_disk_inflight"] == CAP
    assert gauges["in_transit_bytes"] == CAP * C4_BYTES
    assert gauges["admission_refused"] == BURST - CAP

    verified, failed, corrupt = admitted
    st.transition(verified.object_id, Event.LOAD_VERIFIED)
    st.transition(failed.object_id, Event.LOAD_FAILED)
    st.transition(corrupt.object_id, Event.MARK_CORRUPT)  # terminal: detached
    adm = st.admission.stats()
    assert (adm.in_transit_objects, adm.in_transit_bytes) == (0, 0)
    assert adm.peak_objects == CAP and adm.peak_bytes == CAP * C4_BYTES
    assert st.objects[verified.object_id].state is State.ON_DISK_READY
    assert st.objects[failed.object_id].state is State.ON_DISK
    assert corrupt.object_id not in st.objects
    assert _free_c4(st) == free_before - 1  # the failed and corrupt loads gave blocks back


def test_refused_loads_are_admitted_on_retry_once_the_cap_drains(
    spec: CacheSpec, clock: object
) -> None:
    st, disk = _on_disk(spec, clock, AdmissionCap(max_objects=CAP), BURST)
    first, refused = _burst(st, disk)
    assert len(first) == CAP and len(refused) == BURST - CAP
    for h in first:
        st.transition(h.object_id, Event.LOAD_VERIFIED)
    waiting = [oid for oid in disk if oid not in {h.object_id for h in first}]
    done = 0
    while waiting:  # the retry the hint asks for: each wave admits exactly the cap
        admitted, refused = _burst(st, waiting)
        assert len(admitted) == min(CAP, len(waiting))
        assert all(isinstance(e, AdmissionRefused) for e in refused)
        for i, h in enumerate(admitted):
            st.transition(h.object_id, Event.LOAD_FAILED if i % 2 else Event.LOAD_VERIFIED)
        done += len(admitted)
        waiting = [oid for oid in waiting if oid not in {h.object_id for h in admitted}]
    assert done == BURST - CAP
    adm = st.admission.stats()
    assert (adm.in_transit_objects, adm.in_transit_bytes, adm.peak_objects) == (0, 0, CAP)
    states = [st.objects[oid].state for oid in disk]
    assert set(states) <= {State.ON_DISK_READY, State.ON_DISK}
    assert State.ON_DISK_INFLIGHT not in states


def test_load_refused_for_want_of_a_block_returns_its_ticket(
    spec: CacheSpec, clock: object
) -> None:
    """A load admitted by the cap but with no memory block to land in gives the ticket back."""
    st, disk = _on_disk(spec, clock, AdmissionCap(max_objects=CAP), 2)
    small = ShardId("small")
    st.register_owner(small, pools_for(st.layout, 1))  # one c4 block
    st.begin_load(disk[0], small)
    with pytest.raises(PoolExhausted):
        st.begin_load(disk[1], small)  # the only block is being loaded into: not evictable
    rec = st.objects[disk[1]]
    assert rec.state is State.ON_DISK and rec.block == -1
    assert st.admission.stats().in_transit_objects == 1  # only the load that is running
