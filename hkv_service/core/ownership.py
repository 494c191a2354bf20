"""Owners come and go: registration, heartbeats, loss, and the reaper's slices.

An owner (a shard) registers its pools and gets an incarnation; it heartbeats with it. A loss
(``mark_owner_lost``, the heartbeat expiry, a re-registration) is O(1) under the lock
(``core/owners.py``: the incarnation marked dead and queued, the epochs moved on, transfers in
flight and captures over it ended at once); its records are buried later::

    register_owner --> Owner(incarnation, pools) ---- heartbeat ----> last_seen
         |  (a known name: its old incarnation lost first)
    mark_owner_lost / expire_owners --> alive = False, Reap queued (Tables.reaping)
    reap(budget) --> sweep a slice: bury what is still dead (Tables.bury_if_dead),
                     then adopt a slice of waiting orphans (PrefixTree.adopt_some)

Until a record is buried every path that could serve or reuse it asks ``Tables.dead``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from .allocator import BlockPool, PoolConfig
from .errors import ResourceExhausted
from .ids import ObjectId, ShardId
from .inputs import check_pool, column_of
from .owners import REAP_SLICE, Owner, Reap, dead, sweep
from .tables import Tables

__all__ = ["Ownership"]


class Ownership:
    """The owners of one state view and the burial of lost ones; called under its lock."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables
        self._column_nbytes = tuple(c.nbytes for c in tables.layout.columns)
        self._incarnations = itertools.count(1)

    def register_owner(self, owner: ShardId, pools: Mapping[str, PoolConfig],
                       instance: int = 0) -> int:
        """(Re-)register an owner. A known owner coming back has lost its memory: its old
        incarnation is declared lost first (its objects are buried lazily, see :meth:`reap`).
        ``instance``: the owner process's own id (the same process registering again after
        a service restart keeps it), what loss reports name. Returns the new incarnation."""
        t = self.t
        built: dict[int, BlockPool] = {}  # validate before touching anything
        for name, cfg in pools.items():
            col = column_of(t.layout, name)
            built[col] = BlockPool(check_pool(name, cfg), nbytes=self._column_nbytes[col])
        old = t.owners.get(owner)
        if old is not None:
            if old.alive:
                self.mark_owner_lost(owner)
        else:
            self._make_room_for_owner(owner)
        t.owners_epoch += 1
        inc = next(self._incarnations)
        t.owners[owner] = Owner(inc, t.clock(), built, instance=instance)
        return inc

    def _make_room_for_owner(self, owner: ShardId) -> None:
        """Owners declared lost hold nothing any more (their objects ended with them): their
        entries go when the table is full. Live ones are never dropped: over the bound, a new
        name is refused."""
        owners = self.t.owners
        if len(owners) < self.t.config.max_owners:
            return
        for name in [s for s, o in owners.items() if not o.alive]:
            del owners[name]
        if len(owners) >= self.t.config.max_owners:
            raise ResourceExhausted(
                f"cannot register owner {owner!r}: {len(owners)} owners are registered, "
                f"the most this service takes (max_owners); retire owners or raise it")

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        t = self.t
        t.current_owner(owner, incarnation).last_seen = t.clock()

    def expire_owners(self) -> list[ShardId]:
        """Mark every owner silent for longer than the heartbeat timeout as lost."""
        t = self.t
        cutoff = t.clock() - t.config.heartbeat_timeout_s
        dead = [s for s, o in t.owners.items() if o.alive and o.last_seen < cutoff]
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
        t = self.t
        o = t.owner(owner)
        if not o.alive:
            return 0
        if self._stale_report(owner, o, witnesses, instance):
            t.counters.events["stale_loss_report"] += 1
            return None
        held = sum(p.occupied() for p in o.pools.values()) + len(o.disk)
        o.alive = False
        t.owners_epoch += 1  # memos and replays stop answering
        t.loss_epoch += 1  # every entry must be cleaned again before it serves
        t.reaping.append(Reap(owner, o, sorted(o.pools)))
        t.invalidate_captures_of_dead()
        # transfers in flight end now (bounded by admission): their tickets go back
        for oid in list(t.tickets):
            rec = t.objects.get(oid)
            if rec is not None and t.dead(rec):
                t.bury(rec)
        t.counters.events["owner_lost"] += 1
        return held

    def _stale_report(self, owner: ShardId, o: Owner, witnesses: Sequence[int],
                      instance: int) -> bool:
        if instance and o.instance:
            return instance != o.instance
        return bool(witnesses) and not any(self._held_now(owner, oid) for oid in witnesses)

    def _held_now(self, owner: ShardId, oid: int) -> bool:
        """Object ``oid`` is held by ``owner``'s current incarnation (its memory copy, or its
        disk tier)."""
        rec = self.t.objects.get(ObjectId(oid))
        return (rec is not None and owner in (rec.shard, rec.disk_owner)
                and not dead(rec, self.t.owners))

    def reap(self, budget: int = REAP_SLICE) -> bool:
        """Bury up to ``budget`` objects (or empty blocks looked at) of lost owners, and adopt
        a slice of the orphans left waiting (``tree.ADOPT_SLICE``); True while some of either
        remain. The service runs it in slices with the lock released between them, so
        heartbeats and lookups never wait behind a whole owner's objects, nor behind every
        block confirmed before its parent."""
        t = self.t
        while t.reaping and budget > 0:
            r = t.reaping[0]
            budget = sweep(r, budget, t.bury_if_dead)
            if r.done:
                t.reaping.popleft()
        adopting = t.tree.adopt_some() if t.tree.adopting else False
        return bool(t.reaping) or adopting
