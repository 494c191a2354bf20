"""Runtime checks 3 and 4 as records: leases (TOCTOU) and graph captures (static topology).

A :class:`Lease` is taken atomically with a lookup and pins every object the match returned,
so eviction skips them until the lease is released or expires. A :class:`Capture` pins the
blocks a CUDA graph was captured over; if a pinned block must change anyway (its owner died),
the topology epoch moves on and the capture is marked invalid so its owner re-captures.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from .ids import CaptureId, LeaseId
from .records import ObjRecord

__all__ = ["Capture", "Holds", "Lease", "LeaseBook"]


@dataclass(slots=True)
class Holds:
    """Live leases and graph captures per record, counted beside the records: few records
    are held at any moment, and two counters on every record would cost 16 B each."""

    pins: dict[ObjRecord, int] = field(default_factory=dict)
    captures: dict[ObjRecord, int] = field(default_factory=dict)

    def held(self, rec: ObjRecord) -> bool:
        return rec in self.pins or rec in self.captures

    @staticmethod
    def add(table: dict[ObjRecord, int], records: Iterable[ObjRecord], delta: int) -> None:
        get = table.get
        for rec in records:
            n = get(rec, 0) + delta
            if n > 0:
                table[rec] = n
            else:
                table.pop(rec, None)  # no entry once nothing holds it: the map stays small


@dataclass(slots=True)
class Lease:
    lease_id: LeaseId
    records: list[ObjRecord]
    expires_at: float
    released: bool = False


@dataclass(slots=True)
class Capture:
    capture_id: CaptureId
    records: list[ObjRecord]
    epoch: int  # topology epoch when captured
    valid: bool = True


@dataclass(slots=True)
class LeaseBook:
    """Live leases plus an expiry heap, reaped lazily by the state view."""

    holds: Holds = field(default_factory=Holds)
    leases: dict[LeaseId, Lease] = field(default_factory=dict)
    expiry: list[tuple[float, LeaseId]] = field(default_factory=list)
    next_id: int = 0
    step: int = 1  # a metadata partition's lease ids are its index modulo the count
    # A random base per view, as object ids have: after a restart a client's old lease id
    # must not name another client's new lease (releasing it would unpin that one's objects).
    random_base: bool = True

    def __post_init__(self) -> None:
        if self.random_base:
            self.next_id += random.SystemRandom().getrandbits(32) * self.step

    def open(self, records: list[ObjRecord], expires_at: float) -> Lease:
        self.next_id += self.step
        lease = Lease(LeaseId(self.next_id), records, expires_at)
        self.holds.add(self.holds.pins, records, 1)
        self.leases[lease.lease_id] = lease
        heapq.heappush(self.expiry, (expires_at, lease.lease_id))
        return lease

    def close(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self.holds.add(self.holds.pins, lease.records, -1)
        self.leases.pop(lease.lease_id, None)

    def reap(self, now: float) -> int:
        n = 0
        while self.expiry and self.expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self.expiry)
            lease = self.leases.get(lease_id)
            if lease is not None and lease.expires_at <= now:
                self.close(lease)
                n += 1
        return n
