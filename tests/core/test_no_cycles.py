"""The service turns automatic garbage collection off (``server/gcpolicy.py``): that is sound
only because the core frees everything it drops by reference counting. This churns a state
view through every path that creates and drops records, entries, memos, walk segments, disk
copies, leases, captures and owner incarnations, with collection off, and then asks the
collector what it would have had to find: nothing.
"""

from __future__ import annotations

import contextlib
import gc
import random
from collections.abc import Iterator

import pytest

from hkv_service.core.api import Handle, LookupRequest, StateConfig
from hkv_service.core.errors import HkvError
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes, question

OWNERS = (ShardId("s0"), ShardId("s1"))


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    yield
    gc.set_debug(0)
    if was:
        gc.enable()


def _churn(st: CacheState, steps: int, seed: int) -> None:
    rng = random.Random(seed)
    docs = [prompt_hashes(st.spec, 40, seed=i) for i in range(24)]
    for step in range(steps):
        doc = docs[rng.randrange(len(docs))]
        ids: dict[tuple[int, str], int] = {}
        with contextlib.suppress(HkvError):  # pool pressure
            ids = commit_prefix(st, doc[: rng.randrange(4, 40)], owner=rng.choice(OWNERS))
        handles: list[Handle] = []
        for k in range(3):  # new questions over the document: walks, memos, segments
            m = st.lookup(LookupRequest(question(doc, step * 3 + k, 3),
                                        lease_ttl_s=rng.choice([0.0, 5.0])))
            handles = [h for hs in m.handles.values() for h in hs]
            if m.lease_id is not None and rng.random() < 0.5:
                st.release_lease(m.lease_id)
        _disk_and_captures(st, rng, list(ids.values()), handles)
        if rng.random() < 0.03:
            owner = rng.choice(OWNERS)
            st.register_owner(owner, pools_for(st.layout, 400))  # lost, back empty
            if rng.random() < 0.5:
                st.reap_all()


def _disk_and_captures(st: CacheState, rng: random.Random, ids: list[int],
                       handles: list[Handle]) -> None:
    if handles and rng.random() < 0.3:
        with contextlib.suppress(HkvError):  # stale by now
            cap, _ = st.register_capture(handles[:4])
            if rng.random() < 0.5:
                st.release_capture(cap)
    if not ids:
        return
    rec = st.objects.get(rng.choice(ids))
    if rec is None or rec.state is not State.COMPRESSED_READY:
        return
    with contextlib.suppress(HkvError):
        d = st.begin_offload(rec.object_id, rng.choice(OWNERS))
        st.transition(d.object_id, Event.OFFLOAD_COMMITTED)
        st.evict(rec.object_id)
        t = st.begin_load(d.object_id)
        st.transition(t.object_id, rng.choice([Event.LOAD_VERIFIED, Event.LOAD_FAILED]))


@pytest.mark.usefixtures("collector_off")
def test_the_core_leaves_no_garbage_cycles() -> None:
    st = CacheState(default_spec(), StateConfig(memo_capacity=8))
    for owner in OWNERS:
        st.register_owner(owner, pools_for(st.layout, 400))
    _churn(st, 300, seed=0)
    assert st.counters.events["owner_lost"] > 0  # the churn reached every path it means to
    assert st.stats()["gauges"]["objects"]  # type: ignore[index]
    gc.set_debug(gc.DEBUG_SAVEALL)
    found = gc.collect()
    kinds = sorted({type(o).__name__ for o in gc.garbage})
    gc.garbage.clear()
    assert found == 0, f"garbage cycles of {kinds}"
