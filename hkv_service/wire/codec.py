"""The wire format: core types <-> hkv.v1 protobuf messages, both directions, in one place.

The server decodes requests and encodes results here; the client does the reverse with the
same functions, so a round trip is tested once. Enums cross as ``<ENUM>_<core value>``
(``Kind.SWA`` <-> ``KIND_SWA``); number 0 and numbers this build does not know are rejected
with :class:`InvalidInput`, never guessed.

A Match's handles are packed per column (see ``HandleColumn`` in the proto)::

    Match.handles[c] = HandleColumn{group, column, kind, nbytes, abi,   <- once per column
                                    strides[shard] (address = block * stride),
                                    records: n x 22 bytes (object_id u64, generation u64,
                                             block i32, shard u16 -> Match.shard_names)}
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from hkv_service.core.api import (
    Allocation,
    Downgrade,
    Handle,
    HandleColumn,
    LookupRequest,
    Match,
    ObjectReport,
    ObjectTransitions,
    Params,
    TransitionEvent,
    TransitionResult,
)
from hkv_service.core.errors import BadHash, IllegalTransition, InvalidInput
from hkv_service.core.ids import (
    BlockHash,
    GroupName,
    LeaseId,
    ObjectId,
    PackedHashes,
    ShardId,
)
from hkv_service.core.resumable import Resumable, Stop
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, Reason, State
from hkv_service.proto_gen.hkv.v1 import hkv_pb2 as pb

__all__ = [
    "EVENTS",
    "KINDS",
    "REASONS",
    "STATES",
    "EnumCodec",
    "batch_reply",
    "decode_handle",
    "decode_lookup",
    "decode_match",
    "decode_object_transitions",
    "decode_params",
    "decode_refusal",
    "decode_report",
    "decode_result",
    "encode_handle",
    "encode_lookup",
    "encode_match",
    "encode_object_transitions",
    "encode_refusal",
    "encode_report",
    "encode_result",
    "install_encoder",
    "match_bytes",
    "repeated_field",
]

E = TypeVar("E", bound=enum.Enum)


class EnumCodec(Generic[E]):
    """Core StrEnum <-> proto enum number, checked complete at import."""

    def __init__(self, core: type[E], proto: Any, prefix: str) -> None:
        self.name = prefix.rstrip("_").lower()
        self.to_pb: dict[E, int] = {m: proto.Value(prefix + str(m.value)) for m in core}
        self.from_pb: dict[int, E] = {v: k for k, v in self.to_pb.items()}

    def decode(self, number: int, where: str) -> E:
        value = self.from_pb.get(number)
        if value is None:
            raise InvalidInput(f"{where}: {self.name} value {number} is unknown or unspecified")
        return value


KINDS = EnumCodec(Kind, pb.Kind, "KIND_")
STATES = EnumCodec(State, pb.State, "STATE_")
EVENTS = EnumCodec(Event, pb.Event, "EVENT_")
REASONS = EnumCodec(Reason, pb.Reason, "REASON_")


# ---- handles --------------------------------------------------------------------------------

def encode_handle(h: Handle, out: Any = None) -> Any:
    msg = pb.Handle() if out is None else out
    msg.object_id, msg.generation, msg.shard, msg.column = (
        h.object_id, h.generation, h.shard, h.column)
    msg.block, msg.kind, msg.group, msg.nbytes = h.block, KINDS.to_pb[h.kind], h.group, h.nbytes
    msg.abi_fingerprint, msg.address = h.abi_fingerprint, h.address
    return msg


def decode_handle(msg: Any, where: str = "handle") -> Handle:
    return Handle(
        ObjectId(msg.object_id), msg.generation, ShardId(msg.shard), msg.column, msg.block,
        KINDS.decode(msg.kind, where), GroupName(msg.group), msg.nbytes, msg.abi_fingerprint,
        msg.address,
    )


def _encode_column(col: HandleColumn, n_names: int, out: Any) -> None:
    out.group, out.column, out.kind = col.name, col.column, KINDS.to_pb[col.kind]
    out.nbytes, out.abi_fingerprint = col.nbytes, col.abi_fingerprint
    out.records = col.records  # already the wire format: one copy, no per-handle work
    # the match's name table may be longer than this column's (append-only): pad with 0
    out.strides.extend(col.strides + (0,) * (n_names - len(col.strides)))


def _decode_column(msg: Any, shard_names: tuple[ShardId, ...]) -> HandleColumn:
    """Checked: whole records, every shard inside the table, one stride per shard."""
    return HandleColumn(
        msg.column, GroupName(msg.group), KINDS.decode(msg.kind, "handle column"), msg.nbytes,
        msg.abi_fingerprint, msg.records, shard_names, tuple(msg.strides),
    ).check()


# ---- lookup ---------------------------------------------------------------------------------

def encode_match(m: Match, out: Any) -> Any:
    """Copies ``m.columns`` (the packed snapshot the lookup took) into the reply."""
    out.usable_tokens, out.matched_tokens = m.usable_tokens, m.matched_tokens
    out.lease_id = m.lease_id or 0
    # every column of one lookup indexes the same append-only table: take the longest
    names = max((c.shard_names for c in m.columns.values()), key=len, default=())
    for col in m.columns.values():
        if len(col):
            _encode_column(col, len(names), out.handles.add())
    for d in m.downgrades:
        out.downgrades.add(reason=REASONS.to_pb[d.reason], group=d.group or "",
                           position=d.position)
    out.shard_names.extend(names)
    return out


def match_bytes(m: Match) -> bytes:
    """``m`` as a serialized ``Match``: out of the memo's reply when it has one (see
    :func:`install_encoder`), else encoded now."""
    reply = m.memo.wire if m.memo is not None else None  # None too once the memo is dropped
    if reply is not None:
        return _unframe(reply)
    return encode_match(m, pb.Match()).SerializeToString()  # type: ignore[no-any-return]


def batch_reply(matches: Sequence[Match]) -> bytes:
    """A serialized ``LookupBatchResponse`` of ``matches``: a single memo-answered match's is
    the memo's own bytes, no copy (a 2,048-block reply is ~113 KB)."""
    if len(matches) == 1 and matches[0].memo is not None:
        reply = matches[0].memo.wire
        if reply is not None:
            return reply
    return repeated_field(1, [match_bytes(m) for m in matches])


def install_encoder(state: CacheState) -> None:
    """Have ``state``'s lookup memo keep each memoised match encoded as well, as the one-match
    ``LookupBatchResponse`` a repeated lookup is answered with."""
    state.memo.encoder = lambda m: repeated_field(1, [match_bytes(m)])


def _unframe(field: bytes) -> bytes:
    """The message inside one length-delimited field (tag byte, varint length, message)."""
    length, at = 0, 1
    for shift in range(0, 64, 7):
        byte = field[at]
        at += 1
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
    assert at + length == len(field), "one whole field"
    return field[at:]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTE[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_BYTE = [bytes((i,)) for i in range(0x80)]


def repeated_field(number: int, messages: list[bytes]) -> bytes:
    """Serialized messages as the repeated message field ``number`` of an enclosing message:
    exactly what protobuf writes for them (tag, length, bytes: wire type 2, per item)."""
    tag = _varint(number << 3 | 2)
    parts: list[bytes] = []
    for m in messages:
        parts += (tag, _varint(len(m)), m)
    return b"".join(parts)


def decode_match(msg: Any) -> Match:
    names = tuple(ShardId(n) for n in msg.shard_names)
    columns = {c.group: _decode_column(c, names) for c in msg.handles}
    downgrades = tuple(
        Downgrade(REASONS.decode(d.reason, "downgrade"), GroupName(d.group) if d.group else None,
                  d.position)
        for d in msg.downgrades
    )
    lease = LeaseId(msg.lease_id) if msg.lease_id else None
    return Match(msg.usable_tokens, msg.matched_tokens, downgrades, lease, columns)


def encode_lookup(req: LookupRequest, out: Any) -> Any:
    try:
        out.packed_hashes = PackedHashes.of(req.block_hashes).data  # one field, not n
    except BadHash:  # a malformed hash: sent as is, for the server to refuse with a status
        out.block_hashes.extend(req.block_hashes)
    if req.resume_tokens is not None:
        out.resume_tokens = req.resume_tokens
    for name, fp in (req.reader_abi or {}).items():
        out.reader_abi[name] = fp
    out.alignment = req.alignment
    out.lease_ttl_s = req.lease_ttl_s
    out.match_only = not req.handles
    out.first_block = req.first_block
    out.open_end = req.open_end
    return out


def decode_lookup(msg: Any, index: int | None = None) -> LookupRequest:
    """``index``: the item's place in a batch, named in errors (formatted only on error: this
    runs on every lookup)."""
    ttl = msg.lease_ttl_s
    if not math.isfinite(ttl) or ttl < 0:
        raise InvalidInput(f"{_where(index)}: lease_ttl_s must be a finite number >= 0, "
                           f"got {ttl}")
    hashes: Sequence[BlockHash]
    packed = msg.packed_hashes  # each read of a bytes field copies it: once
    if packed:
        if len(msg.block_hashes):
            raise InvalidInput(f"{_where(index)}: give the prefix as block_hashes or as "
                               "packed_hashes, not both")
        try:
            hashes = PackedHashes(packed)
        except BadHash as err:
            raise BadHash(f"{_where(index)}: {err}") from None
    else:
        hashes = list(msg.block_hashes)  # bytes already (BlockHash is a NewType)
    return LookupRequest(
        hashes,
        msg.resume_tokens if msg.HasField("resume_tokens") else None,
        dict(msg.reader_abi) if len(msg.reader_abi) else None,
        msg.alignment or 1,
        ttl,
        not msg.match_only,
        msg.first_block,
        msg.open_end,
    )


def _where(index: int | None) -> str:
    return "lookup" if index is None else f"lookup {index}"


# ---- transitions ----------------------------------------------------------------------------

_PARAM_FIELDS = ("version", "lo", "hi", "tail_len", "expect_seq")


def decode_params(msg: Any, where: str) -> Params:
    values: dict[str, int | None] = {
        f: getattr(msg, f) if msg.HasField(f) else None for f in _PARAM_FIELDS}
    for f in ("lo", "hi", "tail_len"):
        value = values[f]
        if value is not None and value < 0:
            raise InvalidInput(f"{where}: {f} must not be negative, got {value}")
    lo, hi = values["lo"], values["hi"]
    if lo is not None and hi is not None and lo > hi:
        raise InvalidInput(f"{where}: lo {lo} is greater than hi {hi}; a range needs lo <= hi")
    return Params(**values)


def encode_params(p: Params, out: Any) -> Any:
    for f in _PARAM_FIELDS:
        value = getattr(p, f)
        if value is not None:
            setattr(out, f, value)
    return out


def encode_object_transitions(item: ObjectTransitions, out: Any) -> Any:
    out.object_id = item.object_id
    if item.generation is not None:
        out.generation = item.generation
    for k, event in enumerate(item.events):
        step = out.steps.add(event=EVENTS.to_pb[event])
        params = item.params[k] if k < len(item.params) else None
        if params is not None:
            encode_params(params, step)
    return out


def decode_object_transitions(msg: Any, where: str) -> ObjectTransitions:
    """Checked: at least one step, known events, ranges that can be ranges."""
    if not msg.steps:
        raise InvalidInput(f"{where}: no steps; an item reports at least one event of its "
                           "object")
    steps = [(EVENTS.decode(s.event, f"{where} step {k}"),
              decode_params(s, f"{where} step {k}")) for k, s in enumerate(msg.steps)]
    return ObjectTransitions(ObjectId(msg.object_id), tuple(e for e, _ in steps),
                             tuple(p for _, p in steps),
                             msg.generation if msg.HasField("generation") else None)


def encode_refusal(err: IllegalTransition, out: Any) -> Any:
    """The refused move of ``err`` into an ``ItemError`` (what is known of it)."""
    if err.state is not None:
        out.state = STATES.to_pb[err.state]
    if err.event is not None:
        out.event = EVENTS.to_pb[err.event]
    out.precondition = err.precondition or ""
    if err.index is not None:
        out.event_index = err.index
    return out


def decode_refusal(msg: Any, err: IllegalTransition) -> IllegalTransition:
    """``err`` with the refused move an ``ItemError`` carries (an unset or unknown enum
    number: not known, None)."""
    err.state, err.event = STATES.from_pb.get(msg.state), EVENTS.from_pb.get(msg.event)
    err.precondition = msg.precondition or None
    err.index = msg.event_index if msg.HasField("event_index") else None
    return err


def encode_result(r: TransitionResult, out: Any) -> Any:
    out.object_id, out.state, out.version, out.seq = (
        r.object_id, STATES.to_pb[r.state], r.version, r.seq)
    return out


def decode_result(msg: Any) -> TransitionResult:
    return TransitionResult(ObjectId(msg.object_id), STATES.decode(msg.state, "result"),
                            msg.version, msg.seq)


def encode_event(ev: TransitionEvent, out: Any) -> Any:
    out.seq, out.object_id, out.kind, out.state = (
        ev.seq, ev.object_id, KINDS.to_pb[ev.kind], STATES.to_pb[ev.state])
    out.column, out.block_hash, out.at = ev.column, ev.block_hash, ev.at
    return out


def decode_event(msg: Any) -> TransitionEvent:
    return TransitionEvent(msg.seq, ObjectId(msg.object_id), KINDS.decode(msg.kind, "event"),
                           STATES.decode(msg.state, "event"), msg.column,
                           BlockHash(msg.block_hash), msg.at)


def decode_allocations(msg: Any) -> list[Allocation]:
    versions = list(msg.versions) or [0] * len(msg.handles)  # absent from an older server
    return [Allocation(decode_handle(h), bool(e), STATES.decode(s, "allocation"), v)
            for h, e, s, v in zip(msg.handles, msg.existing, msg.states, versions, strict=True)]


# ---- confirm --------------------------------------------------------------------------------

def encode_report(r: ObjectReport, out: Any) -> Any:
    out.block_hash, out.parent_hash, out.depth = r.block_hash, r.parent_hash or b"", r.depth
    out.column, out.state, out.block, out.generation = (
        r.column, STATES.to_pb[r.state], r.block, r.generation)
    out.version, out.lo, out.hi = r.version, r.lo, r.hi
    return out


def decode_report(msg: Any, where: str) -> ObjectReport:
    if msg.lo < 0 or msg.hi < 0 or msg.lo > msg.hi:
        raise InvalidInput(f"{where}: range [{msg.lo}, {msg.hi}) needs 0 <= lo <= hi")
    return ObjectReport(
        BlockHash(msg.block_hash), BlockHash(msg.parent_hash) if msg.parent_hash else None,
        msg.depth, msg.column, STATES.decode(msg.state, where), msg.block, msg.generation,
        msg.version, msg.lo, msg.hi,
    )


def stats_to_dict(msg: Any) -> dict[str, object]:
    out: dict[str, object] = {f: dict(getattr(msg, f)) for f in
                              ("transitions", "downgrades", "lookups", "evictions", "events",
                               "gauges")}
    out["partition"] = msg.partition or "0/1"
    out["range_blocks"] = msg.range_blocks
    return out


def encode_stats(stats: Mapping[str, object], out: Any) -> Any:
    for f in ("transitions", "downgrades", "lookups", "evictions", "events", "gauges"):
        value = stats.get(f, {})
        assert isinstance(value, Mapping)
        getattr(out, f).update({str(k): int(v) for k, v in value.items()})
    out.partition = str(stats.get("partition", "0/1"))
    out.range_blocks = int(stats.get("range_blocks", 0) or 0)  # type: ignore[call-overload]
    return out


def encode_resumable(r: Resumable, out: Any) -> Any:
    out.prompt_tokens, out.tokens, out.memory_tokens = r.prompt_tokens, r.tokens, \
        r.memory_tokens
    out.stop, out.memory_stop, out.lookups = r.stop.value, r.memory_stop.value, r.lookups
    out.reason = REASONS.to_pb[r.reason] if r.reason is not None else 0
    for d in r.downgrades:
        out.downgrades.add(reason=REASONS.to_pb[d.reason], group=d.group or "",
                           position=d.position)
    return out


def decode_resumable(msg: Any) -> Resumable:
    return Resumable(
        msg.prompt_tokens, msg.tokens, msg.memory_tokens, Stop(msg.stop),
        REASONS.decode(msg.reason, "resumable") if msg.reason else None, Stop(msg.memory_stop),
        tuple(Downgrade(REASONS.decode(d.reason, "downgrade"),
                        GroupName(d.group) if d.group else None, d.position)
              for d in msg.downgrades),
        msg.lookups)
