"""Every error case: the status code, a key phrase of the message, the hkv-error class, and
for rejected requests an unchanged state (Stats before == after)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from svc_util import Live, commit_remote, hashes, register, start_live

from hkv_service.client import MetadataClient
from hkv_service.core import errors as E
from hkv_service.core.api import AdmissionCap, StateConfig
from hkv_service.core.ids import ObjectId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.proto_gen.hkv.v1 import hkv_pb2_grpc as pb_grpc
from hkv_service.specs import default_spec
from hkv_service.wire import status_map
from storage import errors as S

C = grpc.StatusCode
H16 = b"\x01" * 16


@dataclass
class Filled:
    hs: list[bytes]  # a committed 4-block prefix
    oid: int  # the COMPRESSED (c4) object at depth 0


@pytest.fixture
def filled(live: Live, client: MetadataClient) -> Filled:
    register(client)
    hs = hashes(4)
    ids = commit_remote(client, hs)
    return Filled(list(hs), ids[(0, "c4")])


def expect(stub_call: Callable[[], Any], code: grpc.StatusCode, phrase: str,
           cls: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub_call()
    err: Any = info.value
    assert err.code() is code, (err.code(), err.details())
    assert phrase in err.details(), err.details()
    md = dict(err.trailing_metadata() or ())
    if cls is not None:
        assert md.get("hkv-error") == cls
    return info.value


def state_of(client: MetadataClient) -> dict[str, object]:
    """Stats minus the stale-read counter (counting refused stale reads is the point of it)."""
    stats = client.stats()
    events = dict(stats["events"])  # type: ignore[call-overload]
    events.pop("stale_read", None)
    return {**stats, "events": events}


def lookup(**kw: Any) -> pb.LookupBatchRequest:
    return pb.LookupBatchRequest(requests=[pb.LookupRequest(**kw)])


CASES: list[tuple[str, str, Callable[[Filled], Any], grpc.StatusCode, str, str | None]] = [
    ("empty hash", "Lookup", lambda f: lookup(block_hashes=[b""]),
     C.INVALID_ARGUMENT, "16 bytes, got 0", "BadHash"),
    ("15-byte hash", "Lookup", lambda f: lookup(block_hashes=[b"x" * 15]),
     C.INVALID_ARGUMENT, "got 15", "BadHash"),
    ("17-byte hash", "Allocate",
     lambda f: pb.AllocateRequest(block_hashes=[b"x" * 17],
                                   slots=[pb.AllocSlot(depth=0, column="c4")]),
     C.INVALID_ARGUMENT, "got 17", "BadHash"),
    ("packed hashes not whole", "Lookup", lambda f: lookup(packed_hashes=b"x" * 33),
     C.INVALID_ARGUMENT, "lookup 0: packed block hashes must be a multiple of 16", "BadHash"),
    ("packed and listed hashes", "Lookup",
     lambda f: lookup(packed_hashes=b"".join(f.hs), block_hashes=f.hs),
     C.INVALID_ARGUMENT, "not both", "InvalidInput"),
    ("another block's hash", "Lookup", lambda f: lookup(block_hashes=f.hs[1:]),
     C.INVALID_ARGUMENT, "for block 0 is the hash of block 1", "MisplacedHash"),
    ("another block's hash in a batch", "Lookup",  # refused before the first is looked up
     lambda f: pb.LookupBatchRequest(requests=[
         pb.LookupRequest(block_hashes=f.hs, lease_ttl_s=5.0),
         pb.LookupRequest(block_hashes=f.hs[1:])]),
     C.INVALID_ARGUMENT, "lookup 1: the hash given for block 0 is the hash of block 1",
     "MisplacedHash"),
    ("position beyond hashes", "Lookup", lambda f: lookup(block_hashes=f.hs, resume_tokens=10**6),
     C.INVALID_ARGUMENT, "outside the 256 tokens", "PositionBeyondHashes"),
    ("ABI for a group the spec lacks", "Lookup",
     lambda f: lookup(block_hashes=f.hs, reader_abi={"nope": 1}),
     C.INVALID_ARGUMENT, "lacks", "UnknownGroup"),
    ("alignment not a power of two", "Lookup", lambda f: lookup(block_hashes=f.hs, alignment=3),
     C.INVALID_ARGUMENT, "power of two", None),
    ("negative lease ttl", "Lookup", lambda f: lookup(block_hashes=f.hs, lease_ttl_s=-1.0),
     C.INVALID_ARGUMENT, "lease_ttl_s", "InvalidInput"),
    ("lease on a match-only lookup", "Lookup",
     lambda f: lookup(block_hashes=f.hs, lease_ttl_s=5.0, match_only=True),
     C.INVALID_ARGUMENT, "ask for handles or drop the lease", "InvalidInput"),
    ("lease ttl over max", "Lookup", lambda f: lookup(block_hashes=f.hs, lease_ttl_s=1e9),
     C.INVALID_ARGUMENT, "exceeds the maximum", "InvalidInput"),
    ("unknown group", "Allocate",
     lambda f: pb.AllocateRequest(block_hashes=f.hs, slots=[pb.AllocSlot(depth=0, column="zz")]),
     C.INVALID_ARGUMENT, "unknown group 'zz'", "UnknownGroup"),
    ("slot beyond hashes", "Allocate",
     lambda f: pb.AllocateRequest(block_hashes=f.hs, slots=[pb.AllocSlot(depth=9, column="c4")]),
     C.INVALID_ARGUMENT, "outside the 4 hashes", "InvalidInput"),
    ("unknown owner on allocate", "Allocate",
     lambda f: pb.AllocateRequest(block_hashes=[H16], owner="ghost",
                                   slots=[pb.AllocSlot(depth=0, column="c4")]),
     C.NOT_FOUND, "not registered", "UnknownOwner"),
    ("unknown enum value", "Transition",
     lambda f: pb.TransitionRequest(items=[
         pb.TransitionItem(object_id=f.oid, event=99)]),  # type: ignore[arg-type]
     C.INVALID_ARGUMENT, "event value 99 is unknown", "InvalidInput"),
    ("unspecified enum", "Transition",
     lambda f: pb.TransitionRequest(items=[pb.TransitionItem(object_id=f.oid)]),
     C.INVALID_ARGUMENT, "event value 0", "InvalidInput"),
    ("negative lo", "Transition",
     lambda f: pb.TransitionRequest(items=[pb.TransitionItem(
         object_id=f.oid, event=pb.EVENT_WRITE_DONE, lo=-1, hi=5)]),
     C.INVALID_ARGUMENT, "lo must not be negative", "InvalidInput"),
    ("lo > hi", "Transition",
     lambda f: pb.TransitionRequest(items=[pb.TransitionItem(
         object_id=f.oid, event=pb.EVENT_WRITE_DONE, lo=9, hi=5)]),
     C.INVALID_ARGUMENT, "greater than hi", "InvalidInput"),
    # TransitionMany: a malformed item rejects the call; the valid item before it (an
    # eviction of the committed object) must not have been applied
    ("item with no steps", "TransitionMany",
     lambda f: pb.TransitionManyRequest(items=[
         pb.ObjectTransitions(object_id=f.oid, steps=[pb.TransitionStep(event=pb.EVENT_EVICT)]),
         pb.ObjectTransitions(object_id=f.oid)]),
     C.INVALID_ARGUMENT, "TransitionMany item 1: no steps", "InvalidInput"),
    ("unknown event in a step", "TransitionMany",
     lambda f: pb.TransitionManyRequest(items=[
         pb.ObjectTransitions(object_id=f.oid, steps=[pb.TransitionStep(event=pb.EVENT_EVICT)]),
         pb.ObjectTransitions(object_id=f.oid, steps=[
             pb.TransitionStep(event=pb.EVENT_WRITE_DONE),
             pb.TransitionStep(event=99)])]),  # type: ignore[arg-type]
     C.INVALID_ARGUMENT, "item 1 step 1: event value 99 is unknown", "InvalidInput"),
    ("negative range in a step", "TransitionMany",
     lambda f: pb.TransitionManyRequest(items=[pb.ObjectTransitions(
         object_id=f.oid, steps=[pb.TransitionStep(event=pb.EVENT_WRITE_DONE, lo=-1, hi=5)])]),
     C.INVALID_ARGUMENT, "lo must not be negative", "InvalidInput"),
    ("too many items", "TransitionMany",
     lambda f: pb.TransitionManyRequest(items=[pb.ObjectTransitions(
         object_id=f.oid, steps=[pb.TransitionStep(event=pb.EVENT_EVICT)])] * 4097),
     C.INVALID_ARGUMENT, "at most 4096", "InvalidInput"),
    ("unknown lease", "ReleaseLease", lambda f: pb.ReleaseLeaseRequest(lease_id=777),
     C.NOT_FOUND, "does not exist", "UnknownLease"),
    ("expired lease on read", "CheckRead",
     lambda f: pb.CheckReadRequest(handle=pb.Handle(object_id=f.oid, kind=pb.KIND_COMPRESSED),
                                    lease_id=777),
     C.FAILED_PRECONDITION, "expired", "LeaseExpired"),
    ("stale handle", "CheckRead",
     lambda f: pb.CheckReadRequest(handle=pb.Handle(object_id=f.oid, generation=5, block=0,
                                                     kind=pb.KIND_COMPRESSED)),
     C.FAILED_PRECONDITION, "stale, recompute", "StaleHandle"),
    ("unknown object", "Evict", lambda f: pb.EvictRequest(object_id=10**9),
     C.NOT_FOUND, "unknown", "UnknownObject"),
    ("unknown capture", "CaptureStatus", lambda f: pb.CaptureStatusRequest(capture_id=5),
     C.NOT_FOUND, "not registered", "UnknownCapture"),
    ("unknown owner heartbeat", "Heartbeat", lambda f: pb.HeartbeatRequest(owner="ghost"),
     C.NOT_FOUND, "not registered", "UnknownOwner"),
    ("pool of zero blocks", "RegisterOwner",
     lambda f: pb.RegisterOwnerRequest(owner="s9", pools={"c4": pb.PoolConfig(stride=256)}),
     C.INVALID_ARGUMENT, "num_blocks", "InvalidInput"),
    ("pool for unknown column", "RegisterOwner",
     lambda f: pb.RegisterOwnerRequest(owner="s0", pools={"zz": pb.PoolConfig(
         num_blocks=4, stride=256)}),
     C.INVALID_ARGUMENT, "unknown group", "UnknownGroup"),
    ("confirm with bad hash", "Confirm",
     lambda f: pb.ConfirmRequest(owner="s0", reports=[pb.ObjectReport(
         block_hash=b"x", column="c4", state=pb.STATE_COMPRESSED_READY)]),
     C.INVALID_ARGUMENT, "16 bytes", "BadHash"),
    ("begin load of a memory object", "BeginLoad", lambda f: pb.BeginLoadRequest(object_id=f.oid),
     C.FAILED_PRECONDITION, "only a DISK object", "IllegalTransition"),
    ("capture with no handles", "RegisterCapture", lambda f: pb.RegisterCaptureRequest(),
     C.INVALID_ARGUMENT, "at least one handle", "InvalidInput"),
]


@pytest.mark.parametrize(("method", "make", "code", "phrase", "cls"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_with_status_and_state_unchanged(
    stub: pb_grpc.MetadataServiceStub, client: MetadataClient, filled: Filled,
    method: str, make: Callable[[Filled], Any], code: grpc.StatusCode, phrase: str,
    cls: str | None,
) -> None:
    before = state_of(client)
    expect(lambda: getattr(stub, method)(make(filled), timeout=5), code, phrase, cls)
    assert state_of(client) == before


def test_a_batch_refused_part_way_leaves_no_lease(stub: pb_grpc.MetadataServiceStub,
                                                  client: MetadataClient,
                                                  filled: Filled) -> None:
    """A batch item the view refuses only once it walks (a hash out of place inside the
    prompt) fails the batch after the items before it took their leases: those go too."""
    scrambled = [filled.hs[0], filled.hs[2], filled.hs[1], filled.hs[3]]
    gauges: Any = client.stats()["gauges"]
    expect(lambda: stub.Lookup(pb.LookupBatchRequest(requests=[
        pb.LookupRequest(block_hashes=filled.hs, lease_ttl_s=30.0),
        pb.LookupRequest(block_hashes=scrambled)]), timeout=5),
        C.INVALID_ARGUMENT, "for block 1 is the hash of block 2", "MisplacedHash")
    after: Any = client.stats()["gauges"]
    assert after["leases"] == gauges["leases"] == 0


def test_item_errors_in_a_transition_batch(stub: pb_grpc.MetadataServiceStub,
                                           client: MetadataClient, filled: Filled) -> None:
    before = client.stats()
    resp = stub.Transition(pb.TransitionRequest(items=[
        pb.TransitionItem(object_id=10**9, event=pb.EVENT_WRITE_DONE),
        pb.TransitionItem(object_id=filled.oid, event=pb.EVENT_TAIL_DONE),  # c4 object: illegal
        pb.TransitionItem(object_id=filled.oid, event=pb.EVENT_WRITE_DONE, generation=99),
    ]), timeout=5)
    errs = [o.error for o in resp.outcomes]
    assert [e.code for e in errs] == [C.NOT_FOUND.value[0], C.FAILED_PRECONDITION.value[0],
                                      C.INVALID_ARGUMENT.value[0]]
    assert [e.error_class for e in errs] == ["UnknownObject", "IllegalTransition",
                                             "FutureGeneration"]
    assert "never issued" in errs[2].message
    assert client.stats() == before  # illegal transitions leave the state unchanged


def test_unknown_hash_is_a_miss_not_an_error(client: MetadataClient, filled: Filled) -> None:
    from hkv_service.core.api import LookupRequest

    m = client.lookup(LookupRequest(hashes(3, seed=42)))
    assert m.usable_tokens == 0 and not m.handles


def test_admission_refused_carries_retry_after() -> None:
    from svc_util import start_live

    st = CacheState(default_spec(), StateConfig(admission=AdmissionCap(max_objects=1)))
    lv = start_live(state=st)
    try:
        with MetadataClient(lv.endpoint) as c, grpc.insecure_channel(lv.endpoint) as ch:
            register(c, "s0")
            register(c, "d0")
            ids = commit_remote(c, hashes(2), "s0")
            c.begin_offload(ids[(0, "c4")], "d0")
            stub = pb_grpc.MetadataServiceStub(ch)  # type: ignore[no-untyped-call]
            err: Any = expect(lambda: stub.BeginOffload(pb.BeginOffloadRequest(
                object_id=ids[(1, "c4")], disk_owner="d0"), timeout=5),
                C.RESOURCE_EXHAUSTED, "admission cap", "AdmissionRefused")
            assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
            with pytest.raises(E.AdmissionRefused) as info:
                c.begin_offload(ids[(1, "c4")], "d0")
            assert info.value.retry_after_s > 0
    finally:
        lv.service.stop(0).wait()


def test_oversize_message_is_resource_exhausted(stub: pb_grpc.MetadataServiceStub) -> None:
    big = lookup(block_hashes=[b"x" * 16] * (5 << 20))  # ~90 MiB > 64 MiB limit
    expect(lambda: stub.Lookup(big, timeout=30), C.RESOURCE_EXHAUSTED, "")


# The code each branch of the error tree must get, written out apart from STATUS_TABLE.
BRANCH_CODES: dict[type[E.HkvError], grpc.StatusCode] = {
    E.InvalidInput: C.INVALID_ARGUMENT,
    E.NotFound: C.NOT_FOUND,
    E.FailedPrecondition: C.FAILED_PRECONDITION,
    E.ResourceExhausted: C.RESOURCE_EXHAUSTED,
    E.Unavailable: C.UNAVAILABLE,
}
# The disk tier's errors (storage/errors.py), each with the code it must get on the wire.
STORAGE_CODES: dict[type[E.HkvError], grpc.StatusCode] = {
    S.NotOnDisk: C.NOT_FOUND,  # never written, evicted, deleted: a miss
    S.CorruptEntry: C.NOT_FOUND,  # quarantined on read: a miss (recompute), never data
    S.DiskFull: C.RESOURCE_EXHAUSTED,
    S.StorageFailure: C.UNAVAILABLE,  # retryable
    S.StoreDamaged: C.UNAVAILABLE,  # handled inside the tier (it starts cold); if it escaped
}


def _instance(cls: type[E.HkvError]) -> E.HkvError:
    if cls is S.StoreDamaged:
        return S.StoreDamaged("x", "truncated", 1)
    return S.CorruptEntry("x", "checksum") if cls is S.CorruptEntry else cls("x")


def _branch_code(cls: type[E.HkvError]) -> grpc.StatusCode:
    codes = {code for base, code in BRANCH_CODES.items() if issubclass(cls, base)}
    assert len(codes) <= 1, (cls, codes)
    return codes.pop() if codes else C.INTERNAL


def test_status_table_covers_the_tree() -> None:
    for name in E.__all__:
        cls = getattr(E, name)
        mapped = status_map.map_error(cls("x"))
        assert mapped.code is _branch_code(cls), (name, mapped.code)
        assert mapped.code is not C.INTERNAL or cls is E.HkvError
        assert status_map.error_class(mapped.error_class, mapped.code) is cls


def test_status_table_covers_the_storage_errors() -> None:
    assert {c.__name__ for c in STORAGE_CODES} == set(S.__all__)  # a new one needs a row here
    for cls, code in STORAGE_CODES.items():
        mapped = status_map.map_error(_instance(cls))
        assert (mapped.code, mapped.error_class) == (code, cls.__name__)
        assert mapped.code is _branch_code(cls)
        # The client does not import storage: it raises the core class of the same code,
        # an ancestor of the server's, so ``except NotFound`` etc. works on both sides.
        client_cls = status_map.error_class(mapped.error_class, mapped.code)
        assert client_cls is not None and issubclass(cls, client_cls), (cls, client_cls)


class _FailingEvict(CacheState):
    """A real CacheState whose Evict raises the error the test injects (as a disk-backed
    state would raise it from below)."""

    inject: E.HkvError | None = None

    def evict(self, object_id: Any) -> None:
        if self.inject is not None:
            raise self.inject
        super().evict(object_id)


def test_storage_errors_reach_the_client_with_their_code() -> None:
    from svc_util import start_live

    st = _FailingEvict(default_spec())
    lv = start_live(state=st)
    try:
        with MetadataClient(lv.endpoint) as c, grpc.insecure_channel(lv.endpoint) as ch:
            stub = pb_grpc.MetadataServiceStub(ch)  # type: ignore[no-untyped-call]
            for cls, code in STORAGE_CODES.items():
                st.inject = _instance(cls)
                expect(lambda: stub.Evict(pb.EvictRequest(object_id=1), timeout=5),
                       code, "x", cls.__name__)
                with pytest.raises(E.HkvError) as info:
                    c.evict(1)
                assert isinstance(st.inject, type(info.value)), (cls, type(info.value))
                assert type(info.value) is not E.HkvError and str(info.value) == "x"
            st.inject = None
            expect(lambda: stub.Evict(pb.EvictRequest(object_id=1), timeout=5),
                   C.NOT_FOUND, "", "UnknownObject")  # the real path still answers
    finally:
        lv.service.stop(0).wait()


class SteppedClock:
    """The service's clock (CacheState.clock), moved by the test: no wall-clock waits."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _undecodable_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "undecodable request" in r.getMessage()]


def test_an_undecodable_request_is_invalid_argument_and_a_throttled_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """Regression (issue 17, item 8): grpcio's deserializer logged a traceback per call and
    answered INTERNAL. Now INVALID_ARGUMENT, no traceback, and (issue 35, item 8) one line
    per interval for every method together."""
    import logging

    from hkv_service.server.app import ServerConfig, build_service

    svc = build_service(ServerConfig(port=0), CacheState(default_spec(), clock=SteppedClock()))
    svc.server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch, \
                caplog.at_level(logging.WARNING):
            for method in ("Allocate", "Lookup", "Stats"):
                call = ch.unary_unary(f"/hkv.v1.MetadataService/{method}")
                with pytest.raises(grpc.RpcError) as err:
                    call(b"\xff" * 11, timeout=10)
                assert err.value.code() is C.INVALID_ARGUMENT
                assert "cannot decode" in (err.value.details() or "")
    finally:
        svc.stop(0).wait(10)
    assert len(_undecodable_lines(caplog)) == 1 and not any(r.exc_info for r in caplog.records)
    assert svc.state.stats()["events"] == {"undecodable_request": 3}


def test_a_burst_of_undecodable_requests_is_counted_and_logs_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35, item 8: 2,700 fuzzed calls wrote 909 WARNING lines. A burst over every
    method, unary and streaming, writes one line per interval; the next line says how many
    were held back; Stats and the Prometheus counter count every one of them."""
    import logging

    from prometheus_client import generate_latest

    from hkv_service.server.metrics import make_registry
    from hkv_service.server.servicer import UNDECODABLE_LOG_S

    clock = SteppedClock()
    svc = start_live(state=CacheState(default_spec(), clock=clock)).service
    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["MetadataService"].methods]
    sent = 0
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch, \
                MetadataClient(f"127.0.0.1:{svc.port}") as client, \
                caplog.at_level(logging.WARNING):
            for step in range(3):  # three intervals, a burst in each
                for _ in range(10):
                    for method in methods:
                        _send_undecodable(ch, method)
                        sent += 1
                lines = _undecodable_lines(caplog)
                assert len(lines) == step + 1, lines
                clock.now += UNDECODABLE_LOG_S
            held = len(methods) * 10 - 1  # each line after the first: the last burst, but one
            assert [f"({n} more since the last such line" in line
                    for n, line in zip([0, held, held], lines, strict=True)] == [True] * 3
            events = client.stats()["events"]
    finally:
        svc.stop(0).wait(10)
    assert events["undecodable_request"] == sent == 3 * 10 * len(methods)  # type: ignore[index]
    metrics = generate_latest(make_registry(svc.state)).decode()
    assert f'hkv_events_total{{event="undecodable_request"}} {float(sent)}' in metrics


def _send_undecodable(ch: grpc.Channel, method: str) -> None:
    path = f"/hkv.v1.MetadataService/{method}"
    with pytest.raises(grpc.RpcError) as err:
        if method == "LookupStream":
            list(ch.stream_stream(path)(iter([b"\xff" * 11]), timeout=10))
        elif method == "Watch":
            list(ch.unary_stream(path)(b"\xff" * 11, timeout=10))
        else:
            ch.unary_unary(path)(b"\xff" * 11, timeout=10)
    assert err.value.code() is C.INVALID_ARGUMENT, (method, err.value.code())


def test_a_refused_call_leaves_no_garbage_cycle(live: Live, client: MetadataClient) -> None:
    """Regression: the client raised the refusal it decoded from a local of the frame the
    traceback holds (frame -> exception -> traceback -> frame), 7 objects a refused call that
    only a full collection frees: in a worker whose heap is frozen or collected rarely (the
    service's own policy, an engine's), they pile up. Nothing of a refusal outlives it now."""
    register(client, "s0", blocks=16)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(20):
            with pytest.raises(E.UnknownObject):
                client.transition(ObjectId(123_456_789), Event.WRITE_DONE)
        assert gc.collect() == 0
    finally:
        if was:
            gc.enable()
