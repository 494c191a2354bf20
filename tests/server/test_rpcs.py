"""Every RPC once through the typed client, against an in-process server on 127.0.0.1."""

from __future__ import annotations

import threading

import pytest
from svc_util import Live, commit_remote, hashes, register

from hkv_service.client import MetadataClient, TransitionItem
from hkv_service.core import errors as E
from hkv_service.core.api import (
    AllocRequest,
    LookupRequest,
    Match,
    ObjectReport,
    Params,
    TransitionEvent,
)
from hkv_service.core.ids import BlockHash, ObjectId
from hkv_service.core.states import Event, Kind, State
from hkv_service.specs import default_spec


def same(a: Match, b: Match) -> bool:
    fields = ("usable_tokens", "matched_tokens", "downgrades", "lease_id", "handles", "load")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def test_get_spec_round_trips(client: MetadataClient) -> None:
    assert client.get_spec() == default_spec()


def test_owner_lifecycle(client: MetadataClient) -> None:
    inc = register(client, "s0")
    client.heartbeat("s0", inc)
    with pytest.raises(E.UnknownOwner, match="not current"):
        client.heartbeat("s0", inc + 100)
    ids = commit_remote(client, hashes(4))
    assert client.mark_owner_lost("s0") == len(ids)
    assert client.lookup(LookupRequest(hashes(4))).usable_tokens == 0


def test_a_loss_report_with_stale_witnesses_is_ignored_over_the_wire(
        client: MetadataClient) -> None:
    register(client, "s0")
    ids = list(commit_remote(client, hashes(4)).values())
    inc = register(client, "s0")  # a restarted shard: the old incarnation ended with it
    assert client.mark_owner_lost("s0", ids[:2]) is None  # about the old one: ignored
    client.heartbeat("s0", inc)  # the successor is still current
    mine = list(commit_remote(client, hashes(4, seed=5)).values())
    assert client.mark_owner_lost("s0", mine[:1]) == len(mine)  # about it: declared
    with pytest.raises(E.UnknownOwner):
        client.heartbeat("s0", inc)


def test_allocate_is_idempotent_and_commit_makes_a_hit(client: MetadataClient) -> None:
    register(client)
    hs = hashes(8)
    commit_remote(client, hs)
    again = client.allocate(hs, [AllocRequest(0, "c4")])
    assert again[0].existing and again[0].state is State.COMPRESSED_READY
    m = client.lookup(LookupRequest(hs))
    assert m.usable_tokens == 8 * 64 and not m.downgrades
    assert len(m.handles["c4"]) == 8 and all(h.kind is Kind.COMPRESSED for h in m.handles["c4"])


def test_allocate_returns_an_existing_kvs_version(live: Live, client: MetadataClient) -> None:
    """Regression: AllocateResponse dropped the version of an existing COMPRESSED object, so
    a writer syncing an indexer to it over gRPC sent version 0 (refused as unset)."""
    register(client)
    hs = hashes(2)
    commit_remote(client, hs)
    (kv,) = client.allocate(hs, [AllocRequest(0, "c4")])
    assert kv.existing and kv.version == live.state.objects[kv.handle.object_id].version > 0


def test_match_equals_in_process_lookup(live: Live, client: MetadataClient) -> None:
    register(client)
    hs = hashes(16)
    commit_remote(client, hs)
    req = LookupRequest(hs, resume_tokens=640)
    assert same(client.lookup(req), live.state.lookup(req))


def test_match_only_lookup_answers_tokens_without_handles(
    live: Live, client: MetadataClient
) -> None:
    register(client)
    hs = hashes(16)
    commit_remote(client, hs)
    full = client.lookup(LookupRequest(hs, resume_tokens=640))
    only = client.lookup(LookupRequest(hs, resume_tokens=640, handles=False))
    assert full.handles and not only.handles and only.lease_id is None
    assert (only.usable_tokens, only.matched_tokens, only.downgrades) == (
        full.usable_tokens, full.matched_tokens, full.downgrades)


def test_transition_batch_reports_each_item(client: MetadataClient) -> None:
    register(client)
    (a,) = client.allocate(hashes(1), [AllocRequest(0, "c4")])
    oid = a.handle.object_id
    out = client.transition_many([
        TransitionItem(oid, Event.BEGIN_WRITE),
        TransitionItem(oid, Event.TAIL_DONE),  # illegal for COMPRESSED
        TransitionItem(ObjectId(999_999), Event.WRITE_DONE),  # unknown
        TransitionItem(oid, Event.WRITE_DONE),
    ])
    assert out[0].state is State.WRITING  # type: ignore[union-attr]
    assert isinstance(out[1], E.IllegalTransition) and "not allowed" in str(out[1])
    assert isinstance(out[2], E.UnknownObject)
    assert out[3].state is State.COMPRESSED_READY  # type: ignore[union-attr]


def test_lease_check_read_release(client: MetadataClient) -> None:
    register(client)
    hs = hashes(4)
    commit_remote(client, hs)
    m = client.lookup(LookupRequest(hs, lease_ttl_s=5.0))
    assert m.lease_id is not None
    h = m.handles["c4"][0]
    client.check_read(h, m.lease_id)
    client.release_lease(m.lease_id)
    with pytest.raises(E.LeaseExpired):
        client.check_read(h, m.lease_id)
    with pytest.raises(E.UnknownLease):
        client.release_lease(m.lease_id)


def test_admit_save_counts_offers_and_refuses_bad_input(client: MetadataClient) -> None:
    hs = hashes(6, seed=7)
    assert client.admit_save(hs, 2) == 0  # a first offer: nothing to save yet
    assert client.admit_save(hs[:4], 2) == 4
    assert client.admit_save(hs, 2) == 6
    with pytest.raises(E.InvalidInput):
        client.admit_save(hs, 0)
    with pytest.raises(E.InvalidInput):
        client.admit_save(hashes(3, seed=8), 256)
    with pytest.raises(E.BadHash):
        client.admit_save([*hashes(2, seed=9), BlockHash(b"x" * 15)], 2)
    assert client.admit_save(hashes(3, seed=8), 2) == 0  # the refused calls counted nothing


def test_evict_makes_handle_stale(client: MetadataClient) -> None:
    register(client)
    hs = hashes(4)
    commit_remote(client, hs)
    h = client.lookup(LookupRequest(hs)).handles["swa"][-1]
    client.evict(h.object_id)
    with pytest.raises(E.StaleHandle, match="stale, recompute"):
        client.check_read(h)


def test_offload_and_load(client: MetadataClient) -> None:
    register(client, "s0")
    register(client, "disk0")
    hs = hashes(2)
    ids = commit_remote(client, hs, "s0")
    src = ids[(1, "c128")]
    disk = client.begin_offload(src, "disk0")
    assert client.transition(disk.object_id, Event.OFFLOAD_COMMITTED).state is State.ON_DISK
    client.evict(ids[(1, "c128")])
    loaded = client.begin_load(disk.object_id, "s0")
    assert loaded.block >= 0
    r = client.transition(disk.object_id, Event.LOAD_VERIFIED)
    assert r.state is State.ON_DISK_READY
    with pytest.raises(E.IllegalTransition):
        client.begin_load(disk.object_id)


def test_captures(client: MetadataClient) -> None:
    register(client)
    hs = hashes(2)
    commit_remote(client, hs)
    m = client.lookup(LookupRequest(hs))
    cap, epoch = client.register_capture(m.handles["c4"])
    assert client.capture_status(cap) == (True, epoch)
    client.mark_owner_lost("s0")
    valid, new_epoch = client.capture_status(cap)
    assert not valid and new_epoch > epoch
    client.release_capture(cap)
    with pytest.raises(E.UnknownCapture):
        client.capture_status(cap)


def test_confirm_rebuilds_only_what_is_reported(client: MetadataClient) -> None:
    inc = register(client)
    hs = hashes(2)
    reports = [ObjectReport(hs[0], None, 0, "c4", State.COMPRESSED_READY, block=3, version=1)]
    assert client.confirm("s0", reports, inc) == 1
    assert client.confirm("s0", reports, inc) == 0  # already present
    assert client.lookup(LookupRequest(hs)).usable_tokens == 0  # other groups missing


def test_confirm_needs_the_current_incarnation(client: MetadataClient) -> None:
    """A confirm sent before its owner registered again vouches for dropped memory: refused
    (NOT_FOUND), as is one without an incarnation (INVALID_ARGUMENT); neither changes a thing."""
    stale = register(client)
    current = register(client)  # the owner came back (empty) meanwhile
    hs = hashes(2)
    reports = [ObjectReport(hs[0], None, 0, "c4", State.COMPRESSED_READY, block=3, version=1)]
    with pytest.raises(E.UnknownOwner, match=f"incarnation {stale} is not current"):
        client.confirm("s0", reports, stale)
    with pytest.raises(E.InvalidInput, match="needs the incarnation"):
        client.confirm("s0", reports, 0)
    assert client.confirm("s0", reports, current) == 1


def test_lookup_stream_and_batch(client: MetadataClient) -> None:
    register(client)
    hs = hashes(4)
    commit_remote(client, hs)
    batch = [LookupRequest(hs), LookupRequest(hashes(2, seed=9))]
    many = client.lookup_many(batch)
    assert [m.usable_tokens for m in many] == [256, 0]
    streamed = list(client.lookup_stream([batch, [LookupRequest([BlockHash(b"short")])], batch]))
    for got in (streamed[0], streamed[2]):
        assert isinstance(got, list) and all(same(a, b) for a, b in zip(got, many, strict=True))
    assert isinstance(streamed[1], E.BadHash)


def test_watch_streams_events_until_deadline(client: MetadataClient) -> None:
    register(client)
    got: list[TransitionEvent] = []

    def watch() -> None:
        got.extend(client.watch(0, timeout_s=1.5))

    t = threading.Thread(target=watch)
    t.start()
    commit_remote(client, hashes(2))
    t.join(5)
    assert not t.is_alive()
    assert [e.seq for e in got] == list(range(1, len(got) + 1)) and len(got) > 4
    assert {e.kind for e in got} >= {Kind.COMPRESSED, Kind.SWA}


def test_stats(client: MetadataClient) -> None:
    register(client)
    commit_remote(client, hashes(2))
    client.lookup(LookupRequest(hashes(2)))
    s = client.stats()
    assert s["lookups"] == {"hit": 1}
    assert s["gauges"]["objects"] > 0  # type: ignore[index]
    assert s["transitions"]["COMPRESSED:COMPRESSED_READY"] == 3  # type: ignore[index]


def test_params_reach_the_core(client: MetadataClient) -> None:
    register(client)
    (a,) = client.allocate(hashes(2), [AllocRequest(1, "swa")])
    r = client.transition(a.handle.object_id, Event.WRITE_DONE, Params(lo=70, hi=128))
    assert r.state is State.SWA_VALID and r.seq == 1
    with pytest.raises(E.VersionConflict):
        client.transition(a.handle.object_id, Event.WRITE_DONE, Params(lo=64, hi=128,
                                                                       expect_seq=0))
