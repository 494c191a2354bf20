"""The workers' boundaries: what they need from the metadata service, and the small typed
values that cross the data plane (Ray) between inference workers and shards.

:class:`MetadataPort` is a Protocol whose methods mirror
:class:`hkv_service.core.state_view.CacheState` (same names, arguments, return types);
``hkv_service.client.MetadataClient`` implements it over gRPC, :mod:`workers.local` in-process
or through a Ray actor. Everything else here is a frozen dataclass or a ``StrEnum`` so it
pickles small and plain (bytes travel beside it as numpy arrays).

Disk records carry a fixed 64-byte *tag* in front of the payload (covered by the disk tier's
checksum), so a restarted shard can tell the metadata service what its disk holds::

    [0, 4)  magic b"HKVT"   [4, 5) format   [5, 6) has parent   [6, 8) reserved
    [8, 24) parent hash     [24, 28) depth (u32)   [28, 32) payload length (u32)
    [32, 40) version (u64)  [40, 48) lo (u64)      [48, 56) hi (u64)
    [56, 64) route (u64): the chain's route key, its metadata partition (0 before partitions)
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload, runtime_checkable

import numpy as np

from hkv_service.core.api import (
    Allocation,
    AllocRequest,
    Handle,
    LookupRequest,
    Match,
    ObjectReport,
    ObjectTransitions,
    Params,
    PoolConfig,
    TransitionResult,
)
from hkv_service.core.errors import HkvError
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.spec import CacheSpec
from hkv_service.core.states import Event, Kind

__all__ = [
    "TAG",
    "BlockTag",
    "Commit",
    "ItemResult",
    "MetadataPort",
    "Outcome",
    "PackedRead",
    "commit_bytes",
    "decode_tagged",
    "encode_tagged",
    "payload_bytes",
    "tag_bytes",
]


@runtime_checkable
class MetadataPort(Protocol):
    def get_spec(self) -> CacheSpec: ...

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig],
                       instance: int = 0) -> int: ...

    def heartbeat(self, owner: ShardId, incarnation: int) -> None: ...

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None: ...

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int
                ) -> int: ...

    def confirm_objects(self, owner: ShardId, reports: Sequence[ObjectReport],
                        incarnation: int) -> list[ObjectId | None]: ...

    def allocate(
        self,
        block_hashes: Sequence[BlockHash],
        requests: Sequence[AllocRequest],
        owner: ShardId | None = None,
        first_block: int = 0,  # the hashes' first depth: a range of a split chain
    ) -> list[Allocation]: ...

    def transition(
        self,
        object_id: ObjectId,
        event: Event,
        params: Params | None = None,
        generation: int | None = None,
    ) -> TransitionResult: ...

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        """Each item's events in order, all or none of them, in one call (see
        ``CacheState.transition_many``): a refused item comes back as its error."""
        ...

    def evict(self, object_id: ObjectId) -> None: ...

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle: ...

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle: ...

    def lookup(self, req: LookupRequest) -> Match: ...

    def release_lease(self, lease_id: LeaseId) -> None: ...

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None: ...


class Outcome(enum.StrEnum):
    """Per-item result of a data-plane call. Anything but OK means: recompute this block."""

    OK = "OK"
    STALE = "STALE"  # generation moved on (block freed or reused): stale, recompute
    LOST = "LOST"  # the metadata service no longer knows the object (owner lost, evicted)
    NOT_READABLE = "NOT_READABLE"  # the object is not in a state that allows this
    ADMISSION = "ADMISSION"  # refused by an admission cap; retry later
    DISK_FULL = "DISK_FULL"  # the disk tier's budget or file system is full
    CORRUPT = "CORRUPT"  # checksum mismatch: quarantined, marked CORRUPT, never served
    MISSING = "MISSING"  # the disk record is gone (evicted by the tier's LRU)
    NOT_HERE = "NOT_HERE"  # this shard's disk tier does not hold the record
    UNAVAILABLE = "UNAVAILABLE"  # the shard holding the bytes died or timed out
    FAILED = "FAILED"  # anything else; ``detail`` says what


@dataclass(frozen=True, slots=True)
class ItemResult:
    outcome: Outcome
    detail: str = ""
    handle: Handle | None = None  # load: the memory handle the bytes now sit behind
    version: int = 0  # write: KV version issued by a compressed WRITE_DONE

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


class PackedRead(Sequence["np.ndarray | ItemResult"]):
    """A shard's answer to ``read_blocks``: a few buffers instead of one Ray object per block.
    Small blocks are packed into one buffer (per-object overhead dominates them); large ones
    travel as their own zero-copy views. ``spans[i]`` is ``(buffer, offset, length)`` or the
    ``ItemResult`` of a handle that could not be read. Indexing yields a view or the result."""

    def __init__(
        self, buffers: list[np.ndarray], spans: list[tuple[int, int, int] | ItemResult]
    ) -> None:
        self.buffers = buffers
        self.spans = spans

    def __len__(self) -> int:
        return len(self.spans)

    @overload
    def __getitem__(self, i: int) -> np.ndarray | ItemResult: ...
    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray | ItemResult]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        span = self.spans[i]
        if isinstance(span, ItemResult):
            return span
        buf, start, length = span
        return self.buffers[buf][start : start + length]


@dataclass(frozen=True, slots=True)
class BlockTag:
    """Where an object sits in the prefix tree; what ``ObjectReport`` needs after a restart."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    depth: int
    version: int = 0
    lo: int = 0
    hi: int = 0
    route: int = 0  # core/partitions.route_key of the chain's root (its metadata partition)


@dataclass(frozen=True, slots=True)
class Commit:
    """Transitions a shard reports after a write is readable, in order (e.g. WRITE_DONE then
    INDEXER_SYNC). ``params[i]`` goes with ``events[i]``."""

    events: tuple[Event, ...]
    params: tuple[Params | None, ...] = ()

    def params_at(self, i: int) -> Params | None:
        return self.params[i] if i < len(self.params) else None

    def merged(self) -> Params:
        """Every parameter the commit sets, the last given of each (what the object ends
        with: its version, SWA range, tail length)."""
        out = Params()
        for p in self.params:
            if p is not None:
                out = Params(*(new if new is not None else old for new, old in zip(
                    (p.version, p.lo, p.hi, p.tail_len, p.expect_seq),
                    (out.version, out.lo, out.hi, out.tail_len, out.expect_seq), strict=True)))
        return out


def commit_bytes(layout: Layout, column: int, depth: int | None,
                 commit: Commit | None) -> int | None:
    """Exactly the bytes a write of ``column`` committed with ``commit`` must carry
    (:meth:`Layout.object_bytes`: an SWA block's range and a tail's length come from the
    commit's parameters, the last given wins). None where that cannot be told: a range or a
    tail length that needs the block's depth, and no depth known."""
    m = commit.merged() if commit else Params()
    lo, hi, tail_len = m.lo, m.hi, m.tail_len
    kind = layout.columns[column].kind
    if kind is Kind.SWA and lo is None and hi is None:
        return layout.columns[column].nbytes  # the whole block: no depth needed
    if kind is Kind.TAIL and tail_len is not None:
        return layout.object_bytes(column, 0, tail_len=tail_len)
    if kind in (Kind.SWA, Kind.TAIL) and depth is None:
        return None
    return layout.object_bytes(column, depth or 0, lo, hi, tail_len)


def payload_bytes(data: Any) -> int:
    """Bytes in a block's data: a numpy array, a torch tensor or anything bytes-like."""
    nbytes = getattr(data, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else memoryview(data).nbytes


def tag_bytes(layout: Layout, column: int, tag: BlockTag) -> int:
    """Exactly the bytes of the object a disk record's tag describes (its payload's size)."""
    if layout.columns[column].kind is Kind.TAIL:
        return layout.object_bytes(column, tag.depth, tail_len=tag.hi)
    return layout.object_bytes(column, tag.depth, tag.lo, tag.hi)


TAG = struct.Struct("<4sBBH16sII QQQ Q")
_MAGIC = b"HKVT"
_NO_PARENT = bytes(16)
assert TAG.size == 64


def encode_tagged(tag: BlockTag, payload: Any) -> bytearray:
    """``tag header + payload`` in one buffer (one copy of the payload)."""
    view = memoryview(payload).cast("B")
    out = bytearray(TAG.size + len(view))
    TAG.pack_into(
        out, 0, _MAGIC, 1, tag.parent_hash is not None, 0, tag.parent_hash or _NO_PARENT,
        tag.depth, len(view), tag.version, tag.lo, tag.hi, tag.route,
    )
    out[TAG.size :] = view
    return out


def decode_tagged(block_hash: BlockHash, record: Any) -> tuple[BlockTag, memoryview]:
    """The tag and payload view of a verified record; ValueError if the framing is wrong."""
    view = memoryview(record).cast("B")
    if len(view) < TAG.size:
        raise ValueError(f"record of {len(view)} bytes is shorter than its tag")
    magic, fmt, has_parent, _, parent, depth, n, version, lo, hi, route = TAG.unpack_from(view)
    if magic != _MAGIC or fmt != 1 or len(view) != TAG.size + n:
        raise ValueError("record tag is malformed (magic, format or length)")
    tag = BlockTag(
        block_hash, BlockHash(bytes(parent)) if has_parent else None, depth, version, lo, hi,
        route,
    )
    return tag, view[TAG.size :]
