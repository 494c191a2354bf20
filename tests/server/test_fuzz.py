"""Fuzzing: random bytes to every method, and random field values for Lookup / Allocate /
Transition. Only proper status codes come back, the server keeps serving, and a rejected
request leaves the state unchanged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from svc_util import Live, commit_remote, hashes, register, start_live

from hkv_service.client import MetadataClient
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb

METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["MetadataService"].methods]
STREAMING = {"LookupStream", "Watch"}
PROPER = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def fuzz_live() -> Iterator[tuple[Live, MetadataClient, grpc.Channel, list[bytes]]]:
    lv = start_live()
    client = MetadataClient(lv.endpoint)
    register(client)
    hs = hashes(4)
    commit_remote(client, hs)
    ch = grpc.insecure_channel(lv.endpoint)
    yield lv, client, ch, list(hs)
    ch.close()
    client.close()
    lv.service.stop(0).wait()


def _state(client: MetadataClient) -> dict[str, object]:
    s = client.stats()
    return {k: v for k, v in s.items() if k not in ("events", "lookups", "downgrades")}


def _call_raw(ch: grpc.Channel, method: str, payload: bytes) -> None:
    path = f"/hkv.v1.MetadataService/{method}"
    if method == "LookupStream":
        list(ch.stream_stream(path)(iter([payload]), timeout=2))
    elif method == "Watch":
        list(ch.unary_stream(path)(payload, timeout=0.2))
    else:
        ch.unary_unary(path)(payload, timeout=2)


@FUZZ
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=256))
def test_random_bytes_never_crash(fuzz_live: Any, method: str, payload: bytes) -> None:
    _lv, client, ch, _ = fuzz_live
    try:
        _call_raw(ch, method, payload)
    except grpc.RpcError as err:
        code = err.code()
        # undecodable -> INTERNAL (grpcio); decodable garbage -> a domain status
        assert code in PROPER | {grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED}, \
            (method, code, err.details())
    assert "gauges" in client.stats()  # still serving


hash_st = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=20))


def _hashes_st(real: list[bytes]) -> st.SearchStrategy[list[bytes]]:
    return st.one_of(st.lists(hash_st, max_size=6), st.just(real),
                     st.lists(st.sampled_from(real), max_size=6))


def _check(client: MetadataClient, call: Any, mutating: bool) -> None:
    before = _state(client)
    try:
        call()
    except grpc.RpcError as err:
        assert err.code() in PROPER, (err.code(), err.details())
        assert _state(client) == before
    else:
        if not mutating:
            assert _state(client) == before


@FUZZ
@given(data=st.data())
def test_lookup_fields(fuzz_live: Any, data: st.DataObject) -> None:
    _lv, client, ch, real = fuzz_live
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
    _check(client, lambda: stub(pb.LookupBatchRequest(requests=[msg]), timeout=5), leased)


@FUZZ
@given(data=st.data())
def test_allocate_fields(fuzz_live: Any, data: st.DataObject) -> None:
    _lv, client, ch, real = fuzz_live
    slots = data.draw(st.lists(st.builds(
        pb.AllocSlot, depth=st.integers(0, 8),
        column=st.sampled_from(["c4", "c128", "swa", "idx", "c4.tail", "nope", ""])),
        max_size=4))
    msg = pb.AllocateRequest(block_hashes=data.draw(_hashes_st(real)), slots=slots,
                             owner=data.draw(st.sampled_from(["", "s0", "ghost"])))
    stub = ch.unary_unary("/hkv.v1.MetadataService/Allocate",
                          request_serializer=pb.AllocateRequest.SerializeToString,
                          response_deserializer=pb.AllocateResponse.FromString)
    _check(client, lambda: stub(msg, timeout=5), True)


@FUZZ
@given(data=st.data())
def test_transition_fields(fuzz_live: Any, data: st.DataObject) -> None:
    _lv, client, ch, _ = fuzz_live
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
    _check(client, lambda: stub(pb.TransitionRequest(items=[item]), timeout=5), True)
