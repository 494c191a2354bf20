"""Runtime checks 3 and 4 as paths: leases and read checks (TOCTOU), graph captures (static
topology). The records they hold are ``core/checks.py``'s; a lease is opened by the lookup
that takes it (``Lookups.lookup``).

::

    lookup(lease_ttl_s > 0) --> Lease pins the served records --> release_lease | expiry
    check_read(handle)      --> the record still at that block and generation, readable?
    register_capture        --> Capture pins its records; a fact that ends one (loss,
                                corruption) moves the topology epoch on: capture_status
"""

from __future__ import annotations

from collections.abc import Sequence

from .checks import Capture
from .errors import LeaseExpired, StaleHandle, UnknownCapture, UnknownLease
from .ids import CaptureId, LeaseId
from .records import Handle
from .tables import READABLE, Tables

__all__ = ["Leasing"]


class Leasing:
    """The leases, read checks and captures of one state view; called under its lock."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables

    def release_lease(self, lease_id: LeaseId) -> None:
        leases = self.t.leases
        lease = leases.leases.get(lease_id)
        if lease is None:
            raise UnknownLease(f"lease {lease_id} does not exist or was already released")
        leases.close(lease)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        """The view's half of the TOCTOU check; the shard re-checks the generation it holds."""
        t = self.t
        if lease_id is not None:
            t.leases.reap(t.clock())
            if lease_id not in t.leases.leases:
                raise LeaseExpired(f"lease {lease_id} expired or was released; look up again")
        rec = t.live_record(handle.object_id)
        if (
            rec is None
            or rec.block != handle.block
            or rec.generation != handle.generation
            or rec.state not in READABLE[rec.kind]  # e.g. a load still in flight
        ):
            t.counters.events["stale_read"] += 1
            raise StaleHandle(
                f"handle to object {handle.object_id} is stale (block reused or freed); "
                "recompute"
            )

    def register_capture(self, handles: Sequence[Handle]) -> tuple[CaptureId, int]:
        t = self.t
        records = []
        for h in handles:
            self.check_read(h)
            records.append(t.objects[h.object_id])
        t.holds.add(t.holds.captures, records, 1)
        cap = Capture(CaptureId(next(t.capture_ids)), records, t.topology_epoch)
        t.captures[cap.capture_id] = cap
        return cap.capture_id, t.topology_epoch

    def release_capture(self, capture_id: CaptureId) -> None:
        t = self.t
        cap = t.captures.pop(capture_id, None)
        if cap is None:
            raise UnknownCapture(f"capture {capture_id} is not registered")
        t.holds.add(t.holds.captures, cap.records, -1)

    def capture_status(self, capture_id: CaptureId) -> tuple[bool, int]:
        """(still valid, current topology epoch) for a capture's owner to poll."""
        t = self.t
        cap = t.captures.get(capture_id)
        if cap is None:
            raise UnknownCapture(f"capture {capture_id} is not registered")
        return cap.valid, t.topology_epoch
