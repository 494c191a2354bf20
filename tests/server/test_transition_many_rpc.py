"""TransitionMany through both ports of one live service: ``LocalMetadata`` over its
``CacheState`` and ``MetadataClient`` over gRPC answer the same, item by item: each object's
events in order and all or none, a stale or unknown item refused alone, the refused move as
fields of the error (not a message to parse)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from svc_util import Live, hashes, register

from hkv_service.client import MetadataClient, TransitionItem
from hkv_service.core import errors as E
from hkv_service.core.api import AllocRequest, ObjectTransitions, Params, TransitionResult
from hkv_service.core.ids import ObjectId, ShardId
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Event, State
from hkv_service.testing import pools_for
from workers.local import LocalMetadata


@pytest.fixture(params=["local", "grpc"])
def port(request: pytest.FixtureRequest, live: Live, client: MetadataClient
         ) -> Iterator[MetadataPort]:
    register(client)
    yield LocalMetadata(live.state) if request.param == "local" else client


def allocate(port: MetadataPort, slots: list[AllocRequest], seed: int = 0,
             owner: str = "s0") -> dict[tuple[int, str], ObjectId]:
    allocs = port.allocate(hashes(2, seed), slots, ShardId(owner))
    return {(r.depth, r.column): a.handle.object_id for r, a in zip(slots, allocs, strict=True)}


def test_each_object_all_or_none_in_order(port: MetadataPort, live: Live) -> None:
    ids = allocate(port, [AllocRequest(0, "c4"), AllocRequest(1, "c4"), AllocRequest(1, "idx")])
    bad, kv, idx = ids[(0, "c4")], ids[(1, "c4")], ids[(1, "idx")]
    out = port.transition_many([
        ObjectTransitions(bad, (Event.WRITE_DONE, Event.TAIL_DONE)),  # its 2nd is illegal
        ObjectTransitions(kv, (Event.WRITE_DONE,), (Params(version=77),)),
        ObjectTransitions(idx, (Event.WRITE_DONE, Event.INDEXER_SYNC), (None, Params(version=77))),
    ])
    refused, written, synced = out
    assert isinstance(refused, E.IllegalTransition), refused
    assert (refused.state, refused.event, refused.index, refused.precondition) == (
        State.COMPRESSED_READY, Event.TAIL_DONE, 1, None)
    assert live.state.objects[bad].state is State.ALLOCATED and live.state.objects[bad].seq == 0
    assert written == TransitionResult(kv, State.COMPRESSED_READY, 77, 1)
    assert synced == TransitionResult(idx, State.INDEXER_SYNCED, 77, 2)


def test_a_precondition_refusal_says_so(port: MetadataPort, live: Live) -> None:
    ids = allocate(port, [AllocRequest(1, "c4.tail")])
    tail = ids[(1, "c4.tail")]
    [out] = port.transition_many([ObjectTransitions(
        tail, (Event.TAIL_APPEND, Event.TAIL_APPEND), (Params(tail_len=3), Params(tail_len=2)))])
    assert isinstance(out, E.IllegalTransition) and out.index == 1
    assert out.state is State.TAIL_PARTIAL and "grow" in (out.precondition or "")
    assert live.state.objects[tail].state is State.ALLOCATED


def test_stale_future_and_unknown_items_are_refused_alone(port: MetadataPort, client: Any,
                                                         live: Live) -> None:
    client.register_owner("tiny", pools_for(live.state.layout, 1))  # one block: reused below
    old = allocate(port, [AllocRequest(0, "c4")], seed=1, owner="tiny")[(0, "c4")]
    port.evict(old)
    [fresh] = port.allocate(hashes(1, seed=2), [AllocRequest(0, "c4")], ShardId("tiny"))
    oid, gen = fresh.handle.object_id, fresh.handle.generation
    assert gen >= 1
    before = (live.state.objects[oid].seq, len(live.state.log))
    stale, future, unknown, ok = port.transition_many([
        ObjectTransitions(oid, (Event.WRITE_DONE,), (), gen - 1),
        ObjectTransitions(oid, (Event.WRITE_DONE,), (), gen + 1),
        ObjectTransitions(ObjectId(10**9), (Event.WRITE_DONE,)),
        ObjectTransitions(oid, (Event.BEGIN_WRITE,), (), gen),
    ])
    assert isinstance(stale, E.StaleHandle) and isinstance(future, E.FutureGeneration)
    assert isinstance(unknown, E.UnknownObject)
    assert isinstance(ok, TransitionResult) and ok.state is State.WRITING
    assert (live.state.objects[oid].seq, len(live.state.log)) == (before[0] + 1, before[1] + 1)


def test_a_malformed_item_rejects_the_call(port: MetadataPort, live: Live) -> None:
    kv = allocate(port, [AllocRequest(0, "c4")])[(0, "c4")]
    with pytest.raises(E.InvalidInput, match="item 1: no"):
        port.transition_many([ObjectTransitions(kv, (Event.WRITE_DONE,)),
                              ObjectTransitions(kv, ())])
    assert live.state.objects[kv].state is State.ALLOCATED


def test_the_client_takes_single_event_items_too(client: MetadataClient) -> None:
    register(client)
    (a,) = client.allocate(hashes(1), [AllocRequest(0, "c4")])
    oid = a.handle.object_id
    begin, done = client.transition_many([TransitionItem(oid, Event.BEGIN_WRITE),
                                          ObjectTransitions(oid, (Event.WRITE_DONE,))])
    assert isinstance(begin, TransitionResult) and begin.state is State.WRITING
    assert isinstance(done, TransitionResult) and done.state is State.COMPRESSED_READY
    # the unary call carries the refused move too
    with pytest.raises(E.IllegalTransition) as info:
        client.transition(oid, Event.TAIL_DONE)
    assert (info.value.state, info.value.event) == (State.COMPRESSED_READY, Event.TAIL_DONE)


def _at_rest(port: MetadataPort, live: Live) -> ObjectId:
    """A DISK copy at rest (ON_DISK) of a written KV."""
    kv = allocate(port, [AllocRequest(0, "c4")], seed=9)[(0, "c4")]
    port.transition(kv, Event.WRITE_DONE, Params(version=5))
    disk = port.begin_offload(kv, ShardId("s0"))
    port.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    return disk.object_id


@pytest.mark.parametrize("event", [Event.LOAD_BEGIN, Event.OFFLOAD_BEGIN])
def test_an_event_only_the_core_causes_is_refused_when_reported(
        port: MetadataPort, live: Live, event: Event) -> None:
    """Regression (issue 35, item 3): a reported LOAD_BEGIN moved a copy at rest to
    ON_DISK_INFLIGHT with no block and no admission ticket; a later LOAD_VERIFIED left it
    ON_DISK_READY at block -1 and the summary raised AssertionError partway through a batch
    (INTERNAL over gRPC, the items before it applied). Only begin_load causes it."""
    disk = _at_rest(port, live)
    kv = allocate(port, [AllocRequest(1, "c4")], seed=9)[(1, "c4")]
    with pytest.raises(E.InvalidInput, match=event.value):
        port.transition(disk, event)
    with pytest.raises(E.InvalidInput, match=event.value):  # the whole batch, nothing applied
        port.transition_many([ObjectTransitions(kv, (Event.WRITE_DONE,)),
                              ObjectTransitions(disk, (event, Event.LOAD_VERIFIED))])
    assert live.state.objects[disk].state is State.ON_DISK
    assert live.state.objects[kv].state is State.ALLOCATED
    loaded = port.begin_load(disk)  # the core's own path still loads it
    assert loaded.block >= 0 and live.state.objects[disk].state is State.ON_DISK_INFLIGHT
