"""Transfers between tiers: a DISK copy made of a readable object (offload), a copy at rest
brought back into a memory block (load). Each holds an admission ticket (runtime check 1,
``core/admission.py``) from its begin until the event that ends it, whichever way::

    begin_offload --> DISK OFFLOADING  --OFFLOAD_COMMITTED--> ON_DISK      (ticket back)
                                       --OFFLOAD_FAILED-----> EVICTED      (ticket back)
    begin_load    --> ON_DISK_INFLIGHT --LOAD_VERIFIED------> ON_DISK_READY (ticket back)
      (a block taken as an allocation takes one)  --LOAD_FAILED--> ON_DISK  (ticket back)

The events that end them are reported like any other (``Reports.transition``); the tickets
go back in ``Tables.disk_event`` and ``Tables.detach``.
"""

from __future__ import annotations

from .errors import IllegalTransition, UnknownOwner
from .ids import ObjectId, ShardId
from .placement import Placement
from .records import Handle, set_shard
from .states import Event, Kind, State
from .tables import READABLE, Tables
from .transitions import Params

__all__ = ["Transfers"]


class Transfers:
    """Offloads and loads in one state view; called under its lock."""

    def __init__(self, tables: Tables, placement: Placement) -> None:
        self.t = tables
        self.placement = placement

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        """Create the DISK copy (OFFLOADING) of a readable object; takes an admission ticket."""
        t = self.t
        src = t.record(object_id)
        if not t.owner(disk_owner).alive:
            raise UnknownOwner(f"disk owner {disk_owner!r} was declared lost; it must "
                               "register again before it takes copies")
        if src.kind is not Kind.DISK and src.state not in READABLE[src.kind]:
            raise IllegalTransition(
                f"object {object_id} is {src.state.value}; only readable objects are offloaded"
            )
        existing = src.entry.disk[src.column] if src.entry.disk else None
        if existing is not None and t.dead(existing):
            t.bury(existing)  # lost with its tier, or back at rest if only its copy was
            existing = src.entry.disk[src.column] if src.entry.disk else None
        if existing is not None:
            return t.handle(existing)
        ticket = t.admission.acquire(t.layout.columns[src.column].nbytes)
        rec = t.add_disk_record(src.entry, src.column, State.OFFLOADING, disk_owner, src)
        t.tickets[rec.object_id] = ticket
        t.after_change(rec)
        return t.handle(rec)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        """ON_DISK -> ON_DISK_INFLIGHT; reserves the memory block the bytes go to."""
        t = self.t
        rec = t.record(object_id)
        if rec.kind is not Kind.DISK or rec.state is not State.ON_DISK:
            raise IllegalTransition(
                f"object {object_id} is {rec.kind.value}/{rec.state.value}; "
                "only a DISK object at rest (ON_DISK) can be loaded"
            )
        ticket = t.admission.acquire(t.layout.columns[rec.column].nbytes)
        try:
            shard, pool, block = self.placement.take_block(rec.column, owner)
        except Exception:
            t.admission.release(ticket)
            raise
        t.tickets[rec.object_id] = ticket
        set_shard(rec, shard)
        rec.block, rec.generation = block, pool.generation_of(block)
        pool.hold(block, rec)
        t.apply(rec, Event.LOAD_BEGIN, Params())
        return t.handle(rec)
