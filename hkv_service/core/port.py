"""The metadata port: what every caller of the state view may ask of it, and what each call
does. ``CacheState`` answers it in process; ``workers.local.LocalMetadata`` (in process, no
reaper thread), ``workers.raylink.ActorMetadata`` (a Ray actor), ``hkv_service.client.
MetadataClient`` (gRPC) and ``workers.partitioned.PartitionedMetadata`` (N partitions) are its
adapters, each with these signatures (a test holds them to it). The data plane, the shards,
the connector and the demo are written against this port only.

Each method says whether it mutates the view, what stays valid after it, which errors it
raises (``core/errors.py``; over gRPC the same classes, through one status table) and what it
costs. Costs are the view's, under its one lock; an adapter adds its transport (one call).
Every call is atomic: it holds the view's lock throughout, and a call that raises changed
nothing unless it says otherwise.

Handles (``Handle``, ``Match.columns``) name ``(object id, generation, block)``: they stay
valid while the object holds its block at that generation. Anything that frees the block
(eviction, loss, corruption, a failed load, a dropped loaded copy) moves the generation on, so
a handle then reads as stale (``StaleHandle``, a shard's STALE), never as other bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

from .api import (
    Allocation,
    AllocRequest,
    LookupRequest,
    Match,
    ObjectReport,
    ObjectTransitions,
    Params,
    PoolConfig,
    TransitionResult,
)
from .errors import HkvError
from .ids import BlockHash, LeaseId, ObjectId, ShardId
from .records import Handle
from .spec import CacheSpec
from .states import Event

__all__ = ["PORT_METHODS", "MetadataPort"]


@runtime_checkable
class MetadataPort(Protocol):
    def get_spec(self) -> CacheSpec:
        """The cache spec the view was built for (groups, block sizes, hash block).

        Pure; the same for the view's life. O(1) (an adapter: one call)."""
        ...

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig],
                       instance: int = 0) -> int:
        """Register ``owner`` (a shard) with one block pool per column it serves; returns its
        new incarnation, what ``heartbeat`` and ``confirm_objects`` must name.

        Mutates: a new incarnation with fresh pools (every block free). A known owner coming
        back has lost its memory: its old incarnation is declared lost first, as by
        :meth:`mark_owner_lost` (its objects' handles go stale; they are buried lazily). The
        owner epoch moves on, so no lookup memo or replayed reply answers across it.
        ``instance``: the owner process's own id, what loss reports name.
        Raises: UnknownGroup (a pool for a column the spec lacks), InvalidInput (a pool's
        bounds), ResourceExhausted (``max_owners`` live owners already). All checked first.
        Cost: O(pools), plus the old incarnation's transfers in flight and captures."""
        ...

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        """``owner`` is alive: its silence clock restarts.

        Mutates: the owner's last-seen time only. Raises: UnknownOwner when the owner is not
        registered, or ``incarnation`` is not its current one or was declared lost (the
        owner must register again and re-confirm what it holds). O(1)."""
        ...

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        """Declare ``owner``'s memory gone; returns the objects it held, 0 if it was lost
        already, None if the report is stale and was ignored (``instance`` or every witness
        names a process a newer registration replaced).

        Mutates: O(1) in the objects: the incarnation is marked dead, so none of its objects
        is a hit from now on; they are buried (LOST, or back at rest for a disk copy whose
        loaded copy died) later, by the reaper's slices or when a call touches one. The owner
        and loss epochs move on (memos stop answering; every entry is cleaned again before
        it serves); its transfers in flight end now (admission tickets back) and captures
        over it become invalid (the topology epoch moves on). A stale report changes only a
        counter. Raises: UnknownOwner (never registered). Cost: O(transfers in flight +
        captures)."""
        ...

    def confirm(self, owner: ShardId, reports: Sequence[ObjectReport], incarnation: int
                ) -> int:
        """:meth:`confirm_objects`, answering how many of ``reports`` it re-created."""
        ...

    def confirm_objects(self, owner: ShardId, reports: Sequence[ObjectReport],
                        incarnation: int) -> list[ObjectId | None]:
        """Rebuild after a service restart: re-create the objects ``owner`` vouches for
        (complete memory objects at their block and generation; disk copies at rest).
        Returns per report, in order, its object's new id (the owner keys the block by it)
        or None where it was not re-created (a duplicate, a half-written state, a slot or
        block taken).

        Mutates: records and entries made; an entry whose parent's is not there yet waits
        for it (an orphan, adopted a slice at a time); entries' summaries are deferred to the
        first walk that reaches them (pending until then: no hit through them yet). A lost
        incarnation's records on the reported paths are buried first. All or nothing: a
        malformed report rejects the whole call. Raises: UnknownOwner (not registered, or
        ``incarnation`` not current), UnknownGroup, BadHash (a malformed hash, a chain that
        contradicts the index or itself), InvalidInput (a state of another kind, an SWA
        range outside its block, a tail of the wrong length, depth and parent disagreeing),
        UnsetVersion (a KV or indexer at version 0). Cost: O(reports) (a batch of 256 is the
        shards' unit) plus a slice of orphans adopted."""
        ...

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        """The depth up to which a save of the chain ``block_hashes`` (from its root) should
        write its blocks ``offered_from`` on: those offered at least ``needed`` times, this
        offer included, leading (``core/sightings.py``: a one-off prompt is never saved with
        ``needed=2``). A request offers each block once: the blocks before ``offered_from``
        are its earlier saves' or its hits, not looked at.

        Mutates: one offer of each hash from ``offered_from`` is recorded (nothing else: no
        entry, no object). Valid after: advice only; a later ``allocate`` decides as always.
        Raises: InvalidInput (``needed`` outside 1..255, ``offered_from`` outside the
        chain), BadHash (a malformed hash), recording nothing. Cost: O(hashes), ~1 us each."""
        ...

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[Allocation]:
        """Reserve a block for each slot of ``requests`` on the prefix ``block_hashes`` (the
        hashes of blocks ``first_block`` on: a range of a chain split across partitions; on
        ``owner``'s pools, or the live owner with the most free blocks); per slot, in order,
        an ALLOCATED object and its handle, or the live object already there
        (``existing=True``: an idempotent retry; do not rewrite it). ``token_ids``: the
        tokens of ``block_hashes``' blocks (hash_block per hash), for the KV event stream's
        BlockStored; a port that publishes no events ignores them.

        Mutates: the path's entries are made where missing and aged (as recent as a
        lookup's); a slot's ``replace`` object is retired first (copy-on-write); a pool with
        no free block evicts one by its column's policy. All or nothing: PoolExhausted gives
        back every block the call reserved. Valid after: each handle until its object ends.
        Raises: BadHash (a malformed or unchained hash), WrongPartition, InvalidInput (a
        slot outside the hashes or where its column has no block, a range), UnknownGroup,
        UnknownOwner, PoolExhausted (every block pinned, being written or leased; or no
        owner yet). Cost: O(path + slots), plus evictions and a slice of orphans adopted."""
        ...

    def transition(self, object_id: ObjectId, event: Event, params: Params | None = None,
                   generation: int | None = None) -> TransitionResult:
        """Report one event of an object (WRITE_DONE, OFFLOAD_COMMITTED, MARK_CORRUPT ...);
        the table (``core/transitions.py``) decides the move. Returns the state it reached,
        its KV version (a COMPRESSED WRITE_DONE without one gets a version the view issues)
        and its sequence number (``Params.expect_seq``'s compare-and-set token).

        Mutates: the object's state and fields; EVICT evicts by policy (an indexer with its
        KV); a terminal state detaches it and frees its block (its handles go stale); the
        entry's summary is recomputed (its cached row, memos and walk segments dropped) and
        the event logged. Raises, changing nothing: UnknownObject, StaleHandle or
        FutureGeneration (``generation`` given and not current), IllegalTransition (no such
        move, or a precondition refused it: its fields say which), VersionConflict
        (``expect_seq``), UnsetVersion (version 0), InvalidInput (an event only the core
        causes: LOAD_BEGIN, OFFLOAD_BEGIN). Cost: O(1) and one entry's summary."""
        ...

    def transition_many(self, items: Sequence[ObjectTransitions]
                        ) -> list[TransitionResult | HkvError]:
        """Many objects' events in one call and one lock hold: items in order, each object's
        events in order and all or none of them; per item its result after its last event,
        or the error that refused it (that item changed nothing; the others go on).

        Mutates: as :meth:`transition`, per event of each item that passed. Raises, for the
        whole call and before anything is applied: InvalidInput (more than
        ``MAX_TRANSITION_ITEMS`` items, an item with no events or more params than events, a
        core-only event). Cost: O(events), each rehearsed once first."""
        ...

    def evict(self, object_id: ObjectId) -> None:
        """Evict an object by policy: an indexer goes with its KV and a KV with its indexers;
        a loaded disk copy drops back to rest (DROP_COPY), a copy at rest leaves the view.

        Mutates: the object (and its partners) EVICTED, blocks freed: their handles go stale.
        Raises, changing nothing: UnknownObject, IllegalTransition (leased, captured, or in a
        state eviction does not take). O(1)."""
        ...

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        """Start copying a readable object to ``disk_owner``'s disk tier: the DISK copy's
        handle (OFFLOADING), or the existing copy's where the entry has one.

        Mutates: a DISK record made; an admission ticket held until OFFLOAD_COMMITTED or
        OFFLOAD_FAILED is reported. Raises: UnknownObject, UnknownOwner (the disk owner is not
        registered, or was declared lost), IllegalTransition (not readable), AdmissionRefused
        (too much in transit: retry after its hint). O(1)."""
        ...

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        """Start loading a disk copy at rest into memory: the handle of the block its bytes
        go to (on ``owner``'s pool, or the live owner with the most free blocks).

        Mutates: ON_DISK -> ON_DISK_INFLIGHT, a block taken (evicting by policy if none is
        free) and an admission ticket held until LOAD_VERIFIED or LOAD_FAILED is reported.
        Raises: UnknownObject, IllegalTransition (not a DISK copy at rest), AdmissionRefused,
        PoolExhausted, UnknownOwner. O(1) plus an eviction."""
        ...

    def lookup(self, req: LookupRequest) -> Match:
        """The longest prefix of ``req.block_hashes`` a reader can resume at safely (the
        four-layer funnel, ``core/funnel.py``), the handles of what it reads (packed per
        column, a snapshot taken atomically) and a downgrade reason for what it gave up.

        Changes no object's state, but: buries the dead records of a lost owner it meets
        within the walk's reach, lets expired leases go, ages the path it used (LRU), summarises
        pending entries it reaches, may certify walk segments and fills the memo (a repeated
        long lookup is answered from it). With ``lease_ttl_s > 0`` it pins the served records
        until :meth:`release_lease` or expiry. Valid after: under a lease, every handle until
        the lease ends; without one a reader may find a handle stale, never wrong.
        Raises only for malformed requests: BadHash, PositionBeyondHashes, InvalidInput
        (alignment, a lease without handles or over the maximum TTL, a range), UnknownGroup
        (a reader ABI group), WrongPartition, MisplacedHash; an unusable hit is a downgrade.
        Cost: ~0.15 us a block walked; a certified run of 64 blocks one dict lookup and one
        memcmp; a memo hit O(1) and one memcmp."""
        ...

    def release_lease(self, lease_id: LeaseId) -> None:
        """Unpin what a leased lookup pinned; its handles may go stale from now on.

        Mutates: the lease closed. Raises: UnknownLease (never issued, released, or expired
        and reaped). O(records pinned)."""
        ...

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        """The view's half of the read check: the handle's object still holds that block at
        that generation, in a readable state (the shard re-checks its own copy).

        Changes nothing but burying the object if its owner was lost. Raises: LeaseExpired
        (``lease_id`` given and no longer live), StaleHandle (recompute). O(1)."""
        ...


PORT_METHODS: tuple[str, ...] = tuple(
    name for name in MetadataPort.__dict__
    if not name.startswith("_") and callable(MetadataPort.__dict__[name]))
"""The port's methods, in declaration order (what a signature test walks)."""
