"""The record tables of one state view, and the mutators every path calls.

``Tables`` holds what the view knows: every object record (``objects``), the owners and
their block pools (``owners``), what holds a record (leases, captures), transfers in flight
(admission tickets), the event log and the counters; the prefix entries are its
:class:`~hkv_service.core.tree.PrefixTree`. The paths above it (allocation, reports, lookup,
re-confirm, owner loss, leases) all change records through the same few mutators here::

    apply(rec, event)  -- the table's move (transitions.apply), then:
        captures over a record that ended are invalid     (invalidate_captures)
        terminal: detach (slot emptied, block released)    (detach, release_copy)
        a resume point completed or broken: SWA counts     (tree.track)
        after_change: entry summarised, event logged, an emptied entry collected

    bury(rec)  -- a record of a lost owner ends (LOST, or back at rest for a disk copy
                  whose loaded copy died): apply(LOSE / COPY_LOST / LOAD_FAILED)
    clean(hashes)  -- bury the dead records of the entries a path is about to read

Every method runs under the view's lock (``CacheState`` takes it once per public call).
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence

from . import contracts
from .admission import AdmissionGate, Ticket
from .api import ObjectReport, StateConfig
from .checks import Capture, LeaseBook
from .counters import Counters
from .errors import InvalidInput, UnknownObject, UnknownOwner
from .events import EventLog
from .hashing import CONTENT_VERSION_BASE
from .ids import CaptureId, ObjectId, ShardId
from .layout import Layout
from .objects import ObjectTable
from .owners import Owner, Reap, dead, disk_part_alive
from .partitions import check_range_blocks
from .records import DiskRecord, Handle, ObjRecord, PrefixEntry, mem_at, new_record, set_mem
from .spec import CacheSpec
from .states import TERMINAL_STATES, Event, Kind, State
from .transitions import Params
from .transitions import apply as apply_table
from .tree import PrefixTree

__all__ = ["COPY_ENDS", "READABLE", "Tables", "handle_shard"]

NO_SHARD = ShardId("")  # a DISK object with no memory copy
READABLE = contracts.READY_STATES  # (a module global: read on every read check)
COPY_ENDS = frozenset({Event.DROP_COPY, Event.COPY_LOST, Event.LOAD_FAILED})
_TRANSFER_ENDS = frozenset({Event.OFFLOAD_COMMITTED, Event.LOAD_VERIFIED, Event.LOAD_FAILED,
                            Event.OFFLOAD_FAILED})
_MAX_SHARD_ORDINAL = (1 << 16) - 1  # HANDLE_DTYPE.shard is a u16


class Tables:
    """The records, owners, holds and books of one state view; the mutators over them."""

    def __init__(self, spec: CacheSpec, config: StateConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.layout = layout = Layout(spec)
        self.config = config
        self.clock = clock
        self.admission = AdmissionGate(config.admission)
        self.counters = Counters()
        self.partition = config.partition
        self.range_blocks = check_range_blocks(config.range_blocks, layout.period)
        self.tree = PrefixTree(layout, self.range_blocks)
        self.index = self.tree.index
        self.objects = ObjectTable(index=self.partition.index, count=self.partition.count)
        self.owners: dict[ShardId, Owner] = {}
        # lost owner incarnations whose records are still to be buried (see core/owners.py);
        # while it is not empty, every path that serves or reuses a record asks dead() first
        self.reaping: deque[Reap] = deque()
        self.loss_epoch = 0  # moves on with every owner loss (PrefixEntry.clean)
        self.owners_epoch = 0  # moves on whenever the owner table does (memo keys carry it)
        self.leases = LeaseBook(next_id=self.partition.index, step=self.partition.count)
        self.holds = self.leases.holds  # leases and captures per record
        self.captures: dict[CaptureId, Capture] = {}
        self.topology_epoch = 0
        # from a random base, as object and lease ids: an old capture id must not name a new one
        self.capture_ids = itertools.count(random.SystemRandom().getrandbits(32) + 1)
        self.log = EventLog(config.log_capacity, [c.name for c in layout.columns])
        self.tickets: dict[ObjectId, Ticket] = {}
        self.disk_records = 0  # 0 lets lookups skip per-record verdicts
        # KV versions: unique for this view's lifetime *and* above every version an owner
        # re-confirmed or a client passed, or a KV rewritten after a restart could get the
        # version a stale indexer was synced to and that indexer would pass as synced.
        self.next_version = 1
        self._ordinals: dict[ShardId, int] = {}  # shard name -> index in shard_names
        self.shard_names: tuple[ShardId, ...] = ()
        # strides() per column, as of (owners_epoch, len(shard_names)): a pool's stride
        # changes only with the owner table (an owner registered again, or lost), whose
        # epoch moves on, and the name table only grows (a lookup packs every column)
        self._strides: dict[int, tuple[int, ...]] = {}
        self._strides_as_of = (0, 0)

    # ---- accessors ------------------------------------------------------------------------

    def owner(self, owner: ShardId) -> Owner:
        o = self.owners.get(owner)
        if o is None:
            raise UnknownOwner(f"owner {owner!r} is not registered")
        return o

    def current_owner(self, owner: ShardId, incarnation: int) -> Owner:
        """The owner, if ``incarnation`` is the one its last registration returned and the view
        has not declared it lost since; else UnknownOwner (re-register)."""
        o = self.owner(owner)
        if o.incarnation != incarnation or not o.alive:
            raise UnknownOwner(
                f"owner {owner!r} incarnation {incarnation} is not current; re-register"
            )
        return o

    def record(self, object_id: ObjectId) -> ObjRecord:
        rec = self.live_record(object_id)
        if rec is None:
            raise UnknownObject(f"object {object_id} is unknown (never allocated, or gone)")
        return rec

    def live_record(self, object_id: ObjectId) -> ObjRecord | None:
        """The record, or None; a record of a lost owner is buried when touched."""
        rec = self.objects.get(object_id)
        if rec is not None and self.dead(rec):
            self.bury(rec)  # a DISK record whose loaded copy died stays, at rest
            rec = self.objects.get(object_id)
        return rec

    def handle(self, rec: ObjRecord) -> Handle:
        """One record's handle, built directly (an allocation returns one per object: packed
        and unpacked through a snapshot, it was ~30% of an allocate's time). The same fields
        as ``Packer.snapshot`` gives: the owner to ask (:func:`handle_shard`), the address
        its current pool's stride puts the block at (0 for a copy at rest)."""
        column = self.layout.columns[rec.column]
        shard, block = handle_shard(rec), rec.block
        self.ordinal(shard)  # the shard table grows in the order handles name owners, as
        # through a snapshot: a memo and a fresh walk give the same table
        address = block * self.stride(shard, rec.column) if block >= 0 else 0
        return Handle(rec.object_id, rec.generation, shard, column.index, block, column.kind,
                      column.name, column.nbytes, column.abi_fingerprint, address)

    def ordinal(self, shard: ShardId) -> int:
        """Index of ``shard`` in the shard-name table packed handles refer to (never reused:
        a cached row stays meaningful for as long as it lives)."""
        ordinal = self._ordinals.get(shard)
        if ordinal is None:
            if len(self._ordinals) > _MAX_SHARD_ORDINAL:
                raise InvalidInput(f"more than {_MAX_SHARD_ORDINAL + 1} distinct owner names")
            ordinal = self._ordinals[shard] = len(self._ordinals)
            self.shard_names = (*self.shard_names, shard)
        return ordinal

    def strides(self, col: int) -> tuple[int, ...]:
        """Per shard ordinal: the block stride of its pool for ``col`` (0: no such pool)."""
        as_of = (self.owners_epoch, len(self.shard_names))
        if as_of != self._strides_as_of:
            self._strides.clear()
            self._strides_as_of = as_of
        got = self._strides.get(col)
        if got is None:
            got = self._strides[col] = tuple(self.stride(name, col)
                                             for name in self.shard_names)
        return got

    def stride(self, shard: ShardId, col: int) -> int:
        """The block stride of ``shard``'s current pool for ``col`` (0: no such pool)."""
        owner = self.owners.get(shard)
        pool = owner.pools.get(col) if owner is not None else None
        return pool.config.stride if pool is not None else 0

    def align_of(self, rec: ObjRecord) -> int:
        """Largest power of two dividing the handle's address and length (layer 4), from
        the owner's pool: a record does not store it (8 B each)."""
        owner = self.owners.get(rec.shard)
        pool = owner.pools.get(rec.column) if owner is not None else None
        if pool is None:
            return 1  # no pool to place it: the least alignment, never a false "aligned"
        return pool.alignment_of(rec.block)

    def saw_version(self, version: int) -> None:
        """Versions issued from now on are above ``version`` (issued versions stay below
        CONTENT_VERSION_BASE, where writers' content versions live: those never move it)."""
        if self.next_version <= version < CONTENT_VERSION_BASE:
            self.next_version = version + 1

    # ---- TransitionContext, for preconditions ---------------------------------------------

    def kv_version_for(self, record: ObjRecord) -> int | None:
        kv_col = self.layout.columns[record.column].indexes
        if kv_col is None:
            return None
        e = record.entry
        kv = mem_at(e, kv_col)  # (a lost owner's KV, not buried yet, is no KV to sync to)
        if kv is not None and kv.state is State.COMPRESSED_READY and not self.dead(kv):
            return kv.version
        disk = e.disk[kv_col] if e.disk else None
        if disk is not None and disk.state is State.ON_DISK_READY and not self.dead(disk):
            return disk.version
        return None

    def block_range(self, record: ObjRecord) -> tuple[int, int]:
        return self.layout.block_range(record.column, record.entry.depth)

    def tail_required(self, record: ObjRecord) -> int:
        return self.layout.tail_tokens(record.column, record.entry.depth)

    def holds_of(self, record: ObjRecord) -> tuple[int, int]:
        return self.holds.pins.get(record, 0), self.holds.captures.get(record, 0)

    # ---- records of lost owners ------------------------------------------------------------

    def dead(self, rec: ObjRecord) -> bool:
        """``rec`` belongs to a lost owner and is not buried yet (never, while nothing is
        being reaped: a buried record has left the view)."""
        return bool(self.reaping) and dead(rec, self.owners)

    def bury_if_dead(self, rec: ObjRecord) -> None:
        """What the reaper does with a record a lost incarnation's pool or disk set still
        names: bury it unless it lives on elsewhere. A DISK record's loaded copy on the lost
        pool is buried (back to rest) when something touches it, and the record can then be
        loaded again, onto a live pool: the lost pool still names it at the old block, and
        burying it there failed the new load under its loader (its new block freed while the
        loader's bytes were landing in it)."""
        if dead(rec, self.owners):
            self.bury(rec)

    def bury(self, rec: ObjRecord) -> None:
        """A dead record ends: LOST, or, if only its loaded memory copy died (its disk copy
        lives on another owner's tier), back to ON_DISK."""
        if rec.kind is Kind.DISK and disk_part_alive(rec, self.owners):
            if rec.state is State.ON_DISK_READY:
                self.apply(rec, Event.COPY_LOST, Params())
            elif rec.state is State.ON_DISK_INFLIGHT:
                self.disk_event(rec, Params(), Event.LOAD_FAILED)  # releases its ticket too
            return
        self.apply(rec, Event.LOSE, Params())

    def clean(self, hashes: Iterable[bytes], walk_need: int = 0) -> None:
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
        if not self.reaping:
            return
        epoch, get = self.loss_epoch, self.index.get
        for h in hashes:
            e = get(h)
            if e is None:
                if walk_need:
                    return
                continue
            if e.clean != epoch:
                for rec in [*e.mem, *(e.disk or ())]:
                    if rec is not None and rec.state not in TERMINAL_STATES and self.dead(rec):
                        self.bury(rec)
                e.clean = epoch
            if walk_need and contracts.stops_walk(e, walk_need):
                return

    def invalidate_captures_of_dead(self) -> None:
        """A capture over a record of a lost owner replays over memory that is gone."""
        for cap in self.captures.values():
            if cap.valid and any(dead(r, self.owners) for r in cap.records):
                cap.valid = False
                self.topology_epoch += 1

    def invalidate_captures(self, rec: ObjRecord) -> None:
        self.topology_epoch += 1
        for cap in self.captures.values():
            if any(r is rec for r in cap.records):
                cap.valid = False

    # ---- the mutators ----------------------------------------------------------------------

    def apply(self, rec: ObjRecord, event: Event, params: Params) -> None:
        tree = self.tree
        point = tree.resume_point_of(rec)
        was = point and tree.complete(rec.entry, rec)
        apply_table(rec, event, params, self)
        if rec in self.holds.captures and (rec.state in TERMINAL_STATES or event in COPY_ENDS):
            # Policy events (EVICT, DROP_COPY) are refused while a capture holds the object, so
            # this is a fact (lost, corrupt, a failed load): a graph over it must not replay.
            self.invalidate_captures(rec)
        if rec.state in TERMINAL_STATES:
            self.detach(rec)
        elif event in COPY_ENDS:
            self.release_copy(rec)
        if point:
            tree.track(rec.entry, was, tree.complete(rec.entry, rec))
        self.after_change(rec)

    def after_change(self, rec: ObjRecord) -> None:
        contracts.summarise(rec.entry, self.layout, self.align_of)
        self.log_events((rec,))
        if rec.state in TERMINAL_STATES:
            self.tree.gc_entry(rec.entry)

    def log_events(self, recs: Sequence[ObjRecord]) -> None:
        """Count and log the state each of ``recs`` reached (the Watch stream's events), in
        order; one clock read for them all (a re-confirm logs a batch at once)."""
        states = [rec.state for rec in recs]
        counts = self.counters.transitions
        for rec, state in zip(recs, states, strict=True):
            counts[(rec.kind, state)] += 1
        self.log.add(recs, states, self.clock())

    def detach(self, rec: ObjRecord) -> None:
        entry, col = rec.entry, rec.column
        if rec.kind is Kind.DISK:
            assert entry.disk is not None
            entry.disk[col] = None
            if not any(entry.disk):
                entry.disk = None  # what the lookup's fast path tests (Packer.disky)
            self.disk_records -= 1
            tier = self.owners.get(rec.disk_owner) if rec.disk_owner is not None else None
            if tier is not None:
                tier.disk.pop(rec, None)
            self.end_transfer(rec)
        else:
            set_mem(entry, col, None)
        self.release_copy(rec)
        self.objects.pop(rec.object_id)

    def release_copy(self, rec: ObjRecord) -> None:
        """Free the memory block behind ``rec`` (if any): its generation moves on."""
        if rec.block < 0:
            return
        o = self.owners.get(rec.shard)
        pool = o.pools.get(rec.column) if o else None
        if pool is not None and pool.owner_of(rec.block) is rec:  # (not a lost incarnation's)
            pool.release(rec.block)
        rec.block = -1

    def end_transfer(self, rec: ObjRecord) -> None:
        ticket = self.tickets.pop(rec.object_id, None)
        if ticket is not None:
            self.admission.release(ticket)

    def disk_event(self, rec: ObjRecord, params: Params, event: Event) -> None:
        self.apply(rec, event, params)  # raises (changing nothing) if illegal
        if event in _TRANSFER_ENDS:
            self.end_transfer(rec)  # the transfer ended, whichever way: return its ticket

    def add_disk_record(
        self, entry: PrefixEntry, col: int, state: State, disk_owner: ShardId,
        source: ObjRecord | ObjectReport,
    ) -> DiskRecord:
        """A DISK copy at ``entry``/``col`` carrying ``source``'s version and valid range."""
        if entry.disk is None:
            entry.disk = [None] * len(self.layout.columns)
        rec = new_record(
            Kind.DISK, col, self.objects.new_id(), entry, state, NO_SHARD, -1, 0,
            version=source.version, lo=source.lo, hi=source.hi,
            inner=self.layout.columns[col].kind, disk_owner=disk_owner,
        )
        self.saw_version(source.version)
        assert isinstance(rec, DiskRecord)
        entry.disk[col] = rec
        self.disk_records += 1
        self.owner(disk_owner).disk[rec] = None
        self.objects.put(rec)
        return rec

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        adm = self.admission.stats()
        snap: dict[str, object] = dict(self.counters.snapshot())
        snap["partition"] = str(self.partition)
        snap["range_blocks"] = self.range_blocks
        gauges: dict[str, int] = {
            "objects": len(self.objects),
            "owners_reaping": len(self.reaping),  # lost, objects not all buried yet
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
        held = Counter(r.state.value for oid in self.tickets if (r := self.objects.get(oid)))
        gauges.update({f"in_transit_{state.lower()}": n for state, n in held.items()})
        snap["gauges"] = gauges
        return snap


def handle_shard(rec: ObjRecord) -> ShardId:
    """Where to ask for the bytes: the memory owner, or the disk owner of a copy at rest."""
    return rec.shard if rec.block >= 0 or rec.disk_owner is None else rec.disk_owner
