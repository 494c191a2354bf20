"""Allocation and eviction: blocks reserved for new objects, taken back by policy.

::

    allocate(hashes, slots, owner)
      check hashes, root, range, every slot          (core/inputs.py: nothing changed yet)
      clean the slots asked for of a lost owner's records (Tables.clean)
      retire objects a writer replaces (copy-on-write: AllocRequest.replace)
      the path's entries, made where missing and aged  (PrefixTree.entry_under, age)
      per slot: the live object there (existing), or a block from the owner with the most
      free (evicting by its column's policy if none is free) and a new ALLOCATED record
      all or nothing: a PoolExhausted gives back what the call reserved

    evict(object)  -- EVICT by policy (refused while leased or captured); an indexer goes
                      with its KV and a KV with its indexers (core/allocator.py's policies)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from . import contracts
from .allocator import BlockPool, Policy, state_rank, swa_policy
from .api import Allocation, AllocRequest
from .errors import IllegalTransition, PoolExhausted
from .ids import BlockHash, ObjectId, ShardId
from .inputs import check_hashes, check_range, check_root, check_slot, column_of
from .records import ObjRecord, PrefixEntry, mem_at, new_record, set_mem
from .states import TERMINAL_STATES, Event, Kind, State
from .tables import Tables
from .transitions import Params
from .tree import other_parent, unchained

__all__ = ["Placement"]

# state_rank -> the event counted when the eviction policy gives such a checkpoint up
_STATE_EVICTED = ("state_evicted_inside_chain", "state_evicted_latest_or_junction")

_PARTNER_EVICTABLE = {
    (Kind.INDEXER, State.INDEXER_SYNCED),
    (Kind.INDEXER, State.INDEXER_WRITTEN),
    (Kind.COMPRESSED, State.COMPRESSED_READY),
}


class Placement:
    """Allocation and eviction in one state view; called under its lock."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables
        self.tree = tables.tree
        self.layout = tables.layout
        # per SWA column (its lane in swa_need): its own policy
        self._policies: dict[int, Policy] = {
            c: swa_policy(i) for i, c in enumerate(self.layout.swa_columns)}

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0) -> list[Allocation]:
        """Reserve blocks for objects of the prefix ``block_hashes`` (the hashes of blocks
        ``first_block`` on: a range of a chain split across partitions). Idempotent: a live
        object already in a requested slot is returned with ``existing=True``."""
        t, tree = self.t, self.tree
        check_hashes(block_hashes)
        check_root(t.partition, block_hashes)
        check_range(t.range_blocks, first_block, len(block_hashes), "allocate")
        cols = [column_of(self.layout, r.column) for r in requests]
        for r in requests:
            check_slot(self.layout, r, len(block_hashes), first_block)
        if owner is not None:
            t.owner(owner)
        last = max((r.depth for r in requests), default=first_block - 1)
        if t.reaping:  # a lost owner's object is not "existing" in a slot asked for;
            # the path above is the reaper's (cleaned whole, a follow-up turn of a
            # 1,000-block prompt buried ~2,000 records in one hold: 50 ms at 1M objects)
            t.clean(block_hashes[d - first_block]
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
                    t.apply(t.objects[a.handle.object_id], Event.EVICT, Params())
            if entries:
                tree.gc_entry(entries[-1])  # and so would path entries made for them
            raise
        self._settle_allocated(made)
        if tree.adopting:  # the orphans of entries its path made
            tree.adopt_some()
        return done

    def _retire(self, block_hash: BlockHash, col: int, object_id: int) -> None:
        """Evict object ``object_id`` if it still holds slot ``col`` of ``block_hash``'s entry
        (a caller replaces it with new bytes); left where it is while anything holds it."""
        t = self.t
        entry = t.index.get(block_hash)
        rec = mem_at(entry, col) if entry is not None else None
        if rec is None or rec.object_id != object_id:
            return
        try:
            t.apply(rec, Event.EVICT, Params())
        except IllegalTransition:
            t.counters.events["replace_refused"] += 1
            return
        t.counters.events["replaced"] += 1

    def _allocate_one(self, entry: PrefixEntry, col: int, owner: ShardId | None,
                      made: list[ObjRecord]) -> Allocation:
        """One slot's allocation; a new record is appended to ``made``, its entry summarised
        by :meth:`_settle_allocated` before the lock is let go."""
        t = self.t
        existing = mem_at(entry, col)
        if existing is not None:
            return Allocation(t.handle(existing), True, existing.state, existing.version)
        shard, pool, block = self.take_block(col, owner)
        column = self.layout.columns[col]
        rec = new_record(
            column.kind, col, t.objects.new_id(), entry, State.ALLOCATED, shard, block,
            pool.generation_of(block),
        )
        pool.hold(block, rec)
        set_mem(entry, col, rec)
        t.objects.put(rec)
        made.append(rec)
        return Allocation(t.handle(rec), False, rec.state)

    def _settle_allocated(self, made: Sequence[ObjRecord]) -> None:
        """What ``Tables.after_change`` does for each new record, once per entry: a request's
        objects share their entries (4-5 columns a block), and nothing reads an entry's
        summary while the lock is held between its allocations. (An ALLOCATED record is
        never terminal: no entry to collect.)"""
        summarised: set[int] = set()
        for rec in made:
            if id(rec.entry) not in summarised:
                summarised.add(id(rec.entry))
                contracts.summarise(rec.entry, self.layout, self.t.align_of)
        self.t.log_events(made)

    def take_block(self, col: int, owner: ShardId | None) -> tuple[ShardId, BlockPool, int]:
        t = self.t
        candidates = [owner] if owner is not None else self._owners_by_free(col)
        for shard in candidates:  # (an iterator: the most free first, the rest on demand)
            o = t.owner(shard)
            pool = o.pools.get(col)
            if pool is None or not o.alive:
                continue
            block = pool.take()
            if block is None and self._evict_from(pool, col):
                block = pool.take()
            if block is not None:
                return shard, pool, block
        name = self.layout.columns[col].name
        if owner is None and not any(col in o.pools for o in t.owners.values() if o.alive):
            raise PoolExhausted(
                f"no owner (shard) with a pool for {name!r} is registered with this metadata "
                f"view ({t.partition}) yet: a restarted service is back once the shards "
                "have re-registered (within a heartbeat); retry then")
        raise PoolExhausted(
            f"no free or evictable block for {name!r}: every block is pinned, being written "
            "or leased; retry after readers release their leases"
        )

    def _owners_by_free(self, col: int) -> Iterator[ShardId]:
        """Live owners with a pool for ``col``, the most free blocks first: the first is
        found in one pass (it nearly always has a block, or one to evict); the rest are
        sorted only if it has neither."""
        live = [(s, o) for s, o in self.t.owners.items() if o.alive and col in o.pools]
        if not live:
            return
        free = [o.pools[col].free_count() for _, o in live]
        first = max(range(len(live)), key=free.__getitem__)
        yield live[first][0]
        rest = sorted((i for i in range(len(live)) if i != first), key=lambda i: -free[i])
        yield from (live[i][0] for i in rest)

    def _evict_from(self, pool: BlockPool, col: int) -> bool:
        victim = pool.victim(self.layout.columns[col].kind, self.t.holds,
                             self._policies.get(col))
        if victim is None:
            return False
        if victim.kind is Kind.STATE:  # which checkpoints the policy gives up, counted
            self.t.counters.events[_STATE_EVICTED[state_rank(victim)]] += 1
        self.evict(victim.object_id)
        return True

    def evict(self, object_id: ObjectId) -> None:
        """Evict by policy rules: an indexer goes with its KV and a KV with its indexer."""
        t = self.t
        rec = t.record(object_id)
        if rec.kind is Kind.DISK:
            t.apply(
                rec,
                Event.DROP_COPY if rec.state is State.ON_DISK_READY else Event.EVICT,
                Params(),
            )
            return
        partners = self._partners(rec)  # before rec leaves its entry
        # rec first: a refused eviction (held, wrong state) raises with nothing changed
        t.apply(rec, Event.EVICT, Params())
        t.counters.evictions[rec.kind] += 1
        for partner in partners:
            if partner.state in TERMINAL_STATES or t.holds.held(partner):
                continue
            if t.dead(partner):
                t.bury(partner)  # lost with its owner, not evicted
                continue
            if (partner.kind, partner.state) in _PARTNER_EVICTABLE:
                t.apply(partner, Event.EVICT, Params())

    def _partners(self, rec: ObjRecord) -> list[ObjRecord]:
        out = []
        for col in self.layout.columns:
            if col.indexes == rec.column or (
                rec.kind is Kind.INDEXER and col.index == self.layout.columns[rec.column].indexes
            ):
                other = mem_at(rec.entry, col.index)
                if other is not None and other is not rec:
                    out.append(other)
        return out

    def _ensure_path(self, hashes: Sequence[BlockHash], last: int, first: int = 0
                     ) -> list[PrefixEntry]:
        """The entries at depths ``[first, last]`` (``hashes[0]`` is depth ``first``'s: a
        range of a split chain starts at an entry whose parent lives in another partition)."""
        self._check_path(hashes, last, first)
        entry_under = self.tree.entry_under
        out: list[PrefixEntry] = []
        parent: PrefixEntry | None = None
        for depth in range(first, last + 1):
            parent = entry_under(hashes[depth - first], parent, depth)
            out.append(parent)
        self.tree.age(out)  # a written block is as recent as a looked-up one, its path with it
        return out

    def _check_path(self, hashes: Sequence[BlockHash], last: int, first: int = 0) -> None:
        """Raise what ``PrefixTree.entry_under`` would raise part way down the path to depth
        ``last``: checked first, so a refused call leaves no entry behind. An orphan's parent
        is the hash its report named (``awaits``), on this path as on a confirm's."""
        seen: set[BlockHash] = set()
        index = self.t.index
        parent: PrefixEntry | None = None  # the known entry one depth up; None if made here
        for depth in range(first, last + 1):
            h = hashes[depth - first]
            e = index.get(h)
            clash = e is not None and (e.depth != depth or (
                depth > first and e.parent is not None and e.parent is not parent))
            if h in seen or clash:
                raise unchained(depth, depth if e is None else e.depth)
            if e is not None and e.awaits is not None and depth > first and \
                    e.awaits != hashes[depth - first - 1]:
                raise other_parent(depth)
            seen.add(h)
            parent = e
