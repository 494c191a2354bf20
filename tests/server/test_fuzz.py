"""Fuzzing: random bytes to every method, and random field values for Lookup / Allocate /
Transition. Only proper status codes come back, the server keeps serving, and a rejected
request leaves the state unchanged.

Random bytes are judged by whether they parse as the method's request message: bytes that do
not parse get INVALID_ARGUMENT (every method parses its request's bytes itself, see
``app._decoding``), bytes that parse get OK or a domain status. No call may end on its
deadline (that would be a hang), except Watch, a long poll whose deadline is its normal end:
it must first have sent exactly the events past ``from_seq``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from svc_util import Live, commit_remote, hashes, register, start_live

from hkv_service.client import MetadataClient
from hkv_service.core.api import LookupRequest
from hkv_service.core.ids import BlockHash
from hkv_service.core.state_view import CacheState
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.specs import default_spec

SERVICE = pb.DESCRIPTOR.services_by_name["MetadataService"]
METHODS = [m.name for m in SERVICE.methods]
REQUEST: dict[str, type[Message]] = {m.name: getattr(pb, m.input_type.name)
                                     for m in SERVICE.methods}
RESPONSE: dict[str, type[Message]] = {m.name: getattr(pb, m.output_type.name)
                                      for m in SERVICE.methods}
PURE = {"GetSpec", "Stats", "CaptureStatus", "CheckRead", "Watch"}  # never change state
C = grpc.StatusCode
PROPER = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.RESOURCE_EXHAUSTED}
PROPER_NUMBERS = {c.value[0] for c in PROPER}
CALL_S = 10.0  # generous: a call that runs into it hung, and fails the test
WATCH_S = 0.3  # Watch's long poll: its deadline is how it ends
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass
class Fuzz:
    live: Live
    client: MetadataClient
    ch: grpc.Channel
    hashes: list[BlockHash] = field(default_factory=list)
    undecodable_sent: int = 0  # calls whose bytes parse as no request of their method
    undecodable_lines: list[str] = field(default_factory=list)  # the server's log lines


class _Lines(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        if "undecodable request" in record.getMessage():
            self.into.append(record.getMessage())


@pytest.fixture(scope="module")
def fuzz_live() -> Iterator[Fuzz]:
    # A frozen clock: leases taken by fuzzed lookups never expire in the middle of an example
    # (their reaping is housekeeping, not a change made by the request under test).
    lv = start_live(state=CacheState(default_spec(), clock=lambda: 1000.0))
    client = MetadataClient(lv.endpoint, timeout_s=CALL_S)
    register(client)
    hs = hashes(4)
    commit_remote(client, hs)
    ch = grpc.insecure_channel(lv.endpoint)
    fz = Fuzz(lv, client, ch, list(hs))
    lines = _Lines(fz.undecodable_lines)
    logging.getLogger("hkv_service.server.servicer").addHandler(lines)
    yield fz
    logging.getLogger("hkv_service.server.servicer").removeHandler(lines)
    ch.close()
    client.close()
    lv.service.stop(0).wait()


def _snapshot(fz: Fuzz) -> dict[str, object]:
    """Stats over the wire (less the counters of refused reads and undecodable requests:
    counting those is their point) plus what Stats only counts: every object's state, the
    owners, the last logged event."""
    stats = fz.client.stats()
    events = dict(stats["events"])  # type: ignore[call-overload]
    events.pop("stale_read", None)
    events.pop("undecodable_request", None)
    state = fz.live.state
    objects = sorted((r.object_id, r.state.value, r.shard, r.block, r.generation, r.seq)
                     for r in state.objects.values())
    owners = {k: (o.incarnation, o.alive) for k, o in state.owners.items()}
    last_seq = state.log[-1].seq if state.log else 0
    return {**stats, "events": events, "objects": objects, "owners": owners,
            "last_seq": last_seq}


def _prefix(fz: Fuzz) -> tuple[int, dict[str, Any]]:
    m = fz.client.lookup(LookupRequest(fz.hashes))
    return m.usable_tokens, {k: tuple(v) for k, v in m.handles.items()}


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    replies: list[bytes]


def _call_raw(ch: grpc.Channel, method: str, payload: bytes) -> Outcome:
    path = f"/hkv.v1.MetadataService/{method}"
    replies: list[bytes] = []
    try:
        if method == "LookupStream":
            replies.extend(ch.stream_stream(path)(iter([payload]), timeout=CALL_S))
        elif method == "Watch":
            replies.extend(ch.unary_stream(path)(payload, timeout=WATCH_S))
        else:
            replies.append(ch.unary_unary(path)(payload, timeout=CALL_S))
    except grpc.RpcError as err:
        call: Any = err
        return Outcome(call.code(), call.details() or "", replies)
    return Outcome(C.OK, "", replies)


def _decoded(method: str, payload: bytes) -> Message | None:
    try:
        return REQUEST[method].FromString(payload)
    except DecodeError:
        return None


def _check_watch(fz: Fuzz, request: Any, out: Outcome) -> None:
    assert out.code in (C.DEADLINE_EXCEEDED, C.OK), (out.code, out.details)
    log = fz.live.state.log
    first, last = (log[0].seq, log[-1].seq) if log else (1, 0)
    got = [e.seq for r in out.replies for e in pb.WatchResponse.FromString(r).events]
    assert got == list(range(max(request.from_seq + 1, first), last + 1)), request


def _item_errors(method: str, replies: list[bytes]) -> list[Any] | None:
    """Per-item errors of the calls that report them in an OK reply (None for others)."""
    if method in ("Transition", "TransitionMany"):
        return [o.error for r in replies for o in RESPONSE[method].FromString(r).outcomes
                if o.HasField("error")] if replies else None
    if method == "LookupStream":
        heads = [pb.LookupStreamResponse.FromString(r) for r in replies]
        return [h.error for h in heads if h.HasField("error")]
    return None


def _judge(fz: Fuzz, method: str, payload: bytes, out: Outcome) -> bool:
    """Check the status against the payload; True when the request was rejected."""
    request = _decoded(method, payload)
    if request is None:
        assert out.code is C.INVALID_ARGUMENT and not out.replies, (method, out.code, out.details)
        assert "cannot decode" in (out.details or ""), (method, out.details)
        return True
    if method == "Watch":
        _check_watch(fz, request, out)
        return False
    assert out.code is C.OK or out.code in PROPER, (method, out.code, out.details)
    if out.code is not C.OK:
        return True
    for r in out.replies:
        RESPONSE[method].FromString(r)  # a well-formed reply of the method's type
    errors = _item_errors(method, out.replies)
    if errors is None:
        return False
    assert {e.code for e in errors} <= PROPER_NUMBERS, (method, errors)
    items = len(REQUEST[method].FromString(payload).items) \
        if method in ("Transition", "TransitionMany") else len(out.replies)
    return len(errors) == items  # every item refused: nothing may have changed


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out) + bytes([n])


def _wire_field() -> st.SearchStrategy[bytes]:
    """One protobuf field of number 1-8: a varint, or length-delimited random bytes."""
    num = st.integers(1, 8)
    varint = st.builds(lambda f, v: _varint(f << 3) + _varint(v), num, st.integers(0, 2**64 - 1))
    delimited = st.builds(lambda f, v: _varint(f << 3 | 2) + _varint(len(v)) + v,
                          num, st.binary(max_size=24))
    return st.one_of(varint, delimited)


# Plain random bytes seldom parse; protobuf-shaped ones mostly do (with wrong types, bad
# UTF-8, garbage submessages), so both branches are drawn often.
payloads = st.one_of(st.binary(max_size=256), st.lists(_wire_field(), max_size=4).map(b"".join))


@FUZZ
@given(method=st.sampled_from(METHODS), payload=payloads)
def test_random_bytes_get_their_status_and_rejects_change_nothing(
        fuzz_live: Fuzz, method: str, payload: bytes) -> None:
    _send(fuzz_live, method, payload)


def _send(fz: Fuzz, method: str, payload: bytes) -> Outcome:
    """Send, judge the status, and compare the state around a rejected (or pure) call."""
    prefix = _prefix(fz)
    before = _snapshot(fz)
    out = _call_raw(fz.ch, method, payload)
    fz.undecodable_sent += _decoded(method, payload) is None
    rejected = _judge(fz, method, payload, out)
    if rejected or method in PURE:
        assert _snapshot(fz) == before, (method, out.code)
        assert _prefix(fz) == prefix  # the committed prefix still hits, same handles
    assert "gauges" in fz.client.stats()  # still serving
    return out


UNDECODABLE = b"\xff" * 11  # a varint tag longer than 10 bytes: no message parses it


@pytest.mark.parametrize("method", METHODS)
def test_every_method_both_ways(fuzz_live: Fuzz, method: str) -> None:
    """Both branches for every method, whatever hypothesis draws: bytes that do not parse
    (INVALID_ARGUMENT, state unchanged) and the empty message, which always parses."""
    assert _decoded(method, UNDECODABLE) is None and _decoded(method, b"") is not None
    assert _send(fuzz_live, method, UNDECODABLE).code is C.INVALID_ARGUMENT
    empty = _send(fuzz_live, method, b"")
    assert "cannot decode" not in (empty.details or ""), (method, empty.code, empty.details)


def test_watch_sends_the_events_past_from_seq(fuzz_live: Fuzz) -> None:
    fz = fuzz_live
    last = fz.live.state.log[-1].seq
    assert last > 2
    for from_seq in (0, last - 2, last, last + 5):
        request = pb.WatchRequest(from_seq=from_seq, max_batch=1)
        _check_watch(fz, request, _call_raw(fz.ch, "Watch", request.SerializeToString()))


@pytest.mark.parametrize("from_seq", [sys.maxsize - 1000, sys.maxsize, 2**64 - 1])
def test_watch_from_the_largest_seqs(fuzz_live: Fuzz, from_seq: int) -> None:
    request = pb.WatchRequest(from_seq=from_seq)
    _check_watch(fuzz_live, request, _call_raw(fuzz_live.ch, "Watch",
                                               request.SerializeToString()))


hash_st = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))


def _hashes_st(real: Sequence[bytes]) -> st.SearchStrategy[list[bytes]]:
    return st.one_of(st.lists(hash_st, max_size=6), st.just(real),
                     st.lists(st.sampled_from(real), max_size=6))


def _check(fz: Fuzz, call: Any, mutating: bool) -> None:
    before = _snapshot(fz)
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())
        assert _snapshot(fz) == before
    else:
        if not mutating:
            assert _sans_lookup_counts(_snapshot(fz)) == _sans_lookup_counts(before)


def _sans_lookup_counts(snap: dict[str, object]) -> dict[str, object]:
    """A lookup that answers counts itself (lookups, downgrades); nothing else may move."""
    return {k: v for k, v in snap.items() if k not in ("lookups", "downgrades")}


@FUZZ
@given(data=st.data())
def test_lookup_fields(fuzz_live: Fuzz, data: st.DataObject) -> None:
    ch, real = fuzz_live.ch, fuzz_live.hashes
    msg = pb.LookupRequest(
        block_hashes=data.draw(_hashes_st(real)),
        reader_abi=data.draw(st.dictionaries(st.sampled_from(["c4", "swa", "zz", "c4.tail"]),
                                             st.integers(0, 2**64 - 1), max_size=2)),
        alignment=data.draw(st.integers(0, 2**20)),
        lease_ttl_s=data.draw(st.one_of(st.just(0.0), st.floats(allow_nan=True))),
    )
    if data.draw(st.booleans()):
        msg.resume_tokens = data.draw(st.integers(0, 2**64 - 1))
    packing = data.draw(st.sampled_from(["listed", "packed", "both"]))
    if packing != "listed":  # the same hashes as one field (any length: n*16 or not)
        msg.packed_hashes = b"".join(msg.block_hashes) or data.draw(st.binary(max_size=40))
        if packing == "packed":
            del msg.block_hashes[:]
    stub = ch.unary_unary("/hkv.v1.MetadataService/Lookup",
                          request_serializer=pb.LookupBatchRequest.SerializeToString,
                          response_deserializer=pb.LookupBatchResponse.FromString)
    leased = msg.lease_ttl_s > 0
    _check(fuzz_live, lambda: stub(pb.LookupBatchRequest(requests=[msg]), timeout=5), leased)


@FUZZ
@given(data=st.data())
def test_allocate_fields(fuzz_live: Fuzz, data: st.DataObject) -> None:
    ch, real = fuzz_live.ch, fuzz_live.hashes
    slots = data.draw(st.lists(st.builds(
        pb.AllocSlot, depth=st.integers(0, 8),
        column=st.sampled_from(["c4", "c128", "swa", "idx", "c4.tail", "nope", ""])),
        max_size=4))
    msg = pb.AllocateRequest(block_hashes=data.draw(_hashes_st(real)), slots=slots,
                             owner=data.draw(st.sampled_from(["", "s0", "ghost"])))
    stub = ch.unary_unary("/hkv.v1.MetadataService/Allocate",
                          request_serializer=pb.AllocateRequest.SerializeToString,
                          response_deserializer=pb.AllocateResponse.FromString)
    _check(fuzz_live, lambda: stub(msg, timeout=5), True)


@FUZZ
@given(data=st.data())
def test_transition_fields(fuzz_live: Fuzz, data: st.DataObject) -> None:
    ch = fuzz_live.ch
    item = pb.TransitionItem(object_id=data.draw(st.integers(0, 2**64 - 1)),
                             event=data.draw(st.integers(0, 20)))  # type: ignore[arg-type]
    for f in ("lo", "hi", "tail_len"):
        if data.draw(st.booleans()):
            setattr(item, f, data.draw(st.integers(-(2**63), 2**63 - 1)))
    for f in ("version", "expect_seq", "generation"):
        if data.draw(st.booleans()):
            setattr(item, f, data.draw(st.integers(0, 2**64 - 1)))
    stub = ch.unary_unary("/hkv.v1.MetadataService/Transition",
                          request_serializer=pb.TransitionRequest.SerializeToString,
                          response_deserializer=pb.TransitionResponse.FromString)
    _check(fuzz_live, lambda: stub(pb.TransitionRequest(items=[item]), timeout=5), True)


@FUZZ
@given(data=st.data())
def test_transition_many_fields(fuzz_live: Fuzz, data: st.DataObject) -> None:
    """Random items of random steps on the committed objects (and unknown ones): a call
    whose items are all refused changes nothing (all or none per object)."""
    ids = sorted(r.object_id for r in fuzz_live.live.state.objects.values())[:6]
    items = []
    for _ in range(data.draw(st.integers(1, 3))):
        item = pb.ObjectTransitions(object_id=data.draw(st.sampled_from([*ids, 10**9])))
        for _ in range(data.draw(st.integers(0, 3))):
            step = item.steps.add(event=data.draw(st.integers(0, 17)))  # type: ignore[arg-type]
            for f in ("lo", "hi", "tail_len"):
                if data.draw(st.booleans()):
                    setattr(step, f, data.draw(st.integers(-2, 200)))
            if data.draw(st.booleans()):
                step.version = data.draw(st.integers(0, 3))
        if data.draw(st.booleans()):
            item.generation = data.draw(st.integers(0, 2))
        items.append(item)
    payload = pb.TransitionManyRequest(items=items).SerializeToString()
    _send(fuzz_live, "TransitionMany", payload)


def test_undecodable_calls_are_all_counted_and_logged_once_per_interval(fuzz_live: Fuzz) -> None:
    """Issue 35, item 8: 2,700 fuzzed calls wrote 909 WARNING lines. Every undecodable call
    this module sent (the fuzz above, and a burst to every method here) is counted in Stats;
    the service's clock stands still here, so one interval: one line for them all."""
    fz = fuzz_live
    for _ in range(5):
        for method in METHODS:
            assert _send(fz, method, UNDECODABLE).code is C.INVALID_ARGUMENT
    events = fz.client.stats()["events"]
    assert events["undecodable_request"] == fz.undecodable_sent >= 5 * len(METHODS)  # type: ignore[index]
    assert len(fz.undecodable_lines) == 1, fz.undecodable_lines
