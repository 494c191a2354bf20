"""The one state view: every object, every prefix entry, every pool, lease and capture.

Allocation, transitions, eviction and lookup all read and write the same records, so there is
one state view, not two. :class:`CacheState` is its facade: each public method takes the one
re-entrant lock for a few microseconds (CPython's GIL serialises this work anyway; see
docs/architecture.md for the measurement) and hands the call to the owner of that path. The
view performs no I/O; owners (shards, disk tiers) report what they did.

Who does what (each a module of its own, all over one :class:`~.tables.Tables`)::

    CacheState (this facade: the lock, one short method per call)
      Lookups    lookup, replay, check_placed         core/lookups.py  (+ Packer: packing.py)
      Placement  allocate, evict                      core/placement.py
      Transfers  begin_offload, begin_load            core/transfers.py
      Reports    transition, transition_many          core/reports.py
      Rebuild    confirm_objects, settle_pending      core/rebuild.py
      Ownership  register_owner, heartbeat, loss, reap  core/ownership.py
      Leasing    release_lease, check_read, captures  core/leasing.py
        Tables   records, owners, holds, books; apply/bury/clean   core/tables.py
        PrefixTree  entries, orphans, SWA counts, ages              core/tree.py

Lifecycle of a memory object::

    allocate -> ALLOCATED -> (WRITING) -> READY state of its kind -> EVICTED | LOST | CORRUPT
                                               \\-> begin_offload -> DISK copy (see transitions)

Terminal records are detached at once: their block is released (generation bumped), and the
entry is dropped when nothing is left in it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from .admission import AdmissionGate
from .allocator import PoolConfig
from .api import (
    Allocation,
    AllocRequest,
    LookupRequest,
    Match,
    ObjectReport,
    ObjectTransitions,
    StateConfig,
    TransitionEvent,
    TransitionResult,
)
from .checks import Capture, Holds, LeaseBook
from .counters import Counters
from .errors import HkvError
from .events import EventLog
from .ids import BlockHash, CaptureId, LeaseId, ObjectId, ShardId
from .inputs import check_reported
from .kvevents import FeedBatch, ResidencyFeed
from .layout import Layout
from .leasing import Leasing
from .lookups import Lookups
from .match import Memo
from .memo import LookupMemo
from .objects import ObjectTable
from .owners import REAP_SLICE, Owner
from .ownership import Ownership
from .packing import Packer
from .partitions import Partition
from .placement import Placement
from .prefix_index import PrefixIndex
from .rebuild import Rebuild
from .records import Handle, ObjRecord
from .reports import Reports
from .sightings import Sightings
from .spec import CacheSpec
from .states import Event
from .tables import Tables
from .transfers import Transfers
from .transitions import Params

__all__ = ["CacheState"]


class CacheState:
    """The state view's facade: one lock, one short method per public call. The methods
    shared with the metadata port say what they do there (``core/port.py``)."""

    def __init__(
        self,
        spec: CacheSpec,
        config: StateConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        lock: AbstractContextManager[Any] | None = None,
    ) -> None:
        """``lock``: what serialises the view's methods (re-entrant; default
        ``threading.RLock``); the service bench passes one that times its waits and holds."""
        t = self._tables = Tables(spec, config or StateConfig(), clock)
        self._lock: AbstractContextManager[Any] = lock if lock is not None else threading.RLock()
        self._packer = Packer(t)
        self._lookups = Lookups(t, self._packer, t.config)
        self._placement = Placement(t)
        self._transfers = Transfers(t, self._placement)
        self._reports = Reports(t, self._placement)
        self._rebuild = Rebuild(t)
        self._ownership = Ownership(t)
        self._leasing = Leasing(t)
        self._sightings = Sightings()
        # what callers (the server, benches, tests) read of the view: the same objects
        self.spec: CacheSpec = spec
        self.layout: Layout = t.layout
        self.admission: AdmissionGate = t.admission
        self.counters: Counters = t.counters
        self.index: PrefixIndex = t.index
        self.partition: Partition = t.partition
        self.range_blocks: int = t.range_blocks
        self.objects: ObjectTable = t.objects
        self.owners: dict[ShardId, Owner] = t.owners
        self.leases: LeaseBook = t.leases
        self.holds: Holds = t.holds
        self.captures: dict[CaptureId, Capture] = t.captures
        self.log: EventLog = t.log
        self.memo: LookupMemo = self._lookups.memo
        self.segment_blocks: int = self._packer.segment_blocks

    @property
    def config(self) -> StateConfig:
        return self._tables.config

    @config.setter
    def config(self, value: StateConfig) -> None:
        """(Tests swap it: the limits read per call follow; what was built from it stays.)"""
        self._tables.config = value

    @property
    def clock(self) -> Callable[[], float]:
        return self._tables.clock

    @property
    def topology_epoch(self) -> int:
        return self._tables.topology_epoch

    # ---- owners (core/ownership.py) -----------------------------------------------------

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig],
                       instance: int = 0) -> int:
        with self._lock:
            return self._ownership.register_owner(owner, pools, instance)

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        with self._lock:
            self._ownership.heartbeat(owner, incarnation)

    def expire_owners(self) -> list[ShardId]:
        with self._lock:
            return self._ownership.expire_owners()

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        with self._lock:
            return self._ownership.mark_owner_lost(owner, witnesses, instance)

    def reap(self, budget: int = REAP_SLICE) -> bool:
        with self._lock:
            return self._ownership.reap(budget)

    def reap_all(self) -> None:
        """Reap until nothing is left, a slice per lock hold (in-process ports, tests)."""
        while self.reap():
            pass

    # ---- save admission (core/sightings.py) -----------------------------------------------

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        with self._lock:
            return self._sightings.admit(block_hashes, needed, offered_from)

    # ---- allocation, eviction, transfers (core/placement.py, core/transfers.py) ----------

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[Allocation]:
        # (token_ids: for the event stream's BlockStored, kept by the server's edge; the view
        # has no use for them)
        with self._lock:
            return self._placement.allocate(block_hashes, requests, owner,
                                            first_block)

    def evict(self, object_id: ObjectId) -> None:
        with self._lock:
            self._placement.evict(object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        with self._lock:
            return self._transfers.begin_offload(object_id, disk_owner)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        with self._lock:
            return self._transfers.begin_load(object_id, owner)

    # ---- transitions (core/reports.py) --------------------------------------------------

    def transition(self, object_id: ObjectId, event: Event, params: Params | None = None,
                   generation: int | None = None) -> TransitionResult:
        check_reported(event)
        with self._lock:
            return self._reports.transition(object_id, event, params, generation)

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        with self._lock:
            return self._reports.transition_many(items)

    # ---- lookup (core/lookups.py) -------------------------------------------------------

    def lookup(self, req: LookupRequest) -> Match:
        with self._lock:
            return self._lookups.lookup(req)

    def replay(self, memo: Memo) -> bool:
        with self._lock:
            return self._lookups.replay(memo)

    def check_placed(self, req: LookupRequest) -> None:
        with self._lock:
            self._lookups.check_placed(req)

    # ---- leases, reads, captures (core/leasing.py) ---------------------------------------

    def release_lease(self, lease_id: LeaseId) -> None:
        with self._lock:
            self._leasing.release_lease(lease_id)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        with self._lock:
            self._leasing.check_read(handle, lease_id)

    def register_capture(self, handles: Sequence[Handle]) -> tuple[CaptureId, int]:
        with self._lock:
            return self._leasing.register_capture(handles)

    def release_capture(self, capture_id: CaptureId) -> None:
        with self._lock:
            self._leasing.release_capture(capture_id)

    def capture_status(self, capture_id: CaptureId) -> tuple[bool, int]:
        with self._lock:
            return self._leasing.capture_status(capture_id)

    def holds_of(self, record: ObjRecord) -> tuple[int, int]:
        """(leases, captures) holding ``record``."""
        with self._lock:
            return self._tables.holds_of(record)

    # ---- rebuild after a restart (core/rebuild.py) ----------------------------------------

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int) -> int:
        """How many of ``reports`` :meth:`confirm_objects` re-created."""
        return sum(1 for oid in self.confirm_objects(owner, reports, incarnation) if oid)

    def confirm_objects(self, owner: ShardId, reports: Sequence[ObjectReport],
                        incarnation: int) -> list[ObjectId | None]:
        with self._lock:
            return self._rebuild.confirm_objects(owner, reports, incarnation)

    def settle_pending(self) -> int:
        with self._lock:
            return self._rebuild.settle_pending()

    # ---- introspection ------------------------------------------------------------------

    def events_since(self, seq: int, limit: int = 1024) -> list[TransitionEvent]:
        """Events after ``seq`` (the log is bounded: older ones may be gone)."""
        with self._lock:
            return self._tables.log.since(seq, limit)

    def poll_residency(self, feed: ResidencyFeed, limit: int = 4096) -> FeedBatch:
        """What became readable in a tier, or stopped, since ``feed`` last read the log (at
        most ``limit`` log entries; a new feed, or one the bounded log left behind, starts
        over with every object resident now, ``limit`` slots a call): the KV event stream's
        source. The lock is held only while the feed copies what it read."""
        with self._lock:
            taken = feed.take(self._tables, limit)
        return feed.changes(taken, self._tables)

    def object_count(self) -> int:
        """Objects the view holds (every kind, memory and disk)."""
        with self._lock:
            return len(self._tables.objects)

    def owner_liveness(self) -> dict[ShardId, bool]:
        """Every owner registered since the start: alive or lost."""
        with self._lock:
            return {s: o.alive for s, o in self._tables.owners.items()}

    def has_owner(self, owner: str) -> bool:
        with self._lock:
            return owner in self._tables.owners

    def note_event(self, event: str) -> None:
        """Count one occurrence of ``event``, met by the service outside the state (an
        undecodable request): it shows in ``stats()["events"]`` beside the state's own."""
        with self._lock:
            self.counters.events[event] += 1

    def stats(self) -> dict[str, object]:
        with self._lock:
            return self._tables.stats()
