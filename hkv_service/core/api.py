"""The core's boundary: the values a caller hands the state view and gets back.

Everything outside the core takes these from here (the server's codec, the clients, the
workers, the demo, the benches); the state view itself is ``core.state_view.CacheState``,
and what every adapter of it promises is ``core.port.MetadataPort``. The values are frozen
(a ``NamedTuple`` where a plain tuple must do), so they cross threads, processes and Ray
calls as they are::

    config     StateConfig                       -> CacheState(spec, config)
    allocate   AllocRequest per slot             -> Allocation per slot
    transition Event + Params (ObjectTransitions) -> TransitionResult (or the error, per item)
    confirm    ObjectReport per object vouched   -> its new ObjectId, or None
    lookup     LookupRequest                     -> Match (packed Handles per column)
    watch                                        -> TransitionEvent
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from . import defaults
from .admission import AdmissionCap
from .allocator import PoolConfig
from .events import TransitionEvent
from .funnel import Downgrade, LookupRequest
from .ids import BlockHash, ObjectId
from .match import Match
from .partitions import Partition
from .records import Handle, HandleColumn
from .states import Event, State
from .transitions import Params

__all__ = [
    "MAX_TRANSITION_ITEMS",
    "AdmissionCap",
    "AllocRequest",
    "Allocation",
    "Downgrade",
    "Handle",
    "HandleColumn",
    "LookupRequest",
    "Match",
    "ObjectReport",
    "ObjectTransitions",
    "Params",
    "PoolConfig",
    "StateConfig",
    "TransitionEvent",
    "TransitionResult",
]


@dataclass(frozen=True, slots=True)
class StateConfig:
    admission: AdmissionCap = field(default_factory=AdmissionCap)
    max_lease_ttl_s: float = 60.0
    heartbeat_timeout_s: float = defaults.HEARTBEAT_TIMEOUT_S
    log_capacity: int = 8192  # bounded: Watch streams recent history only
    # owners registered at once (RegisterOwner beyond it: RESOURCE_EXHAUSTED); an owner's
    # per-block metadata grows with the blocks it uses, not the blocks it declares
    max_owners: int = defaults.MAX_OWNERS
    # Lookup memo (core/memo.py): results of lookups of >= memo_min_blocks hashes, kept until
    # anything on their path changes; bounded by count and bytes. 0 capacity or bytes: off.
    memo_capacity: int = 1024
    memo_max_bytes: int = defaults.LOOKUP_MEMO_MIB << 20
    memo_min_blocks: int = 32
    # Walk segments (core/segments.py): runs of this many blocks, certified once walked whole
    # twice, are taken whole by later walks of any prompt through them. 0: off; None: the
    # multiple of the layout's period nearest above DEFAULT_SEGMENT_BLOCKS (any spec works).
    segment_blocks: int | None = None
    # This view's place among the service's metadata partitions (core/partitions.py): it
    # holds only chains whose root routes here, and its ids and leases name it.
    partition: Partition = field(default_factory=Partition)
    # Chains are split across the partitions every this many blocks (core/partitions.py:
    # range k of a chain, depths [kR, (k+1)R), lives in the partition of its hash at depth
    # kR), so one hot root's continuations spread; 0: a chain lives whole in its root's.
    range_blocks: int = defaults.RANGE_BLOCKS


@dataclass(frozen=True, slots=True)
class AllocRequest:
    depth: int  # hash block index of the entry (the block ends at (depth+1)*H)
    column: str  # group name, or "<group>.tail"
    # Copy-on-write: the id of the object the caller saw in this slot and means to replace
    # with new bytes (0: none). If it still holds the slot it is retired first (EVICT: refused
    # while a reader leases or a graph captures it, and then it comes back ``existing``),
    # and a fresh object (new id, new block claim) is allocated: an object's bytes never
    # change under whoever may still name it.
    replace: int = 0


@dataclass(frozen=True, slots=True)
class Allocation:
    handle: Handle
    existing: bool  # True: a live object was already there (idempotent retry); don't rewrite
    state: State
    version: int = 0  # KV version of an existing COMPRESSED object (to sync its indexer)


@dataclass(frozen=True, slots=True)
class TransitionResult:
    object_id: ObjectId
    state: State
    version: int
    seq: int


class ObjectTransitions(NamedTuple):
    """One object's events for ``CacheState.transition_many``, applied in order, all or
    none; ``params[i]`` goes with ``events[i]`` (missing ones: none). A plain 4-tuple works."""

    object_id: ObjectId
    events: Sequence[Event]
    params: Sequence[Params | None] = ()
    generation: int | None = None  # checked once, before the first event


# Items one transition_many call may carry: the call holds the lock throughout (tens of
# microseconds an object), so this bounds the pause it makes every other caller wait.
MAX_TRANSITION_ITEMS = 4096


@dataclass(frozen=True, slots=True)
class ObjectReport:
    """An owner's account of an object it holds, for rebuilding the view after a restart."""

    block_hash: BlockHash  # the hash block the object ends at
    parent_hash: BlockHash | None  # None at depth 0
    depth: int
    column: str
    state: State  # a readable state (memory) or ON_DISK (disk tier)
    block: int = -1
    generation: int = 0
    version: int = 0
    lo: int = 0
    hi: int = 0
    # The chain's route key (core/partitions.route_key of its root): which metadata partition
    # a disk record's report goes to. Only a partitioned client reads it; 0 where unknown.
    route: int = 0
