"""CacheState.transition_many: one lock, items in order, each object's events all or none.

The property test is the oracle: an item that succeeds leaves the view exactly as its events
reported one ``transition`` at a time do; an item that fails leaves it exactly as if it had
never been sent (the oracle rebuilds the view from the items that succeeded)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hkv_service.core.api import (
    AllocRequest,
    LookupRequest,
    ObjectTransitions,
    Params,
    TransitionResult,
)
from hkv_service.core.errors import (
    FutureGeneration,
    HkvError,
    IllegalTransition,
    InvalidInput,
    StaleHandle,
    UnknownObject,
    UnsetVersion,
)
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, State
from hkv_service.core.transitions import TABLE
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

S0 = ShardId("s0")
SLOTS = [AllocRequest(0, "c4"), AllocRequest(0, "swa"), AllocRequest(0, "idx"),
         AllocRequest(1, "c4"), AllocRequest(1, "c128"), AllocRequest(1, "idx"),
         AllocRequest(1, "c4.tail")]


class Clock:
    def __call__(self) -> float:
        return 1000.0


def fresh(spec: CacheSpec) -> tuple[CacheState, dict[tuple[int, str], ObjectId]]:
    """A view with one owner and ALLOCATED objects of every kind along two hash blocks."""
    state = CacheState(spec, clock=Clock())
    state.objects._serial = 1 << 10  # ids alike in every fresh view (the oracle compares)
    state.register_owner(S0, pools_for(state.layout, 8))
    allocs = state.allocate(prompt_hashes(spec, 2), SLOTS, S0)
    return state, {(r.depth, r.column): a.handle.object_id
                   for r, a in zip(SLOTS, allocs, strict=True)}


def view(state: CacheState) -> tuple[object, ...]:
    """Everything a transition may change, and the transition log."""
    objs = sorted((r.object_id, r.state, r.version, r.lo, r.hi, r.seq, r.block, r.generation)
                  for r in state.objects.values())
    log = [(e.seq, e.object_id, e.state) for e in state.log]
    return objs, log, state._tables.next_version, state.counters.snapshot()


def states(state: CacheState, ids: Sequence[ObjectId]) -> list[State]:
    return [state.objects[i].state for i in ids]


def test_an_object_whose_second_event_is_illegal_keeps_its_state(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    bad, good = ids[(0, "c4")], ids[(1, "c4")]
    seq_before = state.objects[bad].seq
    log_before = len(state.log)
    out = state.transition_many([
        ObjectTransitions(bad, (Event.WRITE_DONE, Event.TAIL_DONE)),  # TAIL_DONE: no such move
        ObjectTransitions(good, (Event.WRITE_DONE,)),
    ])
    err, res = out
    assert isinstance(err, IllegalTransition)
    # the refused move, as fields: the state the first event led to, and where it stopped
    assert (err.state, err.event, err.index, err.precondition) == (
        State.COMPRESSED_READY, Event.TAIL_DONE, 1, None)
    rec = state.objects[bad]
    assert rec.state is State.ALLOCATED and rec.seq == seq_before and rec.version == 0
    assert isinstance(res, TransitionResult) and res.state is State.COMPRESSED_READY
    assert [e.object_id for e in list(state.log)[log_before:]] == [good]  # nothing of `bad`


def test_events_apply_in_order_and_each_sees_the_one_before(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    kv, idx, tail = ids[(1, "c4")], ids[(1, "idx")], ids[(1, "c4.tail")]
    out = state.transition_many([
        ObjectTransitions(kv, (Event.WRITE_DONE,), (Params(version=77),)),
        # an item sees the items before it: the KV above is READY at version 77
        ObjectTransitions(idx, (Event.WRITE_DONE, Event.INDEXER_SYNC),
                          (None, Params(version=77))),
        ObjectTransitions(tail, (Event.TAIL_APPEND, Event.TAIL_APPEND, Event.TAIL_DONE),
                          (Params(tail_len=1), Params(tail_len=3), Params(tail_len=4))),
    ])
    assert [r.state for r in out if isinstance(r, TransitionResult)] == [
        State.COMPRESSED_READY, State.INDEXER_SYNCED, State.TAIL_COMPLETE]
    assert state.objects[idx].version == 77 and state.objects[tail].hi == 4
    assert out[1] == TransitionResult(idx, State.INDEXER_SYNCED, 77, 2)


def test_the_same_events_out_of_order_change_nothing(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    kv, idx, tail = ids[(1, "c4")], ids[(1, "idx")], ids[(1, "c4.tail")]
    state.transition(kv, Event.WRITE_DONE, Params(version=77))
    before = view(state)
    out = state.transition_many([
        ObjectTransitions(idx, (Event.INDEXER_SYNC, Event.WRITE_DONE),
                          (Params(version=77), None)),
        # a tail that shrinks at its second append: refused by a precondition, not the table
        ObjectTransitions(tail, (Event.TAIL_APPEND, Event.TAIL_APPEND),
                          (Params(tail_len=3), Params(tail_len=2))),
    ])
    sync, shrink = out
    assert isinstance(sync, IllegalTransition) and sync.index == 0
    assert sync.state is State.ALLOCATED and sync.precondition is None
    assert isinstance(shrink, IllegalTransition) and shrink.index == 1
    assert shrink.state is State.TAIL_PARTIAL and shrink.precondition  # the check's sentence
    assert view(state) == before


def test_stale_and_future_generations_are_refused_per_item(spec: CacheSpec) -> None:
    state = CacheState(spec, clock=Clock())
    state.register_owner(S0, pools_for(state.layout, 1))  # one block: the next object reuses it
    hs = prompt_hashes(spec, 1)
    [old] = state.allocate(hs, [AllocRequest(0, "c4")], S0)
    state.evict(old.handle.object_id)
    [new] = state.allocate(prompt_hashes(spec, 1, seed=1), [AllocRequest(0, "c4")], S0)
    oid, gen = new.handle.object_id, new.handle.generation
    assert gen == old.handle.generation + 1
    before = view(state)
    stale, future = state.transition_many([
        ObjectTransitions(oid, (Event.WRITE_DONE,), (), gen - 1),
        ObjectTransitions(oid, (Event.WRITE_DONE,), (), gen + 1),
    ])
    assert isinstance(stale, StaleHandle) and isinstance(future, FutureGeneration)
    assert view(state) == before
    [ok] = state.transition_many([ObjectTransitions(oid, (Event.WRITE_DONE,), (), gen)])
    assert isinstance(ok, TransitionResult) and ok.state is State.COMPRESSED_READY


def test_an_unknown_object_does_not_hide_the_others(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    gone, swa = ObjectId(10**9), ids[(0, "swa")]
    missing, res = state.transition_many([ObjectTransitions(gone, (Event.WRITE_DONE,)),
                                          ObjectTransitions(swa, (Event.WRITE_DONE,))])
    assert isinstance(missing, UnknownObject) and isinstance(res, TransitionResult)
    assert state.objects[swa].state is State.SWA_VALID


def test_a_version_issued_or_refused_like_transition(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    kv0, kv1 = ids[(0, "c4")], ids[(1, "c4")]
    unset, issued = state.transition_many([
        ObjectTransitions(kv0, (Event.BEGIN_WRITE, Event.WRITE_DONE),
                          (None, Params(version=0))),  # version 0 reads as unset
        ObjectTransitions(kv1, (Event.WRITE_DONE,)),
    ])
    assert isinstance(unset, UnsetVersion) and state.objects[kv0].state is State.ALLOCATED
    assert isinstance(issued, TransitionResult) and issued.version >= 1


def test_an_event_after_the_object_ended_is_unknown_object(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    kv = ids[(0, "c4")]
    [out] = state.transition_many([ObjectTransitions(kv, (Event.EVICT, Event.WRITE_DONE))])
    assert isinstance(out, UnknownObject) and state.objects[kv].state is State.ALLOCATED
    [ended] = state.transition_many([ObjectTransitions(kv, (Event.WRITE_DONE, Event.EVICT))])
    assert isinstance(ended, TransitionResult) and ended.state is State.EVICTED
    assert kv not in state.objects


def test_a_leased_object_is_refused_by_its_holds(spec: CacheSpec) -> None:
    """The rehearsal runs on a copy of the record; the holds it checks are the record's."""
    state = CacheState(spec, clock=Clock())
    state.register_owner(S0, pools_for(state.layout, 8))
    hs = prompt_hashes(spec, 2)
    ids = commit_prefix(state, hs)
    state.lookup(LookupRequest(hs, lease_ttl_s=5.0))
    before = view(state)
    evict_idx, evict = state.transition_many([
        ObjectTransitions(ids[(0, "idx")], (Event.EVICT,)),
        ObjectTransitions(ids[(0, "c4")], (Event.EVICT,)),
    ])
    for err in (evict_idx, evict):
        assert isinstance(err, IllegalTransition) and "leased" in (err.precondition or "")
    assert view(state) == before


@pytest.mark.parametrize(("item", "phrase"), [
    (ObjectTransitions(ObjectId(1), ()), "item 1: no events"),
    (ObjectTransitions(ObjectId(1), (Event.WRITE_DONE,), (None, None)), "2 params for 1 event"),
])
def test_a_malformed_item_rejects_the_whole_call(spec: CacheSpec, item: ObjectTransitions,
                                                 phrase: str) -> None:
    state, ids = fresh(spec)
    before = view(state)
    with pytest.raises(InvalidInput, match=phrase):
        state.transition_many([ObjectTransitions(ids[(0, "c4")], (Event.WRITE_DONE,)), item])
    assert view(state) == before


def test_a_call_too_large_to_hold_the_lock_for_is_refused(spec: CacheSpec,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from hkv_service.core import reports

    monkeypatch.setattr(reports, "MAX_TRANSITION_ITEMS", 2)
    state, ids = fresh(spec)
    before = view(state)
    with pytest.raises(InvalidInput, match=r"3 items .* at most 2 .* split the call"):
        state.transition_many([ObjectTransitions(oid, (Event.WRITE_DONE,))
                               for oid in list(ids.values())[:3]])
    assert view(state) == before


def test_plain_tuples_are_items(spec: CacheSpec) -> None:
    state, ids = fresh(spec)
    [res] = state.transition_many([(ids[(0, "c4")], [Event.WRITE_DONE], [], None)])
    assert isinstance(res, TransitionResult)


# ---- the oracle -------------------------------------------------------------------------

EVENTS = [Event.BEGIN_WRITE, Event.WRITE_DONE, Event.TAIL_APPEND, Event.TAIL_DONE,
          Event.INDEXER_SYNC, Event.EVICT, Event.MARK_CORRUPT, Event.LOSE]
params_st = st.one_of(
    st.none(),
    st.builds(Params, version=st.sampled_from([None, 0, 1, 2, 3]),
              lo=st.sampled_from([None, 0, 64, 70]), hi=st.sampled_from([None, 64, 100, 128]),
              tail_len=st.sampled_from([None, 1, 2, 4, 5])),
)
item_st = st.tuples(
    st.sampled_from([*range(len(SLOTS)), 99]),  # 99: no such object
    st.lists(st.tuples(st.sampled_from(EVENTS), params_st), min_size=1, max_size=4),
    st.sampled_from([None, None, 0, 1]),
)


def one_by_one(state: CacheState, item: ObjectTransitions) -> TransitionResult | HkvError:
    out: TransitionResult | HkvError = UnknownObject("no events")
    for event, params in zip(item.events, item.params, strict=True):
        try:
            out = state.transition(item.object_id, event, params, item.generation)
        except HkvError as err:
            return err
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.lists(item_st, min_size=1, max_size=6))
def test_each_item_is_its_events_one_by_one_or_nothing(spec: CacheSpec, raw: list) -> None:
    state, ids = fresh(spec)
    order = list(ids.values())
    items = [ObjectTransitions(order[i] if i < len(order) else ObjectId(10**6),
                               tuple(e for e, _ in evs), tuple(p for _, p in evs), gen)
             for i, evs, gen in raw]
    got = state.transition_many(items)
    applied: list[ObjectTransitions] = []
    for item, out in zip(items, got, strict=True):
        oracle, _ = fresh(spec)
        for done in applied:
            one_by_one(oracle, done)
        want = one_by_one(oracle, item)
        if isinstance(want, HkvError):
            assert type(out) is type(want), (item, out, want)
        else:
            assert out == want, item
            applied.append(item)
    oracle, _ = fresh(spec)
    for done in applied:
        one_by_one(oracle, done)
    assert view(state) == view(oracle)


# every event, those a disk copy takes four times as often (most objects here are copies)
ANY_EVENT = list(Event) + 3 * sorted({e for (_, e) in TABLE[Kind.DISK]})


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.lists(st.tuples(st.integers(0, 14), st.lists(
    st.tuples(st.sampled_from(ANY_EVENT), params_st), min_size=1, max_size=3)),
    min_size=1, max_size=6), rounds=st.integers(1, 3))
@example(raw=[(0, [(Event.LOAD_BEGIN, None), (Event.LOAD_VERIFIED, None)])], rounds=1)
def test_no_reported_batch_raises_anything_but_an_hkv_error(
        spec: CacheSpec, raw: list, rounds: int) -> None:
    """Whatever an owner reports, of any event, over memory objects and disk copies (at rest,
    loading, loaded) in any state: every item is applied or refused with an HkvError, a
    batch refused whole changes nothing, and the view still answers a lookup (issue 35,
    item 3: a reported LOAD_BEGIN made the summary raise AssertionError mid-batch)."""
    state, ids = fresh(spec)
    memory = list(ids.values())
    disks = []  # copies at rest (even) and loading (odd): half the objects reported on
    for oid in memory[:2] + memory[3:5]:
        state.transition(oid, Event.WRITE_DONE)
        disks.append(state.begin_offload(oid, S0).object_id)
        state.transition(disks[-1], Event.OFFLOAD_COMMITTED)
        if len(disks) % 2 == 0:
            state.begin_load(disks[-1])
        elif len(disks) == 1:
            state.evict(oid)  # the disk copy is the copy that serves
    order = disks + disks + memory
    for _ in range(rounds):
        items = [ObjectTransitions(order[i % len(order)], tuple(e for e, _ in evs),
                                   tuple(p for _, p in evs)) for i, evs in raw]
        before = view(state)
        try:
            got = state.transition_many(items)
        except InvalidInput:
            assert view(state) == before
            continue
        assert all(isinstance(r, TransitionResult | HkvError) for r in got)
    state.lookup(LookupRequest(prompt_hashes(spec, 2)))
