"""``MetadataClient``: the typed Python face of ``hkv.v1.MetadataService``.

Calls take and return the core's own types (Match, Handle, Allocation, TransitionResult,
TransitionEvent, ObjectReport, CacheSpec); no protobuf type leaks out. Every call has a
deadline (``timeout_s``). Only idempotent calls are retried, a bounded number of times with
exponential backoff, and only on UNAVAILABLE (the server restarting or not yet up). Errors
come back as the core's domain exception: by the ``hkv-error`` trailing metadata when the
server sent it, else by status code; a status with no domain meaning (DEADLINE_EXCEEDED,
UNAUTHENTICATED, INTERNAL ...) raises :class:`RpcFailed`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from hkv_service.core import api
from hkv_service.core.errors import (
    AdmissionRefused,
    FailedPrecondition,
    HkvError,
    IllegalTransition,
    InvalidInput,
)
from hkv_service.core.ids import BlockHash, CaptureId, LeaseId, ObjectId, PackedHashes, ShardId
from hkv_service.core.resumable import Resumable
from hkv_service.core.spec import CacheSpec, spec_from_dict
from hkv_service.core.states import Event
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb
from hkv_service.proto_gen.hkv.v1 import hkv_pb2_grpc as pb_grpc
from hkv_service.settings import TlsConfig  # the client's TLS: defined with the settings
from hkv_service.wire import codec
from hkv_service.wire.rpc import RpcFailed  # raised here; its own home: a worker reads its code
from hkv_service.wire.status_map import ERROR_CLASS_KEY, RETRY_AFTER_KEY, error_class

__all__ = ["MetadataClient", "RetryPolicy", "RpcFailed", "TlsConfig", "TransitionItem"]

_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 5
    first_backoff_s: float = 0.05
    max_backoff_s: float = 1.0


@dataclass(frozen=True, slots=True)
class TransitionItem:
    """One event of one object (``transition_many`` takes it as an item of that one event)."""

    object_id: ObjectId
    event: Event
    params: api.Params | None = None
    generation: int | None = None


def _to_error(code: grpc.StatusCode | None, details: str, cls_name: str | None,
              retry_ms: str | None) -> HkvError:
    cls = error_class(cls_name, code)
    if cls is None:
        return RpcFailed(code.name if code is not None else "UNKNOWN", details)
    if issubclass(cls, AdmissionRefused):
        return cls(details, retry_after_s=int(retry_ms or 50) / 1000)
    return cls(details)


def _from_rpc_error(err: grpc.RpcError) -> HkvError:
    call: Any = err
    md = dict(call.trailing_metadata() or ())
    return _to_error(call.code(), call.details() or "", md.get(ERROR_CLASS_KEY),
                     md.get(RETRY_AFTER_KEY))


def _from_item_error(msg: Any) -> HkvError:
    err = _to_error(_CODES.get(msg.code), msg.message, msg.error_class,
                    str(msg.retry_after_ms) if msg.retry_after_ms else None)
    return codec.decode_refusal(msg, err) if isinstance(err, IllegalTransition) else err


def _outcomes(resp: Any) -> list[api.TransitionResult | HkvError]:
    return [codec.decode_result(o.result) if o.HasField("result") else _from_item_error(o.error)
            for o in resp.outcomes]


def _as_item(it: api.ObjectTransitions | TransitionItem) -> api.ObjectTransitions:
    if isinstance(it, TransitionItem):
        return api.ObjectTransitions(it.object_id, (it.event,), (it.params,), it.generation)
    return api.ObjectTransitions(*it)


def _channel(endpoint: str, tls: TlsConfig | None) -> grpc.Channel:
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if tls is None:
        return grpc.insecure_channel(endpoint, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    creds = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
    return grpc.secure_channel(endpoint, creds, options=options)


class MetadataClient:
    def __init__(self, endpoint: str, token: str | None = None, tls: TlsConfig | None = None,
                 timeout_s: float = 5.0, retry: RetryPolicy | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel = _channel(endpoint, tls)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MetadataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -----------------------------------------------------------------------

    def _call(self, method: str, request: Any, *, idempotent: bool) -> Any:
        attempts = self.retry.attempts if idempotent else 1
        backoff = self.retry.first_backoff_s
        for attempt in range(attempts):
            try:
                return getattr(self._stub, method)(request, timeout=self.timeout_s,
                                                   metadata=self._metadata)
            except grpc.RpcError as err:
                call: Any = err
                if call.code() is not grpc.StatusCode.UNAVAILABLE or attempt + 1 == attempts:
                    raise _from_rpc_error(err) from None
            time.sleep(backoff)
            backoff = min(backoff * 2, self.retry.max_backoff_s)
        raise AssertionError("unreachable")

    # ---- spec and owners ----------------------------------------------------------------

    def get_spec(self) -> CacheSpec:
        resp = self._call("GetSpec", pb.GetSpecRequest(), idempotent=True)
        return spec_from_dict(json.loads(resp.spec_json))

    def register_owner(self, owner: str, pools: Mapping[str, api.PoolConfig],
                       instance: int = 0) -> int:
        req = pb.RegisterOwnerRequest(owner=owner, instance=instance)
        for name, cfg in pools.items():
            req.pools[name].CopyFrom(pb.PoolConfig(num_blocks=cfg.num_blocks, stride=cfg.stride,
                                                   base_align=cfg.base_align,
                                                   first_block=cfg.first,
                                                   device=cfg.device,
                                                   generation_floor=cfg.generation_floor))
        return int(self._call("RegisterOwner", req, idempotent=False).incarnation)

    def heartbeat(self, owner: str, incarnation: int) -> None:
        self._call("Heartbeat", pb.HeartbeatRequest(owner=owner, incarnation=incarnation),
                   idempotent=True)

    def mark_owner_lost(self, owner: str, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        """Objects ``owner`` held, declared lost; None: the report is about a process a
        successor replaced, and was ignored (``CacheState.mark_owner_lost``)."""
        req = pb.MarkOwnerLostRequest(owner=owner, witnesses=list(witnesses),
                                      instance=instance)
        reply = self._call("MarkOwnerLost", req, idempotent=False)
        return None if reply.stale else int(reply.lost)

    def confirm(self, owner: str, reports: Sequence[api.ObjectReport], incarnation: int) -> int:
        """How many of ``reports`` :meth:`confirm_objects` re-created."""
        return sum(1 for oid in self.confirm_objects(owner, reports, incarnation) if oid)

    def confirm_objects(self, owner: str, reports: Sequence[api.ObjectReport], incarnation: int
                        ) -> list[ObjectId | None]:
        """Vouch for ``reports`` after a service restart, as the incarnation ``register_owner``
        returned; per report, the id its object has now (None: not re-created). Not retried
        (a late duplicate must not land after a new registration)."""
        req = pb.ConfirmRequest(owner=owner, incarnation=incarnation)
        for r in reports:
            codec.encode_report(r, req.reports.add())
        reply = self._call("Confirm", req, idempotent=False)
        if len(reply.object_ids) != len(reports):
            raise FailedPrecondition(f"Confirm answered {len(reply.object_ids)} ids for "
                               f"{len(reports)} reports: is the service older than this client?")
        return [ObjectId(i) if i else None for i in reply.object_ids]

    # ---- allocation and transitions -----------------------------------------------------

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[api.AllocRequest],
                 owner: ShardId | str | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[api.Allocation]:
        """``token_ids``: the tokens of ``block_hashes``' blocks, for the KV event stream
        (its BlockStored events carry them; docs/routing.md)."""
        req = pb.AllocateRequest(block_hashes=block_hashes, owner=owner or "",
                                 first_block=first_block)
        if token_ids is not None:
            req.token_ids = np.asarray(token_ids, dtype="<i4").tobytes()
        for r in requests:
            req.slots.add(depth=r.depth, column=r.column, replace=r.replace)
        return codec.decode_allocations(self._call("Allocate", req, idempotent=True))

    def resumable(self, block_hashes: Sequence[BlockHash] | None = None, *,
                  token_ids: Sequence[int] | None = None, adapter_id: str = "",
                  cache_salt: str = "", reader_abi: Mapping[str, int] | None = None
                  ) -> Resumable:
        """A router's question (one ``Resumable`` RPC): the tokens of the prompt (its hashes,
        or its token ids hashed by the service) hkv certifies for resuming, per tier, and why
        it stops there. One partition's answer; a partitioned deployment asks through
        ``hkv_service.core.resumable.resumable`` over its partitioned lookups."""
        if (block_hashes is None) == (token_ids is None):
            raise InvalidInput("resumable: give block_hashes or token_ids (one of them)")
        req = pb.ResumableRequest(adapter_id=adapter_id, cache_salt=cache_salt)
        if block_hashes is not None:
            req.packed_hashes = PackedHashes.of(block_hashes).data
        else:
            req.token_ids = np.asarray(token_ids, dtype="<i4").tobytes()
        for group, fp in (reader_abi or {}).items():
            req.reader_abi[group] = fp
        return codec.decode_resumable(self._call("Resumable", req, idempotent=True))

    def transition_many(self, items: Sequence[api.ObjectTransitions | TransitionItem]
                        ) -> list[api.TransitionResult | HkvError]:
        """One ``TransitionMany`` RPC: items in order, each item's events in order and all
        or none of them (a :class:`TransitionItem` is an item of one event). A refused item
        comes back as its domain error, an IllegalTransition with the refused move's fields;
        a malformed one rejects the call (InvalidInput) with nothing applied."""
        req = pb.TransitionManyRequest()
        for it in items:
            codec.encode_object_transitions(_as_item(it), req.items.add())
        return _outcomes(self._call("TransitionMany", req, idempotent=False))

    def transition(self, object_id: ObjectId | int, event: Event, params: api.Params | None = None,
                   generation: int | None = None) -> api.TransitionResult:
        req = pb.TransitionRequest()
        msg = req.items.add(object_id=object_id, event=codec.EVENTS.to_pb[event])
        if params is not None:
            codec.encode_params(params, msg)
        if generation is not None:
            msg.generation = generation
        (out,) = _outcomes(self._call("Transition", req, idempotent=False))
        if isinstance(out, HkvError):
            try:
                raise out
            finally:  # (else this frame holds the error whose traceback holds this frame)
                del out
        return out

    def evict(self, object_id: ObjectId | int) -> None:
        self._call("Evict", pb.EvictRequest(object_id=object_id), idempotent=False)

    def begin_offload(self, object_id: ObjectId | int, disk_owner: str) -> api.Handle:
        req = pb.BeginOffloadRequest(object_id=object_id, disk_owner=disk_owner)
        return codec.decode_handle(self._call("BeginOffload", req, idempotent=False).handle)

    def begin_load(self, object_id: ObjectId | int, owner: str | None = None) -> api.Handle:
        req = pb.BeginLoadRequest(object_id=object_id, owner=owner or "")
        return codec.decode_handle(self._call("BeginLoad", req, idempotent=False).handle)

    # ---- lookup -------------------------------------------------------------------------

    def lookup_many(self, requests: Sequence[api.LookupRequest]) -> list[api.Match]:
        req = pb.LookupBatchRequest()
        for r in requests:
            codec.encode_lookup(r, req.requests.add())
        leased = any(r.lease_ttl_s > 0 for r in requests)
        resp = self._call("Lookup", req, idempotent=not leased)
        return [codec.decode_match(m) for m in resp.matches]

    def lookup(self, req: api.LookupRequest) -> api.Match:
        return self.lookup_many([req])[0]

    def lookup_stream(self, batches: Iterable[Sequence[api.LookupRequest]],
                      timeout_s: float | None = None) -> Iterator[list[api.Match] | HkvError]:
        """One result per batch, in order, over one bidirectional stream."""
        def requests() -> Iterator[Any]:
            for tag, batch in enumerate(batches):
                msg = pb.LookupStreamRequest(tag=tag)
                for r in batch:
                    codec.encode_lookup(r, msg.requests.add())
                yield msg

        stream = self._stub.LookupStream(requests(), timeout=timeout_s,
                                         metadata=self._metadata)
        try:
            for resp in stream:
                yield (_from_item_error(resp.error) if resp.HasField("error")
                       else [codec.decode_match(m) for m in resp.matches])
        except grpc.RpcError as err:
            raise _from_rpc_error(err) from None
        finally:
            stream.cancel()

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        # not idempotent: a retried call would record its offers twice
        req = pb.AdmitSaveRequest(block_hashes=block_hashes, needed=needed,
                                  offered_from=offered_from)
        return int(self._call("AdmitSave", req, idempotent=False).admitted)

    # ---- leases, reads, captures --------------------------------------------------------

    def release_lease(self, lease_id: LeaseId | int) -> None:
        self._call("ReleaseLease", pb.ReleaseLeaseRequest(lease_id=lease_id), idempotent=False)

    def check_read(self, handle: api.Handle, lease_id: LeaseId | int | None = None) -> None:
        req = pb.CheckReadRequest(handle=codec.encode_handle(handle))
        if lease_id is not None:
            req.lease_id = lease_id
        self._call("CheckRead", req, idempotent=True)

    def register_capture(self, handles: Sequence[api.Handle]) -> tuple[CaptureId, int]:
        req = pb.RegisterCaptureRequest(handles=[codec.encode_handle(h) for h in handles])
        resp = self._call("RegisterCapture", req, idempotent=False)
        return CaptureId(resp.capture_id), int(resp.topology_epoch)

    def release_capture(self, capture_id: CaptureId | int) -> None:
        self._call("ReleaseCapture", pb.ReleaseCaptureRequest(capture_id=capture_id),
                   idempotent=False)

    def capture_status(self, capture_id: CaptureId | int) -> tuple[bool, int]:
        resp = self._call("CaptureStatus", pb.CaptureStatusRequest(capture_id=capture_id),
                          idempotent=True)
        return bool(resp.valid), int(resp.topology_epoch)

    # ---- watch and stats ----------------------------------------------------------------

    def watch(self, from_seq: int = 0, timeout_s: float | None = None
              ) -> Iterator[api.TransitionEvent]:
        """Events with seq > from_seq until ``timeout_s`` passes (DEADLINE_EXCEEDED ends the
        iteration quietly) or the caller stops iterating."""
        stream = self._stub.Watch(pb.WatchRequest(from_seq=from_seq), timeout=timeout_s,
                                  metadata=self._metadata)
        try:
            for resp in stream:
                yield from (codec.decode_event(ev) for ev in resp.events)
        except grpc.RpcError as err:
            call: Any = err
            if call.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                   grpc.StatusCode.CANCELLED):
                raise _from_rpc_error(err) from None
        finally:
            stream.cancel()

    def stats(self) -> dict[str, object]:
        return codec.stats_to_dict(self._call("Stats", pb.StatsRequest(), idempotent=True))
