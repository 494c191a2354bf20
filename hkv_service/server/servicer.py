"""``hkv.v1.MetadataService``: decode -> call the CacheState -> encode. No logic of its own.

Domain errors (:class:`HkvError`) become statuses through ``status_map`` in exactly one
place (:func:`_abort`); anything else escapes to grpcio, which answers UNKNOWN and logs it.
Batched calls validate every item before applying any (a rejected request changes nothing);
``Transition`` then applies items one by one and reports an outcome per item, and
``TransitionMany`` does the same with items of many events, each item all or none.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from hkv_service.core.api import AllocRequest, Match, PoolConfig
from hkv_service.core.errors import HkvError, IllegalTransition, InvalidInput
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash, CaptureId, LeaseId, ObjectId, PackedHashes, ShardId
from hkv_service.core.resumable import resumable
from hkv_service.core.state_view import CacheState
from hkv_service.core.throttle import Throttle
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.proto_gen.hkv.v1 import hkv_pb2_grpc as pb_grpc
from hkv_service.wire import codec
from hkv_service.wire.status_map import map_error

from . import gcpolicy, validation
from .replies import ReplyCache
from .tokenbook import TokenBook

log = logging.getLogger(__name__)

__all__ = ["UNDECODABLE", "UNDECODABLE_LOG_S", "MetadataServicer"]

UNDECODABLE = "undecodable_request"  # its count in stats()["events"], and its log throttle key
UNDECODABLE_LOG_S = 10.0  # one WARNING line per this long at most; the count is exact

F = TypeVar("F", bound=Callable[..., Any])
WATCH_POLL_S = 0.02
WATCH_MAX_BATCH = 1024


def _abort(context: grpc.ServicerContext, err: HkvError) -> NoReturn:
    mapped = map_error(err)
    context.set_trailing_metadata(mapped.trailing_metadata())
    context.abort(mapped.code, mapped.message)
    raise AssertionError("context.abort returned")  # grpcio raises; keeps mypy honest


def _item_error(err: HkvError, out: Any) -> None:
    mapped = map_error(err)
    out.code, out.error_class, out.message = mapped.code.value[0], mapped.error_class, \
        mapped.message
    out.retry_after_ms = mapped.retry_after_ms or 0
    if isinstance(err, IllegalTransition):
        codec.encode_refusal(err, out)


def _unary(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: MetadataServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except HkvError as err:
            _abort(context, err)
    return wrapper  # type: ignore[return-value]


class MetadataServicer(pb_grpc.MetadataServiceServicer):
    def __init__(self, state: CacheState, stopping: threading.Event | None = None,
                 tokens: TokenBook | None = None) -> None:
        self.state = state
        self.tokens = tokens  # the KV event stream's token book (None: no stream)
        self.stopping = stopping or threading.Event()
        self.replies = ReplyCache()
        self.log_throttle = Throttle(UNDECODABLE_LOG_S, state.clock)

    def parse(self, message: Any, method: str, raw: bytes, context: grpc.ServicerContext
              ) -> Any:
        """``message`` parsed from ``raw``. Bytes that are no such message end the call with
        INVALID_ARGUMENT (grpcio's own deserializer logs a traceback per call and answers
        INTERNAL); each is counted in ``stats()["events"]``, and logged at most once per
        :data:`UNDECODABLE_LOG_S` (a fuzzer or a client of another protocol sends thousands)."""
        try:
            return message.FromString(raw)
        except DecodeError:
            self._undecodable(method, len(raw), context.peer())
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"cannot decode the {method} request: not a valid hkv.v1 "
                          f"{message.DESCRIPTOR.name}")

    def _undecodable(self, method: str, nbytes: int, peer: str) -> None:
        self.state.note_event(UNDECODABLE)
        logged = self.log_throttle.note(UNDECODABLE)
        if logged is not None:
            log.warning("%s: undecodable request (%d bytes) from %s: INVALID_ARGUMENT (%d more "
                        "since the last such line; at most one line per %g s, all counted in "
                        "stats events %s)", method, nbytes, peer, logged.held_back,
                        UNDECODABLE_LOG_S, UNDECODABLE)

    # ---- spec and owners ----------------------------------------------------------------

    @_unary
    def GetSpec(self, request: Any, context: grpc.ServicerContext) -> Any:
        spec, layout = self.state.spec, self.state.layout
        out = pb.GetSpecResponse(spec_json=json.dumps(spec.to_dict()), model_id=spec.model_id,
                                 hash_block_size=spec.hash_block_size,
                                 lcm_block_size=spec.lcm_block_size)
        for c in layout.columns:
            out.columns.add(index=c.index, name=c.name, kind=codec.KINDS.to_pb[c.kind],
                            nbytes=c.nbytes, abi_fingerprint=c.group.abi.fingerprint())
        return out

    @_unary
    def RegisterOwner(self, request: Any, context: grpc.ServicerContext) -> Any:
        if not request.owner:
            raise InvalidInput("RegisterOwner: owner id must be a non-empty string")
        pools = {name: PoolConfig(p.num_blocks, p.stride, p.base_align or 4096, p.first_block,
                                  p.device or "cpu", p.generation_floor)
                 for name, p in request.pools.items()}
        validation.check_pools(self.state, pools)
        inc = self.state.register_owner(ShardId(request.owner), pools, request.instance)
        return pb.RegisterOwnerResponse(incarnation=inc)

    @_unary
    def Heartbeat(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.state.heartbeat(ShardId(request.owner), request.incarnation)
        return pb.HeartbeatResponse()

    @_unary
    def MarkOwnerLost(self, request: Any, context: grpc.ServicerContext) -> Any:
        lost = self.state.mark_owner_lost(ShardId(request.owner), list(request.witnesses),
                                          request.instance)
        return pb.MarkOwnerLostResponse(lost=lost or 0, stale=lost is None)

    @_unary
    def Confirm(self, request: Any, context: grpc.ServicerContext) -> Any:
        owner = validation.check_owner(self.state, request.owner, "Confirm")
        reports = [codec.decode_report(r, f"report {i}") for i, r in enumerate(request.reports)]
        for i, r in enumerate(reports):
            hashes = [r.block_hash] + ([r.parent_hash] if r.parent_hash is not None else [])
            validation.check_hashes(hashes, f"report {i}")
        validation.check_columns(self.state, (r.column for r in reports), "Confirm")
        if request.incarnation == 0:
            raise InvalidInput("Confirm needs the incarnation RegisterOwner returned (> 0)")
        ids = self.state.confirm_objects(owner, reports, request.incarnation)
        gcpolicy.freeze_confirmed()  # the view's records, long-lived: never scanned
        return pb.ConfirmResponse(confirmed=sum(1 for oid in ids if oid),
                                  object_ids=[oid or 0 for oid in ids])

    # ---- allocation and transitions -----------------------------------------------------

    @_unary
    def Allocate(self, request: Any, context: grpc.ServicerContext) -> Any:
        owner = (validation.check_owner(self.state, request.owner, "Allocate")
                 if request.owner else None)
        hashes = [BlockHash(h) for h in request.block_hashes]
        validation.check_hashes(hashes, "Allocate")
        slots = [AllocRequest(s.depth, s.column, s.replace) for s in request.slots]
        book = self.tokens if request.token_ids else None
        if book is not None:
            book.check(hashes, request.token_ids)
        allocations = self.state.allocate(hashes, slots, owner, request.first_block)
        if book is not None:
            book.note(hashes, request.token_ids)
        out = pb.AllocateResponse()
        for a in allocations:
            codec.encode_handle(a.handle, out.handles.add())
        out.existing.extend([a.existing for a in allocations])
        out.versions.extend([a.version for a in allocations])
        states: Any = out.states
        states.extend([codec.STATES.to_pb[a.state] for a in allocations])
        return out

    @_unary
    def Transition(self, request: Any, context: grpc.ServicerContext) -> Any:
        items = [(ObjectId(it.object_id), codec.EVENTS.decode(it.event, f"item {i}"),
                  codec.decode_params(it, f"item {i}"),
                  it.generation if it.HasField("generation") else None)
                 for i, it in enumerate(request.items)]
        out = pb.TransitionResponse()
        for oid, event, params, generation in items:
            outcome = out.outcomes.add()
            try:
                result = self.state.transition(oid, event, params, generation)
            except HkvError as err:
                _item_error(err, outcome.error)
            else:
                codec.encode_result(result, outcome.result)
        return out

    @_unary
    def TransitionMany(self, request: Any, context: grpc.ServicerContext) -> Any:
        items = [codec.decode_object_transitions(it, f"TransitionMany item {i}")
                 for i, it in enumerate(request.items)]
        out = pb.TransitionManyResponse()
        for result in self.state.transition_many(items):
            outcome = out.outcomes.add()
            if isinstance(result, HkvError):
                _item_error(result, outcome.error)
            else:
                codec.encode_result(result, outcome.result)
        return out

    @_unary
    def Evict(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.state.evict(ObjectId(request.object_id))
        return pb.EvictResponse()

    @_unary
    def BeginOffload(self, request: Any, context: grpc.ServicerContext) -> Any:
        h = self.state.begin_offload(ObjectId(request.object_id), ShardId(request.disk_owner))
        return pb.BeginOffloadResponse(handle=codec.encode_handle(h))

    @_unary
    def BeginLoad(self, request: Any, context: grpc.ServicerContext) -> Any:
        owner = (validation.check_owner(self.state, request.owner, "BeginLoad")
                 if request.owner else None)
        h = self.state.begin_load(ObjectId(request.object_id), owner)
        return pb.BeginLoadResponse(handle=codec.encode_handle(h))

    # ---- lookup -------------------------------------------------------------------------

    # Lookup replies are built as bytes: a lookup answered by the view's memo comes with its
    # reply already encoded (``Match.memo.wire``, a one-match LookupBatchResponse), returned
    # as is instead of re-encoding ~5k handles; a request seen before with a memo behind it
    # is answered from ``replies`` (see replies.py). app._add_servicer registers LookupRaw and
    # LookupStreamRaw for Lookup and LookupStream: raw request bytes, bytes-passing serializer.

    def _lookups(self, requests: Any) -> list[Match]:
        decoded = [codec.decode_lookup(r, i) for i, r in enumerate(requests)]
        # One bad item must reject a batch before any lease is taken; a single request is
        # validated by the view itself (validating 2,048 hashes twice costs ~1/4 of the walk).
        if len(decoded) > 1:
            validation.check_lookups(self.state, decoded)
        # The Match's handle columns are a snapshot taken under the view's lock.
        matches: list[Match] = []
        try:
            for req in decoded:
                matches.append(self.state.lookup(req))
        except Exception:  # refused part way (only a walk finds it): the batch takes nothing
            for m in matches:
                if m.lease_id is not None:
                    self.state.release_lease(m.lease_id)
            raise
        return matches

    @_unary
    def LookupRaw(self, raw: bytes, context: grpc.ServicerContext) -> bytes:
        """Lookup over the request's bytes, answered with a serialized LookupBatchResponse;
        a repeat of a memo-answered request is a replay."""
        cached = self.replies.get(raw)
        if cached is not None:
            memo, reply = cached
            if self.state.replay(memo):
                return reply
            self.replies.discard(raw)  # something on the path changed: look it up afresh
        request = self.parse(pb.LookupBatchRequest, "Lookup", raw, context)
        matches = self._lookups(request.requests)
        reply = codec.batch_reply(matches)
        if len(matches) == 1 and matches[0].memo is not None and matches[0].repeatable:
            self.replies.put(raw, matches[0].memo, reply)
        return reply

    def LookupStreamRaw(self, raw_iterator: Iterator[bytes],
                        context: grpc.ServicerContext) -> Iterator[bytes]:
        """LookupStream over undecoded messages (see ``app._add_servicer``): undecodable
        bytes end the stream with INVALID_ARGUMENT, as every method answers them."""
        for raw in raw_iterator:
            yield self._stream_batch(
                self.parse(pb.LookupStreamRequest, "LookupStream", raw, context))

    def _stream_batch(self, request: Any) -> bytes:
        """A serialized LookupStreamResponse: the tag, then the matches or the error."""
        head = pb.LookupStreamResponse(tag=request.tag)
        try:
            matches = [codec.match_bytes(m) for m in self._lookups(request.requests)]
        except HkvError as err:
            _item_error(err, head.error)
            return head.SerializeToString()
        return head.SerializeToString() + codec.repeated_field(2, matches)

    @_unary
    def AdmitSave(self, request: Any, context: grpc.ServicerContext) -> Any:
        hashes = [BlockHash(h) for h in request.block_hashes]
        validation.check_hashes(hashes, "AdmitSave")
        return pb.AdmitSaveResponse(admitted=self.state.admit_save(
            hashes, request.needed, request.offered_from))

    # ---- leases, reads, captures --------------------------------------------------------

    @_unary
    def ReleaseLease(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.state.release_lease(LeaseId(request.lease_id))
        return pb.ReleaseLeaseResponse()

    @_unary
    def CheckRead(self, request: Any, context: grpc.ServicerContext) -> Any:
        lease = LeaseId(request.lease_id) if request.HasField("lease_id") else None
        self.state.check_read(codec.decode_handle(request.handle), lease)
        return pb.CheckReadResponse()

    @_unary
    def RegisterCapture(self, request: Any, context: grpc.ServicerContext) -> Any:
        handles = [codec.decode_handle(h, f"handle {i}") for i, h in enumerate(request.handles)]
        if not handles:
            raise InvalidInput("RegisterCapture: a capture needs at least one handle")
        capture, epoch = self.state.register_capture(handles)
        return pb.RegisterCaptureResponse(capture_id=capture, topology_epoch=epoch)

    @_unary
    def ReleaseCapture(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.state.release_capture(CaptureId(request.capture_id))
        return pb.ReleaseCaptureResponse()

    @_unary
    def CaptureStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        valid, epoch = self.state.capture_status(CaptureId(request.capture_id))
        return pb.CaptureStatusResponse(valid=valid, topology_epoch=epoch)

    # ---- watch and stats ----------------------------------------------------------------

    def Watch(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        seq, limit = request.from_seq, request.max_batch or WATCH_MAX_BATCH
        while context.is_active() and not self.stopping.is_set():
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                return
            events = self.state.events_since(seq, min(limit, WATCH_MAX_BATCH))
            if not events:
                self.stopping.wait(WATCH_POLL_S)
                continue
            out = pb.WatchResponse(gap=events[0].seq > seq + 1)
            for ev in events:
                codec.encode_event(ev, out.events.add())
            seq = events[-1].seq
            yield out

    @_unary
    def Resumable(self, request: Any, context: grpc.ServicerContext) -> Any:
        layout = self.state.layout
        if request.packed_hashes and request.token_ids:
            raise InvalidInput("Resumable: give the prompt as packed_hashes or as token_ids, "
                               "not both")
        if request.token_ids:
            if len(request.token_ids) % 4:
                raise InvalidInput("Resumable: token_ids must be whole int32 values")
            tokens = np.frombuffer(request.token_ids, "<i4")
            extra = ExtraKeys(self.state.spec.model_id, request.adapter_id, request.cache_salt)
            hashes: Sequence[BlockHash] = hash_blocks(tokens, layout.hash_block, extra)
        else:
            hashes = PackedHashes(request.packed_hashes)
        if not hashes:
            raise InvalidInput("Resumable: the prompt holds no whole hash block")
        abi = dict(request.reader_abi) if len(request.reader_abi) else None
        answer = resumable(self.state.lookup, hashes, layout, abi)
        return codec.encode_resumable(answer, pb.ResumableResponse())

    @_unary
    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        return codec.encode_stats(self.state.stats(), pb.StatsResponse())
