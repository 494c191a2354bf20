"""Residency for routers: when an object becomes readable in a tier, and when it stops.

A prefix-aware router (llm-d, Dynamo) keeps which blocks each replica holds from KV events.
hkv's transition log (``core/events.py``) already holds every state any object reaches:
every path that changes a record goes through ``Tables.apply`` (or a confirm), and both log.
So the feed reads the log and never touches the write paths: a service that publishes
events does no more work under its lock per write than one that does not.

For each logged (record, state reached) the feed compares the tiers the object is resident
in now with the tiers it last told of::

    tier    resident while                                           medium
    memory  its kind's ready state (contracts.READY_STATES), or a    the pool's device:
            DISK copy loaded back and verified (ON_DISK_READY)       CPU, GPU
    disk    a DISK copy committed: ON_DISK, ON_DISK_INFLIGHT,         DISK
            ON_DISK_READY (OFFLOADING is not at rest yet)

A tier gained is a stored change, a tier lost a removed one (with the medium it was stored
under). Every way an object stops being readable reaches a state outside its tiers: EVICTED,
LOST (a lost owner's records as the reaper buries them, a slice at a time), CORRUPT,
DROP_COPY / COPY_LOST / LOAD_FAILED (a DISK object's memory copy gone, its disk copy kept).

The log is bounded. When it dropped entries the feed had not read yet, the feed starts over:
the batch is ``cleared`` (forget all this stream said before), and it and the next ones
store every object resident now, walking the object table a slice at a time (parents
before children within a slice). A new feed starts the same way. Under the view's lock the
feed only copies (record, state, owner); it builds changes outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .contracts import READY_STATES
from .ids import BlockHash, ObjectId, ShardId
from .layout import AT_BOUNDARY, Column, Layout
from .records import ObjRecord, PrefixEntry
from .states import Kind, State
from .tables import Tables

__all__ = ["DISK_MEDIUM", "BlockChange", "FeedBatch", "ResidencyFeed", "Taken", "resident_tiers"]

MEMORY, DISK = 1, 2  # tier bits
DISK_MEDIUM = "DISK"
_DEVICE_MEDIUM = {"cpu": "CPU", "cuda": "GPU"}  # torch device type -> vLLM's medium name
_DISK_AT_REST = frozenset({State.ON_DISK, State.ON_DISK_INFLIGHT, State.ON_DISK_READY})


def resident_tiers(kind: Kind, state: State) -> int:
    """The tiers (bits) an object of ``kind`` in ``state`` is readable in."""
    if kind is Kind.DISK:
        return (DISK if state in _DISK_AT_REST else 0) | (
            MEMORY if state is State.ON_DISK_READY else 0)
    return MEMORY if state in READY_STATES[kind] else 0


@dataclass(frozen=True, slots=True)
class BlockChange:
    """One object became readable in a tier (``stored``) or stopped being readable there.

    ``span``: the hash blocks the object's block covers, oldest first; the object ends at
    ``span[-1]`` (its entry). A group's block of ``block_size`` tokens covers
    ``block_size / H`` hash blocks; a tail or recurrent state (needed at one boundary) covers
    the LCM block before it. ``parent``: the hash before ``span`` (None at the chain's
    start, or where the view does not know it)."""

    stored: bool
    medium: str  # "CPU", "GPU" (memory, as the owner's pool is) or "DISK"
    column: int
    span: tuple[BlockHash, ...]
    parent: BlockHash | None
    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class FeedBatch:
    changes: tuple[BlockChange, ...]
    cleared: bool = False  # the feed started over: forget all it said before this batch
    dropped: int = 0  # log entries lost before the feed read them (why it started over)


# What the feed copies under the view's lock: a record, the state it reached, its memory owner
_Item = tuple[ObjRecord, State, ShardId]


@dataclass(frozen=True, slots=True)
class Taken:
    """One poll's copy of the log (or of a snapshot slice), taken under the view's lock."""

    items: list[_Item]
    cleared: bool = False
    dropped: int = 0


@dataclass(slots=True)
class ResidencyFeed:
    """The feed's cursor and what it last told per object (object -> tier bits, memory
    medium). :meth:`take` runs under the view's lock and only copies (a few hundred
    nanoseconds an entry); :meth:`changes` turns the copy into changes outside it, on the
    publisher's thread alone. ``CacheState.poll_residency`` calls both.

    Starting over walks the object table in slices of ``limit`` slots, one lock hold each,
    from the log position it started at: an object that changes meanwhile is also in the log
    after that position, so it is told again, ending in its latest state (at least once)."""

    seq: int | None = None  # the last log entry read (None: not started)
    held: dict[ObjectId, tuple[int, str]] = field(default_factory=dict)
    snap_slot: int = -1  # next slot of a snapshot walk (-1: none under way)

    def take(self, t: Tables, limit: int) -> Taken:
        log = t.log
        if self.seq is None or (self.snap_slot < 0 and self.seq + 1 < log.first_seq):
            dropped = 0 if self.seq is None else log.first_seq - 1 - self.seq
            self.seq, self.snap_slot = log.last_seq, 0
            return Taken(self._slice(t, limit), cleared=True, dropped=dropped)
        if self.snap_slot >= 0:
            return Taken(self._slice(t, limit))
        items = [(rec, state, rec.shard) for rec, state in log.records_since(self.seq, limit)]
        self.seq += len(items)
        return Taken(items)

    def _slice(self, t: Tables, limit: int) -> list[_Item]:
        start = self.snap_slot
        stop = min(start + limit, t.objects.slot_count)
        self.snap_slot = stop if stop < t.objects.slot_count else -1
        return [(r, r.state, r.shard) for r in t.objects.slots(start, stop) if not t.dead(r)]

    def changes(self, taken: Taken, t: Tables) -> FeedBatch:
        """Outside the lock: what ``taken`` changed of what was told (``t``'s layout is fixed;
        its owner table is only read, one lookup per memory store)."""
        if taken.cleared:
            self.held = {}
        items = taken.items
        if taken.cleared or self.snap_slot >= 0:  # a snapshot slice: parents first
            items = sorted(items, key=lambda item: item[0].entry.depth)
        out: list[BlockChange] = []
        for rec, state, shard in items:
            self._note(t, rec, resident_tiers(rec.kind, state), shard, out)
        return FeedBatch(tuple(out), taken.cleared, taken.dropped)

    def _note(self, t: Tables, rec: ObjRecord, now: int, shard: ShardId,
              out: list[BlockChange]) -> None:
        oid = rec.object_id
        was, medium = self.held.get(oid, (0, ""))
        if now == was:
            return
        gained, lost = now & ~was, was & ~now
        if gained & MEMORY:
            medium = _memory_medium(t, shard, rec.column)
        if now:
            self.held[oid] = (now, medium)
        else:
            self.held.pop(oid, None)
        column = t.layout.columns[rec.column]
        span, parent = _span(rec.entry, _blocks_of(column, t.layout))
        for bit, stored in ((lost, False), (gained, True)):
            for tier, name in ((MEMORY, medium), (DISK, DISK_MEDIUM)):
                if bit & tier:
                    out.append(BlockChange(stored, name, rec.column, span, parent, oid))


def _memory_medium(t: Tables, shard: ShardId, column: int) -> str:
    owner = t.owners.get(shard)
    pool = owner.pools.get(column) if owner is not None else None
    device = pool.config.device if pool is not None else "cpu"
    return _DEVICE_MEDIUM.get(device, device.upper())


def _blocks_of(column: Column, layout: Layout) -> int:
    """Hash blocks one object of ``column`` covers."""
    tokens = layout.lcm if column.kind in AT_BOUNDARY else column.group.block_size
    return max(1, tokens // layout.hash_block)


def _span(entry: PrefixEntry, blocks: int) -> tuple[tuple[BlockHash, ...], BlockHash | None]:
    hashes = [entry.block_hash]
    e: PrefixEntry | None = entry.parent
    while e is not None and len(hashes) < blocks:
        hashes.append(e.block_hash)
        e = e.parent
    return tuple(reversed(hashes)), (e.block_hash if e is not None else None)
