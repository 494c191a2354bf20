"""The router's answer per tier (core/resumable.py, issue 39): memory alone vs with disk
loads, and the reason it stops."""

from __future__ import annotations

from hkv_service.core.api import LookupRequest
from hkv_service.core.ids import ShardId
from hkv_service.core.resumable import Stop, resumable
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Reason
from hkv_service.testing import commit_prefix, prompt_hashes

S0, D0 = ShardId("s0"), ShardId("d0")


def test_memory_tier_stops_where_a_load_is_needed(state: CacheState, spec: CacheSpec) -> None:
    state.register_owner(D0, {})
    hs = prompt_hashes(spec, 8)
    ids = commit_prefix(state, hs[:6], S0)
    whole = resumable(state.lookup, hs, state.layout)
    assert (whole.tokens, whole.memory_tokens, whole.stop) == (384, 384, Stop.NOT_CACHED)
    assert whole.lookups == 1
    for col in ("c4", "idx"):  # block 3's c4 and its indexer: on disk only
        h = state.begin_offload(ids[(3, col)], D0)
        state.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    state.evict(ids[(3, "c4")])
    r = resumable(state.lookup, hs, state.layout)
    assert r.tokens == 384 == state.lookup(LookupRequest(hs, handles=False)).usable_tokens
    assert r.memory_tokens == 128 and r.memory_stop is Stop.NEEDS_LOAD  # block 3 is [192,256)
    assert r.lookups > 1


def test_the_stop_reason_is_the_funnels(state: CacheState, spec: CacheSpec) -> None:
    hs = prompt_hashes(spec, 4)
    commit_prefix(state, hs, S0, skip=frozenset({(3, "c4.tail")}))
    r = resumable(state.lookup, hs, state.layout)
    assert (r.tokens, r.stop, r.reason) == (128, Stop.DOWNGRADED, Reason.TAIL_INCOMPLETE)
    full = resumable(state.lookup, hs[:2], state.layout)
    assert (full.tokens, full.stop, full.reason) == (128, Stop.WHOLE_PROMPT, None)
