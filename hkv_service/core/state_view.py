"""The one state view: every object, every prefix entry, every pool, lease and capture.

Allocation, transitions, eviction and lookup all read and write the same records, so there is
one state view, not two. Thread-safe: every public method holds one re-entrant lock for a few
microseconds (CPython's GIL serialises this work anyway; see docs/architecture.md for the
measurement). The view performs no I/O; owners (shards, disk tiers) report what they did.

Lifecycle of a memory object::

    allocate -> ALLOCATED -> (WRITING) -> READY state of its kind -> EVICTED | LOST | CORRUPT
                                               \\-> begin_offload -> DISK copy (see transitions)

Terminal records are detached at once: their block is released (generation bumped), and the
entry is dropped when nothing is left in it.
"""

from __future__ import annotations

import itertools
import operator
import random
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from . import contracts
from .admission import AdmissionCap, AdmissionGate, Ticket
from .allocator import SWA_LANE_BITS, BlockPool, Policy, PoolConfig, swa_policy
from .checks import Capture, LeaseBook
from .counters import Counters
from .errors import (
    BadHash,
    FutureGeneration,
    HkvError,
    IllegalTransition,
    InvalidInput,
    LeaseExpired,
    PoolExhausted,
    ResourceExhausted,
    StaleHandle,
    UnknownCapture,
    UnknownGroup,
    UnknownLease,
    UnknownObject,
    UnknownOwner,
    UnsetVersion,
    WrongPartition,
)
from .events import EventLog, TransitionEvent
from .funnel import (
    Downgrade,
    FunnelResult,
    LookupRequest,
    check_hash_lengths,
    run_funnel,
    validate_request,
)
from .hashing import CONTENT_VERSION_BASE
from .ids import BLOCK_HASH_BYTES, BlockHash, CaptureId, LeaseId, ObjectId, ShardId
from .layout import Layout
from .match import Match, Memo, MemoKey
from .memo import LookupMemo
from .objects import ObjectTable
from .owners import REAP_SLICE, Owner, Reap, dead, disk_part_alive, sweep
from .partitions import Partition, check_range_blocks, partition_of_root
from .prefix_index import Orphans, PrefixIndex
from .records import (
    HANDLE_DTYPE,
    DiskRecord,
    Handle,
    HandleColumn,
    ObjRecord,
    PrefixEntry,
    new_record,
)
from .segments import DEFAULT_SEGMENT_BLOCKS, Segment, first_missing, walk_blocks
from .spec import CacheSpec
from .states import TERMINAL_STATES, Event, Kind, State
from .transitions import APPLIED_FIELDS, CORE_ONLY_EVENTS, Params, apply

__all__ = [
    "MAX_TRANSITION_ITEMS",
    "AllocRequest",
    "Allocation",
    "CacheState",
    "Match",
    "ObjectReport",
    "ObjectTransitions",
    "StateConfig",
    "TransitionEvent",
    "TransitionResult",
    "segment_blocks_for",
]


_NO_SHARD = ShardId("")  # a DISK object with no memory copy


@dataclass(frozen=True, slots=True)
class StateConfig:
    admission: AdmissionCap = field(default_factory=AdmissionCap)
    max_lease_ttl_s: float = 60.0
    heartbeat_timeout_s: float = 10.0
    log_capacity: int = 8192  # bounded: Watch streams recent history only
    # owners registered at once (RegisterOwner beyond it: RESOURCE_EXHAUSTED); an owner's
    # per-block metadata grows with the blocks it uses, not the blocks it declares
    max_owners: int = 1024
    # Lookup memo (core/memo.py): results of lookups of >= memo_min_blocks hashes, kept until
    # anything on their path changes; bounded by count and bytes. 0 capacity or bytes: off.
    memo_capacity: int = 1024
    memo_max_bytes: int = 64 << 20
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
    range_blocks: int = 0


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
    """One object's events for :meth:`CacheState.transition_many`, applied in order, all or
    none; ``params[i]`` goes with ``events[i]`` (missing ones: none). A plain 4-tuple works."""

    object_id: ObjectId
    events: Sequence[Event]
    params: Sequence[Params | None] = ()
    generation: int | None = None  # checked once, before the first event


# Items one transition_many call may carry: the call holds the lock throughout (tens of
# microseconds an object), so this bounds the pause it makes every other caller wait.
MAX_TRANSITION_ITEMS = 4096
# Orphans adopted in one lock hold (as a confirm or an allocation returns, and per reap call;
# the rest in later ones): ~0.26 us each (50k in 13 ms, ad-hoc), so a slice holds the lock
# ~1 ms however many blocks were confirmed before their parents.
ADOPT_SLICE = 4096


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


class CacheState:
    def __init__(
        self,
        spec: CacheSpec,
        config: StateConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        """``lock``: what serialises the view's methods (re-entrant; default
        ``threading.RLock``); the service bench passes one that times its waits and holds."""
        self.spec = spec
        self.layout = Layout(spec)
        self.config = config or StateConfig()
        self.clock = clock
        self.admission = AdmissionGate(self.config.admission)
        self.counters = Counters()
        self.index = PrefixIndex()  # (in parts: one dict's resize was O(all entries))
        self.partition = self.config.partition
        self.range_blocks = check_range_blocks(self.config.range_blocks, self.layout.period)
        self._empty_summary = _empty_summaries(self.layout)
        self.objects = ObjectTable(index=self.partition.index, count=self.partition.count)
        self.owners: dict[ShardId, Owner] = {}
        # lost owner incarnations whose records are still to be buried (see core/owners.py);
        # while it is not empty, every path that serves or reuses a record asks _dead first
        self._reaping: deque[Reap] = deque()
        self._loss_epoch = 0  # moves on with every owner loss (PrefixEntry.clean)
        self.leases = LeaseBook(next_id=self.partition.index, step=self.partition.count)
        self.holds = self.leases.holds  # leases and captures per record
        self.captures: dict[CaptureId, Capture] = {}
        self.topology_epoch = 0
        self.log = EventLog(self.config.log_capacity, [c.name for c in self.layout.columns])
        self._tickets: dict[ObjectId, Ticket] = {}
        self._disk_records = 0  # 0 lets lookups skip per-record verdicts
        self._ordinals: dict[ShardId, int] = {}  # shard name -> index in _shard_names
        self._shard_names: tuple[ShardId, ...] = ()
        self._mono_slot = {c: j for j, c in enumerate(self.layout.mono_columns)}
        self._column_nbytes = tuple(c.nbytes for c in self.layout.columns)
        self.segment_blocks = segment_blocks_for(self.layout, self.config.segment_blocks)
        self._row_struct = struct.Struct("<" + "QQiH" * len(self.layout.mono_columns))
        self._placeholder_row = bytes(self._row_struct.size)
        self._lock: AbstractContextManager[Any] = lock if lock is not None else threading.RLock()
        # KV versions: unique for this view's lifetime *and* above every version an owner
        # re-confirmed or a client passed, or a KV rewritten after a restart could get the
        # version a stale indexer was synced to and that indexer would pass as synced.
        self._next_version = 1
        self._tick = 0
        # per SWA column (its lane in swa_need): its own policy, and the increments a complete
        # tail adds to the entries within each window above it (step 0: its own entry)
        lanes = {c: i for i, c in enumerate(self.layout.swa_columns)}
        self._policies: dict[int, Policy] = {c: swa_policy(i) for c, i in lanes.items()}
        hb = self.layout.hash_block
        reach = {c: -(-self.layout.columns[c].group.window // hb) for c in lanes}
        # entries a re-confirm made before their parent's, and the complete resume points whose walk
        # up waits at one of them, with the increment each goes on with when it is adopted
        self._orphans = Orphans()
        self._adopting: deque[PrefixEntry] = deque()  # made with orphans still to adopt
        self._cut_walks: dict[PrefixEntry, dict[PrefixEntry, int]] = {}
        self._swa_steps = tuple(
            sum(1 << (SWA_LANE_BITS * i) for c, i in lanes.items() if reach[c] > step)
            for step in range(max(reach.values(), default=0)))
        self.memo = LookupMemo(self.config.memo_capacity, self.config.memo_max_bytes,
                               self.config.memo_min_blocks)
        self._owners_epoch = 0  # moves on whenever the owner table does (memo keys carry it)
        # from a random base, as object and lease ids: an old capture id must not name a new one
        self._captures = itertools.count(random.SystemRandom().getrandbits(32) + 1)
        self._incarnations = itertools.count(1)

    # ---- owners -------------------------------------------------------------------------

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig],
                       instance: int = 0) -> int:
        """(Re-)register an owner. A known owner coming back has lost its memory: its old
        incarnation is declared lost first (its objects are buried lazily, see :meth:`reap`).
        ``instance``: the owner process's own id (the same process registering again after
        a service restart keeps it), what loss reports name. Returns the new incarnation."""
        with self._lock:
            built: dict[int, BlockPool] = {}  # validate before touching anything
            for name, cfg in pools.items():
                col = self._column(name)
                built[col] = BlockPool(_checked_pool(name, cfg), nbytes=self._column_nbytes[col])
            old = self.owners.get(owner)
            if old is not None:
                if old.alive:
                    self.mark_owner_lost(owner)
            else:
                self._make_room_for_owner(owner)
            self._owners_epoch += 1
            inc = next(self._incarnations)
            self.owners[owner] = Owner(inc, self.clock(), built, instance=instance)
            return inc

    def _make_room_for_owner(self, owner: ShardId) -> None:
        """Owners declared lost hold nothing any more (their objects ended with them): their
        entries go when the table is full. Live ones are never dropped: over the bound, a new
        name is refused."""
        if len(self.owners) < self.config.max_owners:
            return
        for name in [s for s, o in self.owners.items() if not o.alive]:
            del self.owners[name]
        if len(self.owners) >= self.config.max_owners:
            raise ResourceExhausted(
                f"cannot register owner {owner!r}: {len(self.owners)} owners are registered, "
                f"the most this service takes (max_owners); retire owners or raise it")

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        with self._lock:
            self._current_owner(owner, incarnation).last_seen = self.clock()

    def _current_owner(self, owner: ShardId, incarnation: int) -> Owner:
        """The owner, if ``incarnation`` is the one its last registration returned and the view
        has not declared it lost since; else UnknownOwner (re-register)."""
        o = self._owner(owner)
        if o.incarnation != incarnation or not o.alive:
            raise UnknownOwner(
                f"owner {owner!r} incarnation {incarnation} is not current; re-register"
            )
        return o

    def expire_owners(self) -> list[ShardId]:
        """Mark every owner silent for longer than the heartbeat timeout as lost."""
        with self._lock:
            cutoff = self.clock() - self.config.heartbeat_timeout_s
            dead = [s for s, o in self.owners.items() if o.alive and o.last_seen < cutoff]
            for s in dead:
                self.mark_owner_lost(s)
            return dead

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        """Memory of ``owner`` is gone: from now on none of its objects is a hit (O(1) here:
        the incarnation is marked dead and queued; :meth:`reap` buries its objects as LOST,
        and loaded disk copies on it as dropped, in slices). Returns how many objects it
        held; 0 if it was lost already; None if the report is stale and was ignored.

        A data plane's report is about the process its failed call went to, and must not end
        a successor that registered meanwhile (Ray reports a crashed call's failure once the
        restarted shard is up; a replaced actor's old handle fails while the new one serves):

        * ``instance``: the owner process the call went to. Declared only if that is the
          owner's current registration's instance; else stale.
        * ``witnesses`` (an owner registered without an instance, or a report that does not
          know it): object ids of handles the failed call carried; declared only if one is
          still held by the current incarnation. Weaker: evicted witnesses hide a real loss,
          and a disk copy keeps its id across loads onto a successor.
        * Neither (an operator, the heartbeat expiry): declared."""
        with self._lock:
            o = self._owner(owner)
            if not o.alive:
                return 0
            if self._stale_report(owner, o, witnesses, instance):
                self.counters.events["stale_loss_report"] += 1
                return None
            held = sum(p.occupied() for p in o.pools.values()) + len(o.disk)
            o.alive = False
            self._owners_epoch += 1  # memos and replays stop answering
            self._loss_epoch += 1  # every entry must be cleaned again before it serves
            self._reaping.append(Reap(owner, o, sorted(o.pools)))
            self._invalidate_captures_of_dead()
            # transfers in flight end now (bounded by admission): their tickets go back
            for oid in list(self._tickets):
                rec = self.objects.get(oid)
                if rec is not None and self._dead(rec):
                    self._bury(rec)
            self.counters.events["owner_lost"] += 1
            return held

    def _stale_report(self, owner: ShardId, o: Owner, witnesses: Sequence[int],
                      instance: int) -> bool:
        if instance and o.instance:
            return instance != o.instance
        return bool(witnesses) and not any(self._held_now(owner, oid) for oid in witnesses)

    def _held_now(self, owner: ShardId, oid: int) -> bool:
        """Object ``oid`` is held by ``owner``'s current incarnation (its memory copy, or its
        disk tier)."""
        rec = self.objects.get(ObjectId(oid))
        return (rec is not None and owner in (rec.shard, rec.disk_owner)
                and not dead(rec, self.owners))

    def reap(self, budget: int = REAP_SLICE) -> bool:
        """Bury up to ``budget`` objects (or empty blocks looked at) of lost owners, and adopt
        a slice of the orphans left waiting (:data:`ADOPT_SLICE`); True while some of either
        remain. The service runs it in slices with the lock released between them, so
        heartbeats and lookups never wait behind a whole owner's objects, nor behind every
        block confirmed before its parent."""
        with self._lock:
            while self._reaping and budget > 0:
                r = self._reaping[0]
                budget = sweep(r, budget, self._bury_if_dead)
                if r.done:
                    self._reaping.popleft()
            adopting = self._adopt_some(ADOPT_SLICE) if self._adopting else False
            return bool(self._reaping) or adopting

    def reap_all(self) -> None:
        """Reap until nothing is left, a slice per lock hold (in-process ports, tests)."""
        while self.reap():
            pass

    def _dead(self, rec: ObjRecord) -> bool:
        """``rec`` belongs to a lost owner and is not buried yet (never, while nothing is
        being reaped: a buried record has left the view)."""
        return bool(self._reaping) and dead(rec, self.owners)

    def _bury_if_dead(self, rec: ObjRecord) -> None:
        """What the reaper does with a record a lost incarnation's pool or disk set still
        names: bury it unless it lives on elsewhere. A DISK record's loaded copy on the lost
        pool is buried (back to rest) when something touches it, and the record can then be
        loaded again, onto a live pool: the lost pool still names it at the old block, and
        burying it there failed the new load under its loader (its new block freed while the
        loader's bytes were landing in it)."""
        if dead(rec, self.owners):
            self._bury(rec)

    def _bury(self, rec: ObjRecord) -> None:
        """A dead record ends: LOST, or, if only its loaded memory copy died (its disk copy
        lives on another owner's tier), back to ON_DISK."""
        if rec.kind is Kind.DISK and disk_part_alive(rec, self.owners):
            if rec.state is State.ON_DISK_READY:
                self._apply(rec, Event.COPY_LOST, Params())
            elif rec.state is State.ON_DISK_INFLIGHT:
                self._disk_event(rec, Params(), Event.LOAD_FAILED)  # releases its ticket too
            return
        self._apply(rec, Event.LOSE, Params())

    def _clean(self, hashes: Iterable[BlockHash], walk_need: int = 0) -> None:
        """Bury the dead records of the entries of ``hashes`` (every one the index has, an
        orphan past a gap too), each entry once per owner loss: what a lookup, an allocation
        or a confirm then reads of them is alive. Burying may drop an emptied entry from the
        index, so callers clean before they take entries.

        ``walk_need`` (a lookup's alignment, >= 1): clean only what the funnel's walk can
        read, up to the first gap or the first entry that stops it once cleaned
        (:func:`contracts.stops_walk`), that one included; past it nothing is read. A
        2,048-block question otherwise buried a lost owner's records along the whole
        question under the lock (~1,000 at 1M objects, 24 ms) with its walk stopped at the
        first block."""
        if not self._reaping:
            return
        epoch, get = self._loss_epoch, self.index.get
        for h in hashes:
            e = get(h)
            if e is None:
                if walk_need:
                    return
                continue
            if e.clean != epoch:
                for rec in [*e.mem, *(e.disk or ())]:
                    if rec is not None and rec.state not in TERMINAL_STATES and self._dead(rec):
                        self._bury(rec)
                e.clean = epoch
            if walk_need and contracts.stops_walk(e, walk_need):
                return

    def _invalidate_captures_of_dead(self) -> None:
        """A capture over a record of a lost owner replays over memory that is gone."""
        for cap in self.captures.values():
            if cap.valid and any(dead(r, self.owners) for r in cap.records):
                cap.valid = False
                self.topology_epoch += 1

    # ---- allocation ---------------------------------------------------------------------

    def allocate(
        self,
        block_hashes: Sequence[BlockHash],
        requests: Sequence[AllocRequest],
        owner: ShardId | None = None,
        first_block: int = 0,
    ) -> list[Allocation]:
        """Reserve blocks for objects of the prefix ``block_hashes`` (the hashes of blocks
        ``first_block`` on: a range of a chain split across partitions). Idempotent: a live
        object already in a requested slot is returned with ``existing=True``."""
        with self._lock:
            self._check_hashes(block_hashes)
            self._check_root(block_hashes)
            self._check_range(first_block, len(block_hashes), "allocate")
            cols = [self._column(r.column) for r in requests]
            for r in requests:
                self._check_slot(r, len(block_hashes), first_block)
            if owner is not None:
                self._owner(owner)
            last = max((r.depth for r in requests), default=first_block - 1)
            if self._reaping:  # a lost owner's object is not "existing" in a slot asked for;
                # the path above is the reaper's (cleaned whole, a follow-up turn of a
                # 1,000-block prompt buried ~2,000 records in one hold: 50 ms at 1M objects)
                self._clean(block_hashes[d - first_block]
                            for d in sorted({r.depth for r in requests}))
            for r, c in zip(requests, cols, strict=True):
                if r.replace:  # before the path is taken: retiring may drop an entry
                    self._retire(block_hashes[r.depth - first_block], c, r.replace)
            entries = self._ensure_path(block_hashes, last, first_block)
            done: list[Allocation] = []
            made: list[ObjRecord] = []
            try:
                for r, c in zip(requests, cols, strict=True):
                    done.append(self._allocate_one(entries[r.depth - first_block], c, owner,
                                                   made))
            except PoolExhausted:
                self._settle_allocated(made)
                # All or nothing: blocks reserved by this call go back, or they would leak.
                for a in done:
                    if not a.existing:
                        self._apply(self.objects[a.handle.object_id], Event.EVICT, Params())
                if entries:
                    self._gc_entry(entries[-1])  # and so would path entries made for them
                raise
            self._settle_allocated(made)
            if self._adopting:  # the orphans of entries its path made
                self._adopt_some(ADOPT_SLICE)
            return done

    def _retire(self, block_hash: BlockHash, col: int, object_id: int) -> None:
        """Evict object ``object_id`` if it still holds slot ``col`` of ``block_hash``'s entry
        (a caller replaces it with new bytes); left where it is while anything holds it."""
        entry = self.index.get(block_hash)
        rec = entry.mem[col] if entry is not None else None
        if rec is None or rec.object_id != object_id:
            return
        try:
            self._apply(rec, Event.EVICT, Params())
        except IllegalTransition:
            self.counters.events["replace_refused"] += 1
            return
        self.counters.events["replaced"] += 1

    def _allocate_one(self, entry: PrefixEntry, col: int, owner: ShardId | None,
                      made: list[ObjRecord]) -> Allocation:
        """One slot's allocation; a new record is appended to ``made``, its entry summarised
        by :meth:`_settle_allocated` before the lock is let go."""
        existing = entry.mem[col]
        if existing is not None:
            return Allocation(self._handle(existing), True, existing.state, existing.version)
        shard, pool, block = self._take_block(col, owner)
        column = self.layout.columns[col]
        rec = new_record(
            column.kind, col, self.objects.new_id(), entry, State.ALLOCATED, shard, block,
            pool.generation[block],
        )
        pool.owner[block] = rec
        entry.mem[col] = rec
        self.objects.put(rec)
        made.append(rec)
        return Allocation(self._handle(rec), False, rec.state)

    def _settle_allocated(self, made: Sequence[ObjRecord]) -> None:
        """What :meth:`_after_change` does for each new record, once per entry: a request's
        objects share their entries (4-5 columns a block), and nothing reads an entry's
        summary while the lock is held between its allocations. (An ALLOCATED record is
        never terminal: no entry to collect.)"""
        summarised: set[int] = set()
        for rec in made:
            if id(rec.entry) not in summarised:
                summarised.add(id(rec.entry))
                contracts.summarise(rec.entry, self.layout, self._align_of)
        self._log_events(made)

    def _take_block(self, col: int, owner: ShardId | None) -> tuple[ShardId, BlockPool, int]:
        candidates = [owner] if owner is not None else self._owners_by_free(col)
        for shard in candidates:  # (an iterator: the most free first, the rest on demand)
            o = self._owner(shard)
            pool = o.pools.get(col)
            if pool is None or not o.alive:
                continue
            block = pool.take()
            if block is None and self._evict_from(pool, col):
                block = pool.take()
            if block is not None:
                return shard, pool, block
        name = self.layout.columns[col].name
        if owner is None and not any(col in o.pools for o in self.owners.values() if o.alive):
            raise PoolExhausted(
                f"no owner (shard) with a pool for {name!r} is registered with this metadata "
                f"view ({self.partition}) yet: a restarted service is back once the shards "
                "have re-registered (within a heartbeat); retry then")
        raise PoolExhausted(
            f"no free or evictable block for {name!r}: every block is pinned, being written "
            "or leased; retry after readers release their leases"
        )

    def _owners_by_free(self, col: int) -> Iterator[ShardId]:
        """Live owners with a pool for ``col``, the most free blocks first: the first is
        found in one pass (it nearly always has a block, or one to evict); the rest are
        sorted only if it has neither."""
        live = [(s, o) for s, o in self.owners.items() if o.alive and col in o.pools]
        if not live:
            return
        free = [o.pools[col].free_count() for _, o in live]
        first = max(range(len(live)), key=free.__getitem__)
        yield live[first][0]
        rest = sorted((i for i in range(len(live)) if i != first), key=lambda i: -free[i])
        yield from (live[i][0] for i in rest)

    def _evict_from(self, pool: BlockPool, col: int) -> bool:
        victim = pool.victim(self.layout.columns[col].kind, self.holds, self._policies.get(col))
        if victim is None:
            return False
        self.evict(victim.object_id)
        return True

    def evict(self, object_id: ObjectId) -> None:
        """Evict by policy rules: an indexer goes with its KV and a KV with its indexer."""
        with self._lock:
            rec = self._object(object_id)
            if rec.kind is Kind.DISK:
                self._apply(
                    rec,
                    Event.DROP_COPY if rec.state is State.ON_DISK_READY else Event.EVICT,
                    Params(),
                )
                return
            partners = self._partners(rec)  # before rec leaves its entry
            # rec first: a refused eviction (held, wrong state) raises with nothing changed
            self._apply(rec, Event.EVICT, Params())
            self.counters.evictions[rec.kind] += 1
            for partner in partners:
                if partner.state in TERMINAL_STATES or self.holds.held(partner):
                    continue
                if self._dead(partner):
                    self._bury(partner)  # lost with its owner, not evicted
                    continue
                if (partner.kind, partner.state) in _PARTNER_EVICTABLE:
                    self._apply(partner, Event.EVICT, Params())

    def _partners(self, rec: ObjRecord) -> list[ObjRecord]:
        out = []
        for col in self.layout.columns:
            if col.indexes == rec.column or (
                rec.kind is Kind.INDEXER and col.index == self.layout.columns[rec.column].indexes
            ):
                other = rec.entry.mem[col.index]
                if other is not None and other is not rec:
                    out.append(other)
        return out

    # ---- transitions --------------------------------------------------------------------

    def transition(
        self,
        object_id: ObjectId,
        event: Event,
        params: Params | None = None,
        generation: int | None = None,
    ) -> TransitionResult:
        _check_reported(event)
        with self._lock:
            rec = self._object(object_id)
            if generation is not None:
                self._check_generation(rec, generation)
            p = params or Params()
            if p.version is not None and p.version < 1:
                raise UnsetVersion(f"version {p.version} for object {object_id}: a KV version "
                                   "is at least 1 (0 is an unset field)")
            if rec.kind is Kind.COMPRESSED and event is Event.WRITE_DONE and p.version is None:
                p = Params(self._next_version, p.lo, p.hi, p.tail_len, p.expect_seq)
            if p.version is not None:
                self._saw_version(p.version)
            if event is Event.EVICT:
                self.evict(object_id)
            elif rec.kind is Kind.DISK and event in _DISK_EVENTS:
                _DISK_EVENTS[event](self, rec, p)
            else:
                self._apply(rec, event, p)
            return TransitionResult(rec.object_id, rec.state, rec.version, rec.seq)

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        """Many objects' events under one lock acquisition: items in order, each object's
        events in order and all or none of them. Each item gives its object's result after
        its last event, or the error that refused it; a refused item changed nothing and does
        not stop the others. A malformed call (more than :data:`MAX_TRANSITION_ITEMS` items,
        an item with no events or more params than events) raises InvalidInput before
        anything is applied.

        All or none by rehearsal (:meth:`_rehearse`): an item's events first run through the
        table's ``apply`` on its record, behind the checks ``transition`` makes, and the
        record's fields are put back; only an item that passes whole is then reported, event
        by event, through ``transition``. The rehearsal is exact: from one event of an object
        to its next, nothing a precondition reads changes but the record (other objects change
        only in other items, its holds only as it ends, and an ended object takes no further
        event).
        """
        batch = [ObjectTransitions(*item) for item in items]
        if len(batch) > MAX_TRANSITION_ITEMS:
            raise InvalidInput(f"{len(batch)} items in one transition_many call; it takes at "
                               f"most {MAX_TRANSITION_ITEMS} (it holds the state's lock "
                               "throughout): split the call")
        with self._lock:
            for i, item in enumerate(batch):
                _check_item(i, item)
            out: list[TransitionResult | HkvError] = []
            for item in batch:
                try:
                    self._rehearse(item)
                except HkvError as err:
                    out.append(err)
                    continue
                for k, event in enumerate(item.events):
                    result = self.transition(item.object_id, event, _params_at(item, k),
                                             item.generation)
                out.append(result)
            return out

    def _rehearse(self, item: ObjectTransitions) -> None:
        """Raise what reporting ``item``'s events one by one would raise, changing nothing:
        the table's ``apply`` moves the record itself, and every field it may move is put
        back (nothing else runs meanwhile: the lock is held). An IllegalTransition says which
        event it refused (``index``)."""
        rec = self._object(item.object_id)
        if item.generation is not None:
            self._check_generation(rec, item.generation)
        saved = [getattr(rec, f) for f in APPLIED_FIELDS]
        try:
            for k, event in enumerate(item.events):
                self._rehearse_event(rec, item, k, event)
        finally:
            for f, value in zip(APPLIED_FIELDS, saved, strict=True):
                if getattr(rec, f) != value:  # a field its kind lacks never moved
                    setattr(rec, f, value)

    def _rehearse_event(self, rec: ObjRecord, item: ObjectTransitions, k: int,
                        event: Event) -> None:
        if rec.state in TERMINAL_STATES:  # ended by event k - 1: transition would not find it
            raise UnknownObject(f"object {rec.object_id} is gone after event {k - 1} of its "
                                f"item ({item.events[k - 1].value})" if k else
                                f"object {rec.object_id} is gone")
        p = _params_at(item, k) or Params()
        if p.version is not None and p.version < 1:
            raise UnsetVersion(f"version {p.version} for object {rec.object_id}: a KV version "
                               "is at least 1 (0 is an unset field)")
        if event is Event.EVICT:  # as evict() applies it
            drop = rec.kind is Kind.DISK and rec.state is State.ON_DISK_READY
            event, p = (Event.DROP_COPY if drop else Event.EVICT), Params()
        try:
            apply(rec, event, p, self)
        except IllegalTransition as err:
            err.index = k
            raise

    def _apply(self, rec: ObjRecord, event: Event, params: Params) -> None:
        point = self._resume_point_of(rec)
        was = point and self._complete(rec.entry, rec)
        apply(rec, event, params, self)
        if rec in self.holds.captures and (rec.state in TERMINAL_STATES or event in _COPY_ENDS):
            # Policy events (EVICT, DROP_COPY) are refused while a capture holds the object, so
            # this is a fact (lost, corrupt, a failed load): a graph over it must not replay.
            self._invalidate_captures(rec)
        if rec.state in TERMINAL_STATES:
            self._detach(rec)
        elif event in _COPY_ENDS:
            self._release_copy(rec)
        if point:
            self._track_resume_point(rec.entry, was, self._complete(rec.entry, rec))
        self._after_change(rec)

    def _after_change(self, rec: ObjRecord) -> None:
        contracts.summarise(rec.entry, self.layout, self._align_of)
        self._log_events((rec,))
        if rec.state in TERMINAL_STATES:
            self._gc_entry(rec.entry)

    def _log_events(self, recs: Sequence[ObjRecord]) -> None:
        """Count and log the state each of ``recs`` reached (the Watch stream's events), in
        order; one clock read for them all (a re-confirm logs a batch at once)."""
        states = [rec.state for rec in recs]
        counts = self.counters.transitions
        for rec, state in zip(recs, states, strict=True):
            counts[(rec.kind, state)] += 1
        self.log.add(recs, states, self.clock())

    def _detach(self, rec: ObjRecord) -> None:
        entry, col = rec.entry, rec.column
        if rec.kind is Kind.DISK:
            assert entry.disk is not None
            entry.disk[col] = None
            if not any(entry.disk):
                entry.disk = None  # what the lookup's fast path tests (_disky)
            self._disk_records -= 1
            tier = self.owners.get(rec.disk_owner) if rec.disk_owner is not None else None
            if tier is not None:
                tier.disk.pop(rec, None)
            self._end_transfer(rec)
        else:
            entry.mem[col] = None
        self._release_copy(rec)
        self.objects.pop(rec.object_id)

    def _release_copy(self, rec: ObjRecord) -> None:
        """Free the memory block behind ``rec`` (if any): its generation moves on."""
        if rec.block < 0:
            return
        o = self.owners.get(rec.shard)
        pool = o.pools.get(rec.column) if o else None
        if pool is not None and pool.owner.get(rec.block) is rec:  # (not a lost incarnation's)
            pool.release(rec.block)
        rec.block = -1

    def _gc_entry(self, entry: PrefixEntry | None) -> None:
        while (
            entry is not None
            and entry.children == 0
            and not any(entry.mem)
            and not any(entry.disk or ())
        ):
            if self.index.get(entry.block_hash) is entry:
                del self.index[entry.block_hash]
            if entry.awaits is not None:
                self._orphans.forget(entry)
            parent = entry.parent
            if parent is not None:
                parent.children -= 1
            entry = parent

    def _resume_point_of(self, rec: ObjRecord) -> bool:
        """``rec`` is a memory object at a resume point's entry (one ending at a multiple of
        L): its changes may complete or break that resume point."""
        return rec.kind is not Kind.DISK and (rec.entry.depth + 1) % self.layout.period == 0

    def _complete(self, entry: PrefixEntry, rec: ObjRecord) -> bool:
        """Every memory object the resume point at ``entry`` needs is ready there (its
        COMPRESSED, INDEXER and SWA blocks, its tails): what completes a resume point, with a
        tail or without (a spec with no overlap has none). ``rec``, one of them, first."""
        if rec.state not in _READABLE[rec.kind] or entry.mem[rec.column] is not rec:
            return False
        for c in self.layout.attached[self.layout.period - 1]:
            other = entry.mem[c]
            if other is None or other.state not in _READABLE[other.kind]:
                return False
        return True

    def _track_resume_point(self, entry: PrefixEntry, was: bool, now: bool) -> None:
        """Keep ``swa_need`` = complete resume points within one window after each block, per
        SWA column and its own window (the SWA policy keeps the blocks they need)."""
        if now != was:
            self._count_resume_point(entry, entry, 0, 1 if now else -1)

    def _count_resume_point(self, point: PrefixEntry, e: PrefixEntry, step: int,
                            delta: int) -> None:
        """Add ``delta`` times the increments of the resume point at ``point`` to ``e`` and
        the entries above it, the ``step``-th increment first. A re-confirm in random order
        makes a block's entry before its parent's (an orphan, adopted when the parent's
        report arrives): a walk cut there is remembered (``_cut_walks``) and
        :meth:`_entry_under` goes on with it when it adopts the orphan, so a count taken
        back later walks exactly the entries it was added to. (Stopping at the orphan for
        good under-counted the blocks above it, and taking the count back once the parent
        was there went below zero, into the next column's lane.)"""
        steps = self._swa_steps
        while step < len(steps):
            e.swa_need += delta * steps[step]
            step += 1
            if e.parent is None:
                if step < len(steps) and not self._starts_range(e.depth):
                    self._cut_walk(e, point, step if delta > 0 else None)
                return
            e = e.parent

    def _cut_walk(self, orphan: PrefixEntry, point: PrefixEntry, step: int | None) -> None:
        """The walk of the resume point at ``point`` waits at ``orphan`` from its
        ``step``-th increment on (None: it no longer waits, the point is no longer complete)."""
        waiting = self._cut_walks.setdefault(orphan, {})
        if step is not None:
            waiting[point] = step
            return
        waiting.pop(point, None)
        if not waiting:
            del self._cut_walks[orphan]

    # ---- disk tier ----------------------------------------------------------------------

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        """Create the DISK copy (OFFLOADING) of a readable object; takes an admission ticket."""
        with self._lock:
            src = self._object(object_id)
            if not self._owner(disk_owner).alive:
                raise UnknownOwner(f"disk owner {disk_owner!r} was declared lost; it must "
                                   "register again before it takes copies")
            if src.kind is not Kind.DISK and src.state not in _READABLE[src.kind]:
                raise IllegalTransition(
                    f"object {object_id} is {src.state.value}; only readable objects are offloaded"
                )
            existing = src.entry.disk[src.column] if src.entry.disk else None
            if existing is not None and self._dead(existing):
                self._bury(existing)  # lost with its tier, or back at rest if only its copy was
                existing = src.entry.disk[src.column] if src.entry.disk else None
            if existing is not None:
                return self._handle(existing)
            ticket = self.admission.acquire(self.layout.columns[src.column].nbytes)
            rec = self._add_disk_record(src.entry, src.column, State.OFFLOADING, disk_owner, src)
            self._tickets[rec.object_id] = ticket
            self._after_change(rec)
            return self._handle(rec)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        """ON_DISK -> ON_DISK_INFLIGHT; reserves the memory block the bytes go to."""
        with self._lock:
            rec = self._object(object_id)
            if rec.kind is not Kind.DISK or rec.state is not State.ON_DISK:
                raise IllegalTransition(
                    f"object {object_id} is {rec.kind.value}/{rec.state.value}; "
                    "only a DISK object at rest (ON_DISK) can be loaded"
                )
            ticket = self.admission.acquire(self.layout.columns[rec.column].nbytes)
            try:
                shard, pool, block = self._take_block(rec.column, owner)
            except Exception:
                self.admission.release(ticket)
                raise
            self._tickets[rec.object_id] = ticket
            rec.shard, rec.block, rec.generation = shard, block, pool.generation[block]
            pool.owner[block] = rec
            self._apply(rec, Event.LOAD_BEGIN, Params())
            return self._handle(rec)

    def _end_transfer(self, rec: ObjRecord) -> None:
        ticket = self._tickets.pop(rec.object_id, None)
        if ticket is not None:
            self.admission.release(ticket)

    def _disk_event(self, rec: ObjRecord, params: Params, event: Event) -> None:
        if event in (
            Event.OFFLOAD_COMMITTED,
            Event.LOAD_VERIFIED,
            Event.LOAD_FAILED,
            Event.OFFLOAD_FAILED,
        ):
            self._apply(rec, event, params)  # raises (changing nothing) if illegal
            self._end_transfer(rec)  # the transfer ended, whichever way: return its ticket
        else:
            self._apply(rec, event, params)

    # ---- lookup -------------------------------------------------------------------------

    def lookup(self, req: LookupRequest) -> Match:
        with self._lock:
            limit = validate_request(req, self.layout, hash_lengths=False)
            self._check_root(req.block_hashes)
            if self.range_blocks or req.first_block:  # (a whole chain's lookup: no call)
                self._check_range(req.first_block, len(req.block_hashes), "lookup")
            if req.lease_ttl_s > self.config.max_lease_ttl_s:
                raise InvalidInput(
                    f"lease_ttl_s {req.lease_ttl_s} exceeds the maximum "
                    f"{self.config.max_lease_ttl_s}"
                )
            # what the walk reads is alive (a lost owner's objects are buried lazily)
            first = req.first_block
            if self._reaping:  # (no copy of the hashes on the hot path otherwise)
                self._clean(req.block_hashes[: -(-limit // self.layout.hash_block) - first],
                            walk_need=req.alignment)
            now = self.clock()
            self.leases.reap(now)
            key = self.memo.key(req, limit, self._owners_epoch)
            memo = self.memo.get(key, req.block_hashes) if key is not None else None
            stop_key = None
            # A range of a split chain has its own memo, not a prefix's: its answer past a
            # miss is its partition's part of a longer question, which the client assembles
            whole = not first and not req.open_end
            if memo is None and key is not None and whole:
                memo = self._prefix_memo(req, limit)
                repeatable = memo is None
            else:
                repeatable = True
            if memo is not None and memo.result is not None:
                result = memo.result
                self.counters.events["lookup_memo_hit"] += 1
            else:
                result = run_funnel(self.index, self.layout, req, limit, self.segment_blocks,
                                    self._align_of)  # changes no state (summaries)
                # The walk found the first matched/H hashes in the index, whose keys are all 16
                # bytes (allocate and confirm check them): only the rest can be malformed.
                check_hash_lengths(req.block_hashes, max(
                    0, result.matched_tokens // self.layout.hash_block - first))
                stop_key = (self._stop_key(req, result, limit) if key is not None and whole
                            else None)
            self._count_lookup(result.usable_tokens, limit, result.downgrades)
            usable, entries = result.usable_tokens, result.entries
            if usable:
                self._age(entries)
            records = memo.records if memo is not None else None
            lease_id = None
            if req.lease_ttl_s > 0 and usable:
                if records is None:
                    records = self._resolve(entries, usable, req.alignment, first)
                    if memo is not None:
                        memo.records = records
                pinned = [r for recs in records.values() for r in recs]
                if pinned:
                    lease_id = self.leases.open(pinned, now + req.lease_ttl_s).lease_id
            columns = memo.columns if memo is not None else self._columns(req, result, records)
            match = Match(
                result.usable_tokens, result.matched_tokens, result.downgrades, lease_id,
                dict(columns) if columns else {}, memo if lease_id is None else None,
                repeatable=repeatable,
            )
            if memo is None and result.walked:
                # Only a walk that found every hash it looked at depends on its entries alone;
                # one that stopped at a miss answers what its prefix alone would (kept as the
                # prefix's memo).
                complete = result.matched_tokens == limit // self.layout.hash_block * \
                    self.layout.hash_block
                keep, hashes = ((key, req.block_hashes) if complete else
                                (stop_key, req.block_hashes[: len(result.walked)]))
                if keep is not None:
                    self.memo.put(keep, hashes, match if lease_id is None else
                                  replace(match, lease_id=None), result, records)
            return match

    def _stop_key(self, req: LookupRequest, result: FunnelResult, limit: int
                  ) -> MemoKey | None:
        """The memo key of the prefix a walk stopped at, where the lookup's answer is that
        prefix's: the walk stopped at a hash the index lacks (a plain miss adds no downgrade),
        before the limit. A stop at an entry that is there but not ready answers with its
        reason, and is not a prefix's answer (nor found by :meth:`_prefix_memo`: that entry
        is present)."""
        n = len(result.walked)
        if n * self.layout.hash_block >= limit // self.layout.hash_block * self.layout.hash_block:
            return None  # complete: the request's own key
        if self.index.get(req.block_hashes[n]) is not None:
            return None
        return self.memo.key_at(req, n, n * self.layout.hash_block, self._owners_epoch)

    def _prefix_memo(self, req: LookupRequest, limit: int) -> Memo | None:
        """The memo of the prefix a walk of ``req`` would stop at, found without walking:
        bisect for the first hash the index lacks (present hashes come before absent ones
        along a chained prefix), then take the live memo of the hashes before it if it is byte
        for byte this request's. Sound however the stop was found: the memo stands, so a walk
        would accept the same entries, and stop there at a plain miss."""
        hashes, hb = req.block_hashes, self.layout.hash_block
        lo = first_missing(self.index, hashes, limit // hb)
        if lo * hb >= limit // hb * hb:
            return None  # no miss before the limit: the request's own key, not a prefix's
        key = self.memo.key_at(req, lo, lo * hb, self._owners_epoch)
        memo = self.memo.get(key, hashes, lo) if key is not None else None
        if memo is None or memo.result is None:
            return None
        check_hash_lengths(hashes, lo)  # the walk's answer past the stop: a malformed hash
        return memo

    def replay(self, memo: Memo) -> bool:
        """Repeat the lease-free lookup ``memo`` answered (``Match.memo``): counted and aged
        like any lookup, with no request to decode or walk. False once anything on its path
        or the owner table changed: look the request up afresh."""
        with self._lock:
            result = memo.result
            if not memo.live or result is None or memo.key[-1] != self._owners_epoch:
                return False
            self.leases.reap(self.clock())
            self.memo.touch(memo)
            self.counters.events["lookup_memo_hit"] += 1
            self._count_lookup(result.usable_tokens, memo.key[2], result.downgrades)
            if result.usable_tokens:
                self._age(result.entries)
            return True

    def _columns(
        self, req: LookupRequest, result: FunnelResult,
        records: dict[str, tuple[ObjRecord, ...]] | None,
    ) -> dict[str, HandleColumn] | None:
        """The match's packed handles (None: a match-only lookup). Only at entries holding a
        disk copy do per-record verdicts decide which copy serves each column; every other
        entry takes the packed fast path, whatever other entries hold."""
        if not req.handles:
            return None
        entries, usable, first = result.entries, result.usable_tokens, result.first_block
        disky = self._disky(entries, usable, first)
        if len(disky) <= _DISKY_PATCHED:  # the same copies _resolve gives, packed faster
            try:
                return self._packed_columns(entries, usable, result.runs, disky, req.alignment,
                                            first)
            except _NoCopy:
                pass  # a column with a gap: as _resolve gives it (the reader recomputes)
        if records is None:
            records = self._resolve(entries, usable, req.alignment, first)
        return {name: self._snapshot(recs) for name, recs in records.items()}

    def _disky(self, entries: Sequence[PrefixEntry], usable: int, first: int = 0
               ) -> list[PrefixEntry]:
        """The entries in ``[0, usable)`` that hold a disk copy (``entry.disk`` is None
        wherever none is); ``entries[0]`` is at depth ``first``."""
        if not self._disk_records:
            return []
        return [e for e in entries[: usable // self.layout.hash_block - first]
                if e.disk is not None]

    def _age(self, entries: Sequence[PrefixEntry]) -> None:
        """Age the whole path a lookup used (or a write made), root first: an entry is then
        never more recent than its parent, which is what eviction's order rests on. A path
        whose last entry was aged within ``_AGE_SLACK`` lookups was aged whole then: skipped,
        so a hot long prefix costs a walk of its path once per that many lookups."""
        if not entries:
            return
        last = entries[-1].last_used
        if last and last + _AGE_SLACK >= self._tick:
            return
        tick = self._tick
        for e in entries:
            e.last_used = tick

    def _count_lookup(self, usable: int, limit: int, downgrades: Iterable[Downgrade]) -> None:
        self._tick += 1
        kind = "miss" if usable == 0 else ("hit" if usable + self.layout.lcm > limit else "partial")
        self.counters.lookups[kind] += 1
        for d in downgrades:
            self.counters.downgrades[d.reason] += 1

    def _resolve(
        self, entries: Sequence[PrefixEntry], usable: int, align: int, first: int = 0
    ) -> dict[str, tuple[ObjRecord, ...]]:
        """The records a reader resuming at ``usable`` needs, per column, in token order: the
        copies the funnel accepted (``contracts.served``; SWA: the one covering the window,
        aligned to ``align``).

        Fast path: an entry the funnel accepted that holds no disk copy has a READY memory
        record in each needed column, so no verdict is recomputed there; only entries with a
        disk copy get one."""
        if usable == 0 or not entries:
            return {}
        disky = self._disky(entries, usable, first)
        out: dict[str, tuple[ObjRecord, ...]] = {}
        for column in self.layout.columns:
            c = column.index
            recs = self._column_records(entries, c, disky, usable, align, first)
            if recs:
                out[column.name] = recs
        return out

    def _snapshot(self, recs: tuple[ObjRecord, ...]) -> HandleColumn:
        """Packed handles of ``recs`` (one column), taken under the lock: the general path,
        one attribute read per field per record (``map``: C speed)."""
        column = self.layout.columns[recs[0].column]
        shards = map(_handle_shard, recs) if self._disk_records else map(_SHARD, recs)
        ordinals = tuple(map(self._ordinal, shards))
        ids, gens, blocks = map(_OBJECT_ID, recs), map(_GENERATION, recs), map(_BLOCK, recs)
        if len(recs) <= _FEW:  # an SWA window, a tail: struct beats numpy's fixed cost
            packed = b"".join(map(_HANDLE_STRUCT.pack, ids, gens, blocks, ordinals))
            return HandleColumn(
                column.index, column.name, column.kind, column.nbytes, column.abi_fingerprint,
                packed, self._shard_names, self._strides(column.index),
            )
        return HandleColumn.pack(
            column.index, column.name, column.kind, column.nbytes, column.abi_fingerprint,
            tuple(ids), tuple(gens), ordinals, tuple(blocks), self._shard_names,
            self._strides(column.index),
        )

    def _packed_columns(
        self, entries: Sequence[PrefixEntry], usable: int,
        runs: Sequence[Segment | None] = (), disky: Sequence[PrefixEntry] = (),
        align: int = 1, first: int = 0,
    ) -> dict[str, HandleColumn]:
        """The lookup fast path (no disk copy anywhere): the funnel accepted ``entries``, so
        each holds a READY memory record in every column living there. COMPRESSED and
        INDEXER handles come from the entries' cached rows (one ``join`` and a strided numpy
        slice per column, no Python work per handle), and a certified run's from its walk
        segment, packed once; SWA and TAIL need a few records each. The ``disky`` entries
        (holding a disk copy) are packed as placeholders, then patched with the copy each
        column's verdict serves there."""
        if usable == 0 or not entries:
            return {}
        lay = self.layout
        end = first + len(entries)  # (entries[0] at depth first: a range of a split chain)
        pieces = self._mono_pieces(entries, usable, runs, first)
        out: dict[str, HandleColumn] = {}
        for column in lay.columns:
            c = column.index
            slot = self._mono_slot.get(c)
            if slot is not None:
                records = b"".join(map(operator.itemgetter(slot), pieces))
                if disky:
                    records = self._patched(records, disky, c,
                                            lay.needed_depths(c, usable, first, end),
                                            usable, align)
                if records:
                    out[column.name] = HandleColumn(
                        c, column.name, column.kind, column.nbytes, column.abi_fingerprint,
                        records, self._shard_names, self._strides(c),
                    )
                continue
            recs = self._column_records(entries, c, disky, usable, align, first)
            if recs:
                out[column.name] = self._snapshot(recs)
        return out

    def _column_records(self, entries: Sequence[PrefixEntry], c: int,
                        disky: Sequence[PrefixEntry], usable: int, align: int, first: int = 0
                        ) -> tuple[ObjRecord, ...]:
        """Column ``c``'s records at the depths a reader resuming at ``usable`` needs: the
        memory record of each entry the funnel accepted, and at a disky entry the copy its
        verdict serves. ``entries[0]`` is at depth ``first``."""
        depths = self.layout.needed_depths(c, usable, first, first + len(entries))
        at = entries[depths.start - first : depths.stop - first : depths.step]  # a range
        found: list[ObjRecord | None] = list(map(operator.itemgetter(c), map(_MEM, at)))
        for e in disky:
            if e.depth in depths:
                found[(e.depth - depths.start) // depths.step] = self._readable_record(
                    e, c, usable, align)
        return tuple(r for r in found if r is not None)

    def _patched(self, records: bytes, disky: Sequence[PrefixEntry], c: int, depths: range,
                 usable: int, align: int) -> bytes:
        """``records`` (column ``c``'s packed handles at ``depths``) with the copy that
        serves each disky entry's depth written over its placeholder."""
        out = bytearray(records)
        size = _HANDLE_STRUCT.size
        for e in disky:
            if e.depth not in depths:
                continue
            rec = self._readable_record(e, c, usable, align)
            if rec is None:  # the funnel accepted it, no copy serves it (a planted bug)
                raise _NoCopy
            j = (e.depth - depths.start) // depths.step * size
            _HANDLE_STRUCT.pack_into(out, j, rec.object_id, rec.generation, rec.block,
                                     self._ordinal(_handle_shard(rec)))
        return bytes(out)

    def _mono_pieces(self, entries: Sequence[PrefixEntry], usable: int,
                     runs: Sequence[Segment | None], first: int = 0
                     ) -> list[tuple[bytes, ...]]:
        """The monotone columns' packed records for ``[0, usable)`` in pieces, in depth order,
        each piece one bytes per column: a certified run's as its segment keeps them, the
        blocks between packed from rows. ``entries[0]`` is at depth ``first`` (runs: only
        from depth 0)."""
        size = self.segment_blocks
        n = min(usable // self.layout.hash_block, first + len(entries))
        pieces: list[tuple[bytes, ...]] = []
        done = first
        for j in range(min(len(runs), n // size) if size else 0):
            seg = runs[j]
            if seg is not None:
                if done < j * size:
                    pieces.append(self._grid_piece(entries, usable, done, j * size))
                pieces.append(seg.cols or self._segment_cols(seg))
                done = (j + 1) * size
        if done < n:
            pieces.append(self._grid_piece(entries, usable, done, n, first))
        return pieces

    def _grid_piece(self, entries: Sequence[PrefixEntry], usable: int, lo: int, hi: int,
                    first: int = 0) -> tuple[bytes, ...]:
        """Each monotone column's records at depths ``[lo, hi)`` (``entries[0]`` at depth
        ``first``)."""
        lay = self.layout
        # a comprehension: 3.11's specialised slot load beats operator.attrgetter here
        joined = b"".join([e.row or self._build_row(e) for e in entries[lo - first:hi - first]])
        # opaque 22-byte records: a strided copy of those is a memcpy per record, ~4x faster
        # than copying HANDLE_DTYPE's fields one by one
        grid = np.frombuffer(joined, _HANDLE_BYTES).reshape(hi - lo, len(lay.mono_columns))
        out = []
        for slot, c in enumerate(lay.mono_columns):
            depths = lay.needed_depths(c, usable, lo, hi)
            out.append(grid[depths.start - lo : depths.stop - lo : depths.step, slot].tobytes())
        return tuple(out)

    def _segment_cols(self, seg: Segment) -> tuple[bytes, ...]:
        """A certified run's records per monotone column, packed on first use. The same for
        every usable length past the run, wherever it starts: runs start at multiples of the
        layout's period, so the run seen as depths ``[0, size)`` selects the same rows."""
        size = len(seg.entries)
        seg.cols = cols = self._grid_piece(seg.entries, size * self.layout.hash_block, 0, size)
        return cols

    def _build_row(self, e: PrefixEntry) -> bytes:
        if e.disk is not None:  # a placeholder: _patched writes the copy served there
            return self._placeholder_row
        values: list[int] = []
        for c in self.layout.mono_columns:
            rec = e.mem[c]
            if not self.layout.lives_at(c, e.depth):
                values += (0, 0, 0, 0)  # never sliced: needed depths are where c lives
            else:
                assert rec is not None, "the funnel accepted an entry missing a monotone record"
                values += (rec.object_id, rec.generation, rec.block, self._ordinal(rec.shard))
        e.row = row = self._row_struct.pack(*values)
        return row

    def _ordinal(self, shard: ShardId) -> int:
        """Index of ``shard`` in the shard-name table packed handles refer to (never reused:
        a cached row stays meaningful for as long as it lives)."""
        ordinal = self._ordinals.get(shard)
        if ordinal is None:
            if len(self._ordinals) > _MAX_SHARD_ORDINAL:
                raise InvalidInput(f"more than {_MAX_SHARD_ORDINAL + 1} distinct owner names")
            ordinal = self._ordinals[shard] = len(self._ordinals)
            self._shard_names = (*self._shard_names, shard)
        return ordinal

    def _strides(self, col: int) -> tuple[int, ...]:
        """Per shard ordinal: the block stride of its pool for ``col`` (0: no such pool)."""
        return tuple(self._stride(name, col) for name in self._shard_names)

    def _stride(self, shard: ShardId, col: int) -> int:
        """The block stride of ``shard``'s current pool for ``col`` (0: no such pool)."""
        owner = self.owners.get(shard)
        pool = owner.pools.get(col) if owner is not None else None
        return pool.config.stride if pool is not None else 0

    def _readable_record(self, e: PrefixEntry, col: int, usable: int, align: int
                         ) -> ObjRecord | None:
        """The record a reader resuming at ``usable`` reads for ``col`` at ``e``: the copy
        that serves it (``contracts.served``: a KV and its indexers at one version); for SWA,
        the one whose range covers what the window needs, aligned (the funnel accepted the
        block with that one)."""
        column = self.layout.columns[col]
        if column.kind is Kind.SWA:
            start, end = self.layout.block_range(col, e.depth)
            need_lo = max(start, usable - column.group.window)
            return contracts.swa_cover(e, col, need_lo, end, self.layout, align, self._align_of)
        return contracts.served(e, col, self.layout)[0]

    # ---- leases, reads, captures --------------------------------------------------------

    def release_lease(self, lease_id: LeaseId) -> None:
        with self._lock:
            lease = self.leases.leases.get(lease_id)
            if lease is None:
                raise UnknownLease(f"lease {lease_id} does not exist or was already released")
            self.leases.close(lease)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        """The view's half of the TOCTOU check; the shard re-checks the generation it holds."""
        with self._lock:
            if lease_id is not None:
                self.leases.reap(self.clock())
                if lease_id not in self.leases.leases:
                    raise LeaseExpired(f"lease {lease_id} expired or was released; look up again")
            rec = self._live_object(handle.object_id)
            if (
                rec is None
                or rec.block != handle.block
                or rec.generation != handle.generation
                or rec.state not in _READABLE[rec.kind]  # e.g. a load still in flight
            ):
                self.counters.events["stale_read"] += 1
                raise StaleHandle(
                    f"handle to object {handle.object_id} is stale (block reused or freed); "
                    "recompute"
                )

    def register_capture(self, handles: Sequence[Handle]) -> tuple[CaptureId, int]:
        with self._lock:
            records = []
            for h in handles:
                self.check_read(h)
                records.append(self.objects[h.object_id])
            self.holds.add(self.holds.captures, records, 1)
            cap = Capture(CaptureId(next(self._captures)), records, self.topology_epoch)
            self.captures[cap.capture_id] = cap
            return cap.capture_id, self.topology_epoch

    def release_capture(self, capture_id: CaptureId) -> None:
        with self._lock:
            cap = self.captures.pop(capture_id, None)
            if cap is None:
                raise UnknownCapture(f"capture {capture_id} is not registered")
            self.holds.add(self.holds.captures, cap.records, -1)

    def capture_status(self, capture_id: CaptureId) -> tuple[bool, int]:
        """(still valid, current topology epoch) for a capture's owner to poll."""
        with self._lock:
            cap = self.captures.get(capture_id)
            if cap is None:
                raise UnknownCapture(f"capture {capture_id} is not registered")
            return cap.valid, self.topology_epoch

    def _invalidate_captures(self, rec: ObjRecord) -> None:
        self.topology_epoch += 1
        for cap in self.captures.values():
            if any(r is rec for r in cap.records):
                cap.valid = False

    # ---- rebuild after a restart ---------------------------------------------------------

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int) -> int:
        """How many of ``reports`` :meth:`confirm_objects` re-created."""
        return sum(1 for oid in self.confirm_objects(owner, reports, incarnation) if oid)

    def confirm_objects(self, owner: ShardId, reports: Sequence[ObjectReport],
                        incarnation: int) -> list[ObjectId | None]:
        """Re-create objects an owner vouches for after a service restart: complete objects and
        disk copies at rest. Returns, per report in order, the id its object has now (the
        owner keys its memory blocks by it), or None where it was not re-created (duplicates
        and half-written objects are skipped). Malformed reports (a state of another kind, an
        SWA range outside its block, hashes that contradict the index or each other) and an
        owner that is not registered, or was declared lost since, reject the whole call,
        changing nothing.

        ``incarnation`` is what the owner's registration returned: a confirm sent before the
        owner registered again (still in flight, or retried) vouches for memory the owner
        has since dropped, so it is refused like a heartbeat of an old incarnation."""
        with self._lock:
            o = self._current_owner(owner, incarnation)
            cols = self._check_shapes(reports)  # all checked before any applied: all or nothing
            if self._reaping:  # a slot a lost incarnation (ours, say) seems to hold is free
                self._clean(h for r in reports for h in (r.block_hash, r.parent_hash) if h)
            # Half-written objects (ALLOCATED, WRITING, TAIL_PARTIAL, ...) are not re-created:
            # their writer's ids died with the old view, so they could never complete.
            order = [i for i, r in enumerate(reports) if r.state in _CONFIRMABLE]
            order.sort(key=[r.depth for r in reports].__getitem__)  # (stable: as sorted)
            found = self._check_vouched([reports[i] for i in order], [cols[i] for i in order])
            ids: list[ObjectId | None] = [None] * len(reports)
            made: list[ObjRecord] = []
            parts, defer = self.index.parts, contracts.defer
            for i, (e, pe) in zip(order, found, strict=True):  # (every report checked above)
                r = reports[i]
                h, p = r.block_hash, r.parent_hash
                # the entries the check found; one an earlier report here made is looked up
                if p is not None and pe is None:
                    pe = parts[p[0]].get(p)
                if e is None:
                    e = parts[h[0]].get(h)
                if e is None or (pe is not None and e.parent is None):  # make it, or adopt it
                    e = self._entry_under(h, pe, r.depth, p)  # (an unknown parent: an orphan)
                rec = self._confirm_one(o, owner, e, cols[i], r)
                if rec is not None:
                    ids[i] = rec.object_id
                    made.append(rec)
                    # summarised when a walk reaches it: once, not once per report (an
                    # entry's columns arrive in other batches when the order is random)
                    defer(e)
            self._log_events(made)
            if self._adopting:
                self._adopt_some(ADOPT_SLICE)
            return ids

    def settle_pending(self) -> int:
        """Summarise every entry a confirm left for the walk (``contracts.defer``) now, as the
        walks reaching them would; how many. O(index) under the lock: for a bench or test that
        counts what deferring costs, not for the service's own paths."""
        with self._lock:
            pending = [e for e in self.index.values() if e.flags & contracts.F_PENDING]
            for e in pending:
                contracts.summarise(e, self.layout, self._align_of)
            return len(pending)

    def _check_shapes(self, reports: Sequence[ObjectReport]) -> list[int]:
        """Per report, its column; raise for an unknown group, a malformed hash, or a depth
        its parent contradicts (a chain's root, or a range's first block when chains are
        split, has none). Per report on a re-confirm's path: checked inline, the error
        raised by the general check."""
        by_name, r_blocks, hb = self.layout.by_name, self.range_blocks, BLOCK_HASH_BYTES
        cols = []
        for r in reports:
            col = by_name.get(r.column)
            cols.append(self._column(r.column) if col is None else col)  # (it raises)
            h, p, depth = r.block_hash, r.parent_hash, r.depth
            if not (type(h) is bytes and len(h) == hb) or \
                    (p and not (type(p) is bytes and len(p) == hb)):
                self._check_hashes([h, p] if p else [h])
            if depth < 0 or (depth % r_blocks == 0 if r_blocks else depth == 0) != (p is None):
                raise InvalidInput(f"report at depth {depth}: depth and parent disagree "
                                   "(a chain's root, or a range's first block when chains "
                                   "are split, has none)")
        return cols

    def _check_vouched(self, vouched: Sequence[ObjectReport], cols: Sequence[int]
                       ) -> list[tuple[PrefixEntry | None, PrefixEntry | None]]:
        """Raise for what applying ``vouched`` (in this order; ``cols``: their columns) would
        refuse half way, or store unchecked: checked first, so a refused call changes
        nothing. Per report, the entries of its hash and of its parent's that the index
        holds now (None where it has none): applying them looks up only what it made."""
        depth_of: dict[BlockHash, int] = {}  # hashes named here that the index lacks
        parent_of: dict[BlockHash, BlockHash] = {}  # links this call makes
        made: set[BlockHash] = set()  # entries this call creates, in order
        parts, layout = self.index.parts, self.layout
        found: list[tuple[PrefixEntry | None, PrefixEntry | None]] = []
        for r, col in zip(vouched, cols, strict=True):
            check_report(layout, r, col)
            h, p, d = r.block_hash, r.parent_hash, r.depth
            e = parts[h[0]].get(h)  # (16-byte hashes: _check_shapes checked them)
            known = e.depth if e is not None else depth_of.setdefault(h, d)
            if known != d:
                raise _unchained_report(d, known)
            pe = None
            if p is not None:
                pe = parts[p[0]].get(p)
                known = pe.depth if pe is not None else depth_of.setdefault(p, d - 1)
                if known != d - 1:
                    raise _unchained_report(d - 1, known)
            found.append((e, pe))
            made.add(h)
            if p is None:
                continue  # a root (or a range's first block)
            if e is not None and e.parent is None:  # an orphan: the parent an earlier call named
                named = e.awaits
                if named is not None and named != p:
                    raise _other_parent(d)
            if pe is None and p not in made:
                continue  # an orphan: linked when its parent arrives
            linked = (e.parent.block_hash if e is not None and e.parent is not None
                      else parent_of.setdefault(h, p))
            if linked != p:
                raise _other_parent(d)
        return found

    def _confirm_one(
        self, o: Owner, owner: ShardId, entry: PrefixEntry, col: int, r: ObjectReport
    ) -> ObjRecord | None:
        if r.state is _ON_DISK:
            if entry.disk is not None and entry.disk[col] is not None:
                return None
            return self._add_disk_record(entry, col, _ON_DISK, owner, r)
        pool, block = o.pools.get(col), r.block
        if pool is None or entry.mem[col] is not None:
            return None
        generation = pool.claim_at(block, r.generation)  # (generations issued stay issued)
        if generation is None:
            return None
        kind = self.layout.columns[col].kind
        rec = new_record(kind, col, self.objects.new_id(), entry, r.state, owner, block,
                         generation, version=r.version, lo=r.lo, hi=r.hi)
        if r.version >= self._next_version:
            self._saw_version(r.version)
        pool.owner[block] = rec
        entry.mem[col] = rec
        if self._resume_point_of(rec):  # (the slot was empty: the point was not complete)
            self._track_resume_point(entry, False, self._complete(entry, rec))
        self.objects.put(rec)
        return rec  # (confirm_objects logs it and defers the entry's summary)

    # ---- helpers ------------------------------------------------------------------------

    def _add_disk_record(
        self, entry: PrefixEntry, col: int, state: State, disk_owner: ShardId,
        source: ObjRecord | ObjectReport,
    ) -> DiskRecord:
        """A DISK copy at ``entry``/``col`` carrying ``source``'s version and valid range."""
        if entry.disk is None:
            entry.disk = [None] * len(self.layout.columns)
        rec = new_record(
            Kind.DISK, col, self.objects.new_id(), entry, state, _NO_SHARD, -1, 0,
            version=source.version, lo=source.lo, hi=source.hi,
            inner=self.layout.columns[col].kind, disk_owner=disk_owner,
        )
        self._saw_version(source.version)
        assert isinstance(rec, DiskRecord)
        entry.disk[col] = rec
        self._disk_records += 1
        self._owner(disk_owner).disk[rec] = None
        self.objects.put(rec)
        return rec

    def _ensure_path(self, hashes: Sequence[BlockHash], last: int, first: int = 0
                     ) -> list[PrefixEntry]:
        """The entries at depths ``[first, last]`` (``hashes[0]`` is depth ``first``'s: a
        range of a split chain starts at an entry whose parent lives in another partition)."""
        self._check_path(hashes, last, first)
        out: list[PrefixEntry] = []
        parent: PrefixEntry | None = None
        for depth in range(first, last + 1):
            parent = self._entry_under(hashes[depth - first], parent, depth)
            out.append(parent)
        self._age(out)  # a written block is as recent as a looked-up one, its path with it
        return out

    def _check_path(self, hashes: Sequence[BlockHash], last: int, first: int = 0) -> None:
        """Raise what :meth:`_entry_under` would raise part way down the path to depth
        ``last``: checked first, so a refused call leaves no entry behind. An orphan's parent
        is the hash its report named (``awaits``), on this path as on a confirm's."""
        seen: set[BlockHash] = set()
        parent: PrefixEntry | None = None  # the known entry one depth up; None if made here
        for depth in range(first, last + 1):
            h = hashes[depth - first]
            e = self.index.get(h)
            clash = e is not None and (e.depth != depth or (
                depth > first and e.parent is not None and e.parent is not parent))
            if h in seen or clash:
                raise _unchained(depth, depth if e is None else e.depth)
            if e is not None and e.awaits is not None and depth > first and \
                    e.awaits != hashes[depth - first - 1]:
                raise _other_parent(depth)
            seen.add(h)
            parent = e

    def _entry_under(self, h: BlockHash, parent: PrefixEntry | None, depth: int,
                     parent_hash: BlockHash | None = None) -> PrefixEntry:
        """The entry of ``h`` at ``depth`` under ``parent``; made if the index lacks it.
        ``parent_hash``: the parent's hash where its entry is not there yet (a re-confirm's
        report): the entry waits for it as an orphan (:class:`Orphans`)."""
        part = self.index.parts[h[0]]  # (a checked 16-byte hash: its part, looked up once)
        e = part.get(h)
        if e is None:
            e = PrefixEntry(h, parent, depth, [None] * len(self.layout.columns))
            e.flags, e.gate = self._empty_summary[depth % self.layout.period]
            part[h] = e
            if parent is not None:
                parent.children += 1
            elif parent_hash is not None:
                self._orphans.wait(e, parent_hash)
            if self._orphans and self._orphans.waits_for(h):
                self._adopting.append(e)  # adopted a slice per lock hold (_adopt_some)
            return e
        if e.depth != depth or (None not in (e.parent, parent) and e.parent is not parent):
            raise _unchained(depth, e.depth)
        if e.parent is None and parent is not None:  # an orphan of a restart rebuild
            # (not reached while confirms and writes refuse another parent than the one it
            # waits for: kept so that a waiting orphan is never adopted twice)
            if e.awaits is not None:
                self._orphans.forget(e)
            self._adopt(e, parent)
        return e

    def _adopt_some(self, budget: int) -> bool:
        """Adopt up to ``budget`` of the orphans waiting for the entries queued in
        ``_adopting`` (made while orphans waited for them), oldest first: one slice as a
        confirm or an allocation returns, and in the reaper's slices, so no call adopts more
        than a slice however many entries it made that others wait for; True while some are
        left. (One whose entry left the index since
        waits for the next entry of its hash, as if it had never been made.) Until adopted an
        orphan is what it was before its parent came: the walk checks depths and reads no
        parent link, a confirm or write naming it under that parent adopts it at once, and
        only the eviction policies' counts above it lag."""
        while self._adopting and budget > 0:
            e = self._adopting[0]
            h = e.block_hash
            if self.index.parts[h[0]].get(h) is e:
                children = self._orphans.take(h, budget)
                for child in children:
                    self._adopt(child, e)
                budget -= len(children)
                if self._orphans.waits_for(h):
                    return True  # (the budget is spent)
            self._adopting.popleft()
        return bool(self._adopting)

    def _adopt(self, orphan: PrefixEntry, parent: PrefixEntry) -> None:
        """``parent`` is ``orphan``'s, made after it; the resume-point counts that stopped at
        the orphan go on above it. (One of another depth is not its parent: the reports
        contradict each other; it stays an orphan, and the walk, which checks every block's
        depth, never serves it out of place.)"""
        if parent.depth != orphan.depth - 1:
            return
        orphan.parent = parent
        parent.children += 1
        for point, step in self._cut_walks.pop(orphan, {}).items():
            self._count_resume_point(point, parent, step, 1)

    def _check_hashes(self, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            raise BadHash("no block hashes given; a prefix needs at least one")
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != BLOCK_HASH_BYTES:
                raise BadHash(f"block hash must be {BLOCK_HASH_BYTES} bytes, got {len(h)}")

    def check_placed(self, req: LookupRequest) -> None:
        """Raise :class:`MisplacedHash` if ``req``'s first hash is the hash of another block
        than the one it is given for (a batch is refused with it before any item is looked
        up; a hash out of place further in is refused by the walk)."""
        with self._lock:  # the walk's own rule, on the first hash (need 0: no gate asked)
            walk_blocks(self.index, req.block_hashes[:1], 0, [], None, None, req.first_block)

    def _check_root(self, hashes: Sequence[BlockHash]) -> None:
        """A partitioned view holds only the chains whose root routes to it."""
        part = self.partition
        if not part.whole and hashes and not part.owns_root(hashes[0]):
            expected = partition_of_root(hashes[0], part.count)
            raise WrongPartition(
                f"this metadata partition is {part}; the chain's root belongs to partition "
                f"{expected}: give every client the partitions in the deployment's order",
                partition=str(part), expected=expected)

    def _starts_range(self, depth: int) -> bool:
        """Whether an entry at ``depth`` has no parent in this view: a chain's root, or the
        first block of a range when chains are split (its parent is another partition's)."""
        r = self.range_blocks
        return depth % r == 0 if r else depth == 0

    def _check_range(self, first: int, nhashes: int, what: str) -> None:
        """A request's hashes start at a range's first block and stay inside that range
        (StateConfig.range_blocks): a range lives whole in one partition."""
        r = self.range_blocks
        if first < 0:
            raise InvalidInput(f"first_block must be >= 0, got {first}")
        if not r:
            if first:
                raise InvalidInput(
                    f"{what} from block {first}: this service keeps a chain whole "
                    "(range_blocks 0); send the hashes from block 0")
            return
        if first % r or nhashes > r:
            raise InvalidInput(
                f"{what} of {nhashes} hashes from block {first}: this service splits chains "
                f"every {r} blocks, so a request covers one range [kR, (k+1)R); the "
                "partitioned client (workers.partitioned) splits them")

    def _check_slot(self, r: AllocRequest, nhashes: int, first: int = 0) -> None:
        col = self._column(r.column)
        if not first <= r.depth < first + nhashes:
            raise InvalidInput(f"depth {r.depth} is outside the {nhashes} hashes given"
                               + (f" from block {first}" if first else ""))
        if not self.layout.lives_at(col, r.depth):
            raise InvalidInput(
                f"column {r.column!r} has no block ending at hash block {r.depth} "
                f"(its blocks end every {self.layout.columns[col].group.block_size} tokens)"
            )

    def _check_generation(self, rec: ObjRecord, generation: int) -> None:
        if generation > rec.generation:
            raise FutureGeneration(
                f"generation {generation} of object {rec.object_id} was never issued "
                f"(current {rec.generation})"
            )
        if generation < rec.generation:
            raise StaleHandle(f"generation {generation} of object {rec.object_id} is stale")

    def _column(self, name: str) -> int:
        col = self.layout.by_name.get(name)
        if col is None:
            raise UnknownGroup(
                f"unknown group {name!r}; the spec has {sorted(self.layout.by_name)}"
            )
        return col

    def _owner(self, owner: ShardId) -> Owner:
        o = self.owners.get(owner)
        if o is None:
            raise UnknownOwner(f"owner {owner!r} is not registered")
        return o

    def _object(self, object_id: ObjectId) -> ObjRecord:
        rec = self._live_object(object_id)
        if rec is None:
            raise UnknownObject(f"object {object_id} is unknown (never allocated, or gone)")
        return rec

    def _live_object(self, object_id: ObjectId) -> ObjRecord | None:
        """The record, or None; a record of a lost owner is buried when touched."""
        rec = self.objects.get(object_id)
        if rec is not None and self._dead(rec):
            self._bury(rec)  # a DISK record whose loaded copy died stays, at rest
            rec = self.objects.get(object_id)
        return rec

    def _handle(self, rec: ObjRecord) -> Handle:
        """One record's handle, built directly (an allocation returns one per object: packed
        and unpacked through a snapshot, it was ~30% of an allocate's time). The same fields
        as :meth:`_snapshot` gives: the owner to ask (:func:`_handle_shard`), the address its
        current pool's stride puts the block at (0 for a copy at rest)."""
        column = self.layout.columns[rec.column]
        shard, block = _handle_shard(rec), rec.block
        self._ordinal(shard)  # the shard table grows in the order handles name owners, as
        # through a snapshot: a memo and a fresh walk give the same table
        address = block * self._stride(shard, rec.column) if block >= 0 else 0
        return Handle(rec.object_id, rec.generation, shard, column.index, block, column.kind,
                      column.name, column.nbytes, column.abi_fingerprint, address)

    # TransitionContext, for preconditions
    def kv_version_for(self, record: ObjRecord) -> int | None:
        kv_col = self.layout.columns[record.column].indexes
        if kv_col is None:
            return None
        e = record.entry
        kv = e.mem[kv_col]  # (a lost owner's KV, not buried yet, is no KV to sync to)
        if kv is not None and kv.state is State.COMPRESSED_READY and not self._dead(kv):
            return kv.version
        disk = e.disk[kv_col] if e.disk else None
        if disk is not None and disk.state is State.ON_DISK_READY and not self._dead(disk):
            return disk.version
        return None

    def block_range(self, record: ObjRecord) -> tuple[int, int]:
        return self.layout.block_range(record.column, record.entry.depth)

    def tail_required(self, record: ObjRecord) -> int:
        return self.layout.tail_tokens(record.column, record.entry.depth)

    def _saw_version(self, version: int) -> None:
        """Versions issued from now on are above ``version`` (issued versions stay below
        CONTENT_VERSION_BASE, where writers' content versions live: those never move it)."""
        if self._next_version <= version < CONTENT_VERSION_BASE:
            self._next_version = version + 1

    def _align_of(self, rec: ObjRecord) -> int:
        """Largest power of two dividing the handle's address and length (layer 4), from
        the owner's pool: a record does not store it (8 B each)."""
        owner = self.owners.get(rec.shard)
        pool = owner.pools.get(rec.column) if owner is not None else None
        if pool is None:
            return 1  # no pool to place it: the least alignment, never a false "aligned"
        return pool.alignment_of(rec.block)

    def holds_of(self, record: ObjRecord) -> tuple[int, int]:
        return self.holds.pins.get(record, 0), self.holds.captures.get(record, 0)

    # ---- introspection ------------------------------------------------------------------

    def events_since(self, seq: int, limit: int = 1024) -> list[TransitionEvent]:
        """Events after ``seq`` (the log is bounded: older ones may be gone)."""
        with self._lock:
            return self.log.since(seq, limit)

    def object_count(self) -> int:
        """Objects the view holds (every kind, memory and disk)."""
        with self._lock:
            return len(self.objects)

    def owner_liveness(self) -> dict[ShardId, bool]:
        """Every owner registered since the start: alive or lost."""
        with self._lock:
            return {s: o.alive for s, o in self.owners.items()}

    def has_owner(self, owner: str) -> bool:
        with self._lock:
            return owner in self.owners

    def note_event(self, event: str) -> None:
        """Count one occurrence of ``event``, met by the service outside the state (an
        undecodable request): it shows in ``stats()["events"]`` beside the state's own."""
        with self._lock:
            self.counters.events[event] += 1

    def stats(self) -> dict[str, object]:
        with self._lock:
            adm = self.admission.stats()
            snap: dict[str, object] = dict(self.counters.snapshot())
            snap["partition"] = str(self.partition)
            snap["range_blocks"] = self.range_blocks
            snap["gauges"] = {
                "objects": len(self.objects),
                "owners_reaping": len(self._reaping),  # lost, objects not all buried yet
                "entries": len(self.index),
                "leases": len(self.leases.leases),
                "captures": len(self.captures),
                "topology_epoch": self.topology_epoch,
                "in_transit_objects": adm.in_transit_objects,
                "in_transit_bytes": adm.in_transit_bytes,
                "in_transit_peak_objects": adm.peak_objects,
                "admission_refused": adm.refused,
                "owners_alive": sum(o.alive for o in self.owners.values()),
                "owners_lost": sum(not o.alive for o in self.owners.values()),
            }
            # Who holds the in-transit tickets (bounded by the cap): a stuck transfer shows here.
            held = Counter(r.state.value for oid in self._tickets if (r := self.objects.get(oid)))
            gauges = snap["gauges"]
            assert isinstance(gauges, dict)
            gauges.update({f"in_transit_{state.lower()}": n for state, n in held.items()})
            return snap


_READABLE = {k: c.ready_states for k, c in contracts.CONTRACTS.items()}
_BLOCK = operator.attrgetter("block")
_HANDLE_BYTES = np.dtype(f"V{HANDLE_DTYPE.itemsize}")
_MAX_SHARD_ORDINAL = (1 << 16) - 1  # HANDLE_DTYPE.shard is a u16
_HANDLE_STRUCT = struct.Struct("<QQiH")  # HANDLE_DTYPE, one record
_FEW = 32
# A lookup whose path holds more disk copies than this packs every column record by record
# (the general path); below it, packed rows and a patch per disky entry.
_DISKY_PATCHED = 256


class _NoCopy(Exception):
    """A disky entry the funnel accepted has no copy serving a column (never, unless a test
    planted a bug in the funnel): the general path packs what there is."""
_MEM = operator.attrgetter("mem")
_SHARD = operator.attrgetter("shard")
_OBJECT_ID = operator.attrgetter("object_id")
_GENERATION = operator.attrgetter("generation")
_CONFIRMABLE = frozenset(
    {State.ON_DISK} | {st for c in contracts.CONTRACTS.values() for st in c.ready_states}
) - {State.ON_DISK_READY}
_MAX_POOL_BLOCKS = 1 << 24
# Enum members on a re-confirm's per-report path, read once: through their class each read
# costs ~0.1 us in Python 3.11 (EnumType.__getattr__ puts every class attribute read on the
# slow path), ~10x a module global.
_ON_DISK, _ALLOCATED = State.ON_DISK, State.ALLOCATED
_TAIL, _SWA = Kind.TAIL, Kind.SWA
_VERSIONED = frozenset({Kind.COMPRESSED, Kind.INDEXER})
_AGE_SLACK = 64  # lookups: LRU order is kept to this precision (see CacheState._age)


def check_report(layout: Layout, r: ObjectReport, col: int | None = None) -> None:
    """Raise unless ``r`` is a report a confirm takes (the one home of that rule: an owner
    filters what it vouches for with it). A vouched state must be one its column's kind can
    be read in (else no transition, not even LOSE, applies to the record), an SWA range must
    lie inside its block, and a complete tail must hold exactly the raw tokens its boundary
    needs (as TAIL_DONE demands: a tail vouched for with another length would be read as
    whole). ``col``: the column of ``r.column``, where the caller found it already."""
    if col is None:
        col = layout.by_name.get(r.column)
    if col is None:
        raise UnknownGroup(f"unknown group {r.column!r}; the spec has {sorted(layout.by_name)}")
    column = layout.columns[col]
    kind = column.kind
    if r.state is not _ON_DISK and r.state not in _READABLE[kind]:
        raise InvalidInput(f"report for {column.name!r} at depth {r.depth}: "
                           f"{r.state.value} is not a state of a {column.kind.value} object")
    if kind in _VERSIONED and r.version < 1:
        # an unset proto field reads 0: a KV or indexer vouched for at "version 0" could
        # pair with any other unset one
        raise UnsetVersion(f"report for {column.name!r} at depth {r.depth}: version "
                           f"{r.version}; a KV version is at least 1")
    if kind is _SWA:
        start, end = layout.block_range(col, r.depth)
        if not start <= r.lo <= r.hi <= end:
            raise InvalidInput(f"SWA report at depth {r.depth}: range [{r.lo}, {r.hi}) "
                               f"must lie inside its block [{start}, {end})")
    elif kind is _TAIL:
        need = layout.tail_tokens(col, r.depth)
        if r.hi != need:
            raise InvalidInput(f"tail report for {column.name!r} at depth {r.depth}: "
                               f"{r.hi} raw tokens, its boundary needs exactly {need}")


def _empty_summaries(layout: Layout) -> tuple[tuple[int, int], ...]:
    """Per depth residue, ``contracts.summarise``'s flags and gate of an entry holding no
    record (what a new entry starts with: computed once, not per entry)."""
    out = []
    for d in range(layout.period):
        e = PrefixEntry(BlockHash(bytes(BLOCK_HASH_BYTES)), None, d, [None] * len(layout.columns))
        contracts.summarise(e, layout, lambda _rec: 1)  # (no record: alignment never asked)
        out.append((e.flags, e.gate))
    return tuple(out)


def segment_blocks_for(layout: Layout, asked: int | None) -> int:
    """The walk segment size: ``asked`` if the layout can take it (0 = off, else a multiple
    of its period: runs must start where the layout repeats), else InvalidInput; None: the
    smallest multiple of the period from DEFAULT_SEGMENT_BLOCKS up (a spec's period need not
    divide 64: block sizes 64 and 96 repeat every 6 hash blocks of 32)."""
    period = layout.period
    if asked is None:
        return -(-DEFAULT_SEGMENT_BLOCKS // period) * period
    if asked < 0 or asked % period:
        raise InvalidInput(f"segment_blocks must be 0 (off) or a positive multiple of "
                           f"{period} (the layout's period), got {asked}")
    return asked


def _checked_pool(name: str, cfg: PoolConfig) -> PoolConfig:
    if not 1 <= cfg.num_blocks <= _MAX_POOL_BLOCKS:
        raise InvalidInput(f"pool {name!r}: num_blocks must be in [1, {_MAX_POOL_BLOCKS}]")
    if not 0 <= cfg.first < cfg.num_blocks:
        raise InvalidInput(f"pool {name!r}: first block {cfg.first} must be in [0, num_blocks)")
    if cfg.stride < 1 or cfg.base_align < 1 or cfg.base_align & (cfg.base_align - 1):
        raise InvalidInput(f"pool {name!r}: stride >= 1 and a power-of-two base_align needed")
    return cfg


def _handle_shard(rec: ObjRecord) -> ShardId:
    """Where to ask for the bytes: the memory owner, or the disk owner of a copy at rest."""
    return rec.shard if rec.block >= 0 or rec.disk_owner is None else rec.disk_owner


_COPY_ENDS = frozenset({Event.DROP_COPY, Event.COPY_LOST, Event.LOAD_FAILED})

_PARTNER_EVICTABLE = {
    (Kind.INDEXER, State.INDEXER_SYNCED),
    (Kind.INDEXER, State.INDEXER_WRITTEN),
    (Kind.COMPRESSED, State.COMPRESSED_READY),
}

_DISK_EVENTS: dict[Event, Callable[[CacheState, ObjRecord, Params], None]] = {
    ev: (lambda s, r, p, ev=ev: s._disk_event(r, p, ev))  # type: ignore[misc]
    for ev in (
        Event.OFFLOAD_COMMITTED,
        Event.OFFLOAD_FAILED,
        Event.LOAD_VERIFIED,
        Event.LOAD_FAILED,
        Event.DROP_COPY,
        Event.MARK_CORRUPT,
        Event.LOSE,
    )
}


def _unchained_report(depth: int, known: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known at depth {known}; "
                   "hashes must be chained")


def _other_parent(depth: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known with another parent; "
                   "hashes must be chained")


def _unchained(depth: int, known: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known at depth {known} "
                   "with another parent; hashes must be chained")


def _check_item(i: int, item: ObjectTransitions) -> None:
    if not item.events:
        raise InvalidInput(f"item {i}: no events; an item reports at least one event of its "
                           "object")
    if len(item.params) > len(item.events):
        raise InvalidInput(f"item {i}: {len(item.params)} params for {len(item.events)} "
                           "event(s); params[j] goes with events[j]")
    for event in item.events:
        _check_reported(event, f"item {i}: ")


def _check_reported(event: Event, where: str = "") -> None:
    """Refuse an event only the core's own paths cause (:data:`CORE_ONLY_EVENTS`)."""
    if event in CORE_ONLY_EVENTS:
        raise InvalidInput(f"{where}{event.value} is not reported: begin_load and "
                           "begin_offload cause it, with the block and admission they reserve")


def _params_at(item: ObjectTransitions, k: int) -> Params | None:
    return item.params[k] if k < len(item.params) else None

