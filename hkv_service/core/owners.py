"""Owners of the state view and the lazy reaping of a lost one.

An owner (a shard) is declared lost in O(1): its :class:`Owner` is marked dead and queued as
a :class:`Reap`. From that moment none of its objects is a hit, because every path that could
serve or reuse a record first asks :func:`dead` (a record is alive only while the *current*
incarnation of its owner holds it: the pool slot of its block points back at it, or the disk
set of its tier owner contains it). The records themselves are buried (LOST) later, in
bounded slices (:func:`sweep`), or at once when something touches one. A new incarnation of
the same name gets fresh pools, so the old records fail the check without being visited.

Nothing here is proportional to the whole state under one lock hold: a slice visits at most
its budget of blocks and records.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .allocator import BlockPool
from .ids import ShardId
from .records import ObjRecord
from .states import TERMINAL_STATES, Kind

__all__ = ["REAP_SLICE", "Owner", "Reap", "dead", "sweep"]

REAP_SLICE = 128  # blocks and records one reap call visits (~10 ms under the lock at most)


@dataclass(slots=True, eq=False)
class Owner:
    """One incarnation of an owner: a re-registration makes a new one (new pools)."""

    incarnation: int
    last_seen: float
    pools: dict[int, BlockPool] = field(default_factory=dict)
    alive: bool = True
    # The owner process's own id (a shard picks one at start; 0: not given). A loss report
    # names the instance its failed call went to, and only the current one's is applied.
    instance: int = 0
    # DISK records its tier holds: a dict used as an ordered set, so a reap buries them in
    # the order they came (a set of records iterates by address: a replay of the same steps
    # reaped in another order, placed later loads on other blocks, and the stateful tests'
    # rule choices went Flaky)
    disk: dict[ObjRecord, None] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Reap:
    """What is left to bury of one lost incarnation: its disk set, then its pools in order."""

    name: ShardId
    owner: Owner
    columns: list[int]  # pools still to sweep, the first one from ``block`` on
    block: int = 0

    @property
    def done(self) -> bool:
        return not self.owner.disk and not self.columns


def dead(rec: ObjRecord, owners: Mapping[ShardId, Owner]) -> bool:
    """True if ``rec`` belongs to an owner incarnation that was declared lost (or was
    replaced by a new registration) and has not been buried yet. A DISK record is dead when
    its tier owner's current incarnation does not hold it, or when its loaded memory copy
    sits on a dead owner (then only that copy is lost: :func:`disk_part_alive`)."""
    if rec.kind is Kind.DISK:
        if not disk_part_alive(rec, owners):
            return True
        if rec.block < 0:
            return False
    o = owners.get(rec.shard)
    if o is None or not o.alive:
        return True
    pool = o.pools.get(rec.column)
    return pool is None or pool.owner_of(rec.block) is not rec


def disk_part_alive(rec: ObjRecord, owners: Mapping[ShardId, Owner]) -> bool:
    o = owners.get(rec.disk_owner) if rec.disk_owner is not None else None
    return o is not None and o.alive and rec in o.disk


def sweep(reap: Reap, budget: int, bury: Callable[[ObjRecord], None]) -> int:
    """Bury up to ``budget`` of ``reap``'s records (each block looked at costs one, empty or
    not); returns the budget left. Only the lost incarnation's own pools and disk set are
    visited: they are retired, so nothing else adds to them while the sweep goes on."""
    disk = reap.owner.disk
    while disk and budget > 0:
        rec = disk.popitem()[0]  # out of the set first: the record now reads as dead
        budget -= 1
        if rec.state not in TERMINAL_STATES:
            bury(rec)
    while reap.columns and budget > 0:
        pool = reap.owner.pools[reap.columns[0]]
        reap.block = max(reap.block, pool.config.first)  # the blocks below are not its own
        end = min(pool.span, reap.block + budget)
        for block in range(reap.block, end):
            held = pool.owner_of(block)
            if held is not None and held.state not in TERMINAL_STATES:
                bury(held)
            pool.forget(block)  # (its books freed a slice at a time, not all at the end)
        budget -= end - reap.block
        reap.block = end
        if end >= pool.span:
            pool.free.clear()  # what forget left (normally none: it drops two per block)
            reap.columns.pop(0)
            reap.block = 0
    return budget
