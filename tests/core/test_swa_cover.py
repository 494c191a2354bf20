"""An SWA block is served by whichever copy covers the window: memory, else the disk copy.

Regression (found by the stateful test): an SWA block swapped to disk and loaded back, then
rewritten in memory with a shorter range (a worker recomputing part of it), was judged on the
memory object alone. The whole loaded copy was ignored and the lookup stopped short
(SWA_WINDOW_INCOMPLETE), a needless miss. The handles must then point at the copy that covers
the window, or the reader would get the short one.
"""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, Params
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Reason, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0 = ShardId("s0")


@pytest.mark.parametrize("loaded", [True, False], ids=["loaded_copy", "copy_at_rest"])
def test_a_short_memory_rewrite_does_not_hide_a_whole_disk_copy(loaded: bool) -> None:
    st = CacheState(default_spec())
    st.register_owner(S0, pools_for(st.layout, 64))
    hs = prompt_hashes(st.spec, 2)
    ids = commit_prefix(st, hs, owner=S0)
    assert st.lookup(LookupRequest(hs)).usable_tokens == 128
    d = st.begin_offload(ids[(0, "swa")], S0)
    st.transition(d.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(ids[(0, "swa")])
    if loaded:
        mh = st.begin_load(d.object_id)
        st.transition(d.object_id, Event.LOAD_VERIFIED, None, mh.generation)
    # a worker rewrites the block in memory, only tokens [0, 63) of [0, 64)
    (a,) = st.allocate(hs[:1], [AllocRequest(0, "swa")], S0)
    st.transition(a.handle.object_id, Event.WRITE_DONE, Params(lo=0, hi=63))
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 128, m.downgrades
    assert all(dg.reason is not Reason.SWA_WINDOW_INCOMPLETE for dg in m.downgrades)
    served = [h for h in m.handles["swa"] if h.object_id in (d.object_id, a.handle.object_id)]
    assert [h.object_id for h in served] == [d.object_id]  # the copy that covers the window
    disk = st.objects[d.object_id]
    if loaded:
        assert disk.state is State.ON_DISK_READY and served[0].block == disk.block
        assert not m.load
    else:
        assert [h.object_id for h in m.load] == [d.object_id]  # load it, then read it
