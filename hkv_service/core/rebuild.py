"""Rebuilding the view after a service restart: owners vouch for what they hold.

The service keeps nothing on disk; a restarted view is empty until each owner registers
again and re-confirms its objects in batches (``confirm_objects``)::

    confirm_objects(owner, reports, incarnation)
      the owner's current incarnation?                  (Tables.current_owner)
      every report's shape, then the whole call's chain  (_check_shapes, _check_vouched:
                                                           all checked before any applied)
      clean what a lost incarnation seems to hold        (Tables.clean)
      per report, by depth: its entry (made, or an orphan waiting for its parent's,
      PrefixTree.entry_under), its record (memory: the block claimed at its generation;
      disk: a copy at rest), the entry's summary deferred to the first walk
      (contracts.defer); a slice of waiting orphans adopted (PrefixTree.adopt_some)

A confirm changes records (it makes them) but summarises nothing: entries are pending until
a walk reaches them. A refused call (a malformed report, an owner not current) changes
nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import contracts
from .api import ObjectReport
from .errors import InvalidInput
from .ids import BLOCK_HASH_BYTES, BlockHash, ObjectId, ShardId, shared_int
from .inputs import check_hashes, check_report, column_of
from .owners import Owner
from .records import ObjRecord, PrefixEntry, mem_at, new_record, set_mem
from .states import State
from .tables import Tables
from .tree import other_parent, unchained_report

__all__ = ["Rebuild"]

_CONFIRMABLE = frozenset(
    {State.ON_DISK} | {st for c in contracts.CONTRACTS.values() for st in c.ready_states}
) - {State.ON_DISK_READY}
# Enum members on a re-confirm's per-report path, read once: through their class each read
# costs ~0.1 us in Python 3.11 (EnumType.__getattr__ puts every class attribute read on the
# slow path), ~10x a module global.
_ON_DISK = State.ON_DISK


class Rebuild:
    """The re-confirms of one state view; called under its lock."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables
        self.tree = tables.tree
        self.layout = tables.layout

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
        t, tree = self.t, self.tree
        o = t.current_owner(owner, incarnation)
        cols = self._check_shapes(reports)  # all checked before any applied: all or nothing
        if t.reaping:  # a slot a lost incarnation (ours, say) seems to hold is free
            t.clean(h for r in reports for h in (r.block_hash, r.parent_hash) if h)
        # Half-written objects (ALLOCATED, WRITING, TAIL_PARTIAL, ...) are not re-created:
        # their writer's ids died with the old view, so they could never complete.
        order = [i for i, r in enumerate(reports) if r.state in _CONFIRMABLE]
        order.sort(key=[r.depth for r in reports].__getitem__)  # (stable: as sorted)
        found = self._check_vouched([reports[i] for i in order], [cols[i] for i in order])
        ids: list[ObjectId | None] = [None] * len(reports)
        made: list[ObjRecord] = []
        parts, defer = t.index.parts, contracts.defer
        entry_under, confirm_one = tree.entry_under, self._confirm_one
        for i, (e, pe) in zip(order, found, strict=True):  # (every report checked above)
            r = reports[i]
            h, p = r.block_hash, r.parent_hash
            # the entries the check found; one an earlier report here made is looked up
            if p is not None and pe is None:
                pe = parts[p[0]].get(p)
            if e is None:
                e = parts[h[0]].get(h)
            if e is None or (pe is not None and e.parent is None):  # make it, or adopt it
                e = entry_under(h, pe, r.depth, p)  # (an unknown parent: an orphan)
            rec = confirm_one(o, owner, e, cols[i], r)
            if rec is not None:
                ids[i] = rec.object_id
                made.append(rec)
                # summarised when a walk reaches it: once, not once per report (an
                # entry's columns arrive in other batches when the order is random)
                defer(e)
        t.log_events(made)
        if tree.adopting:
            tree.adopt_some()
        return ids

    def settle_pending(self) -> int:
        """Summarise every entry a confirm left for the walk (``contracts.defer``) now, as the
        walks reaching them would; how many. O(index): for a bench or test that counts what
        deferring costs, not for the service's own paths."""
        pending = [e for e in self.t.index.values() if e.flags & contracts.F_PENDING]
        for e in pending:
            contracts.summarise(e, self.layout, self.t.align_of)
        return len(pending)

    def _check_shapes(self, reports: Sequence[ObjectReport]) -> list[int]:
        """Per report, its column; raise for an unknown group, a malformed hash, or a depth
        its parent contradicts (a chain's root, or a range's first block when chains are
        split, has none). Per report on a re-confirm's path: checked inline, the error
        raised by the general check."""
        by_name, r_blocks, hb = self.layout.by_name, self.t.range_blocks, BLOCK_HASH_BYTES
        cols = []
        for r in reports:
            col = by_name.get(r.column)
            cols.append(column_of(self.layout, r.column) if col is None else col)  # (raises)
            h, p, depth = r.block_hash, r.parent_hash, r.depth
            if not (type(h) is bytes and len(h) == hb) or \
                    (p and not (type(p) is bytes and len(p) == hb)):
                check_hashes([h, p] if p else [h])
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
        parts, layout = self.t.index.parts, self.layout
        found: list[tuple[PrefixEntry | None, PrefixEntry | None]] = []
        for r, col in zip(vouched, cols, strict=True):
            check_report(layout, r, col)
            h, p, d = r.block_hash, r.parent_hash, r.depth
            e = parts[h[0]].get(h)  # (16-byte hashes: _check_shapes checked them)
            known = e.depth if e is not None else depth_of.setdefault(h, d)
            if known != d:
                raise unchained_report(d, known)
            pe = None
            if p is not None:
                pe = parts[p[0]].get(p)
                known = pe.depth if pe is not None else depth_of.setdefault(p, d - 1)
                if known != d - 1:
                    raise unchained_report(d - 1, known)
            found.append((e, pe))
            made.add(h)
            if p is None:
                continue  # a root (or a range's first block)
            if e is not None and e.parent is None:  # an orphan: the parent an earlier call named
                named = e.awaits
                if named is not None and named != p:
                    raise other_parent(d)
            if pe is None and p not in made:
                continue  # an orphan: linked when its parent arrives
            linked = (e.parent.block_hash if e is not None and e.parent is not None
                      else parent_of.setdefault(h, p))
            if linked != p:
                raise other_parent(d)
        return found

    def _confirm_one(
        self, o: Owner, owner: ShardId, entry: PrefixEntry, col: int, r: ObjectReport
    ) -> ObjRecord | None:
        t = self.t
        if r.state is _ON_DISK:
            if entry.disk is not None and entry.disk[col] is not None:
                return None
            return t.add_disk_record(entry, col, _ON_DISK, owner, r)
        pool, block = o.pools.get(col), shared_int(r.block)
        if pool is None or mem_at(entry, col) is not None:
            return None
        generation = pool.claim_at(block, r.generation)  # (generations issued stay issued)
        if generation is None:
            return None
        kind = self.layout.columns[col].kind
        rec = new_record(kind, col, t.objects.new_id(), entry, r.state, owner, block,
                         generation, version=r.version, lo=r.lo, hi=r.hi)
        if r.version >= t.next_version:
            t.saw_version(r.version)
        pool.hold(block, rec)
        set_mem(entry, col, rec)
        tree = self.tree
        if tree.resume_point_of(rec):  # (the slot was empty: the point was not complete)
            tree.track(entry, False, tree.complete(entry, rec))
        t.objects.put(rec)
        return rec  # (confirm_objects logs it and defers the entry's summary)
