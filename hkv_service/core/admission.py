"""Runtime check 1: the admission cap on objects and bytes in transit between tiers.

Every transfer (offload to disk, load from disk, shard-to-shard copy) takes a ticket before it
starts and returns it when it ends, whatever the outcome. Over the cap a transfer either waits
up to its deadline or is refused with :class:`AdmissionRefused` (a retry-after hint attached),
so metadata for in-flight objects never grows without bound.

This is pure bookkeeping guarded by a condition variable: it performs no I/O, and callers on
any thread may share one gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from . import defaults
from .errors import AdmissionRefused, InvalidInput

__all__ = ["AdmissionCap", "AdmissionGate", "AdmissionStats", "Ticket"]


@dataclass(frozen=True, slots=True)
class AdmissionCap:
    max_objects: int = defaults.MAX_INFLIGHT_OBJECTS
    max_bytes: int = defaults.MAX_INFLIGHT_BYTES


class Ticket(NamedTuple):
    """An admitted transfer of ``objects`` objects, ``nbytes`` in all (a tuple: taken and
    returned on every load's path, where a frozen dataclass costs ~3x more)."""

    ticket_id: int
    nbytes: int
    objects: int = 1


@dataclass(frozen=True, slots=True)
class AdmissionStats:
    in_transit_objects: int
    in_transit_bytes: int
    peak_objects: int
    peak_bytes: int
    admitted: int
    refused: int


class AdmissionGate:
    """Counts in-transit objects and bytes; never lets either exceed its cap."""

    def __init__(self, cap: AdmissionCap) -> None:
        if cap.max_objects < 1 or cap.max_bytes < 1:
            raise InvalidInput("admission cap needs max_objects >= 1 and max_bytes >= 1")
        self.cap = cap
        self._cond = threading.Condition()
        self._objects = 0
        self._bytes = 0
        self._peak_objects = 0
        self._peak_bytes = 0
        self._admitted = 0
        self._refused = 0
        self._next_id = 0
        self._open: set[int] = set()
        self._waiters = 0

    def _fits(self, nbytes: int) -> bool:
        if self._objects + 1 > self.cap.max_objects:
            return False
        # One object larger than the whole byte cap is admitted alone, or it could never move.
        return self._objects == 0 or self._bytes + nbytes <= self.cap.max_bytes

    def acquire(self, nbytes: int, wait_s: float = 0.0) -> Ticket:
        """Admit one object of ``nbytes``; wait up to ``wait_s`` for room, else refuse."""
        if nbytes < 0:
            raise InvalidInput(f"a transfer cannot have negative size ({nbytes} bytes)")
        with self._cond:
            if not self._fits(nbytes):
                self._wait_for_room(nbytes, time.monotonic() + max(0.0, wait_s))
            return self._admit(nbytes)

    def acquire_many(self, sizes: Sequence[int], wait_s: float = 0.0,
                     limit_bytes: int | None = None) -> Ticket:
        """One ticket for a prefix of ``sizes``: ``ticket.objects`` of them, at least the
        first, which may wait ``wait_s`` like :meth:`acquire`. One lock round trip.

        The rest join only while they fit the cap as it stands and their running total stays
        within ``limit_bytes``: a batch is cut, never refused, past its first object, and a
        cut is not counted as a refusal.
        """
        limit = self._check_batch(sizes, limit_bytes)
        with self._cond:
            if not self._fits(sizes[0]):
                self._wait_for_room(sizes[0], time.monotonic() + max(0.0, wait_s))
            return self._admit_prefix(sizes, limit)

    def try_acquire_many(self, sizes: Sequence[int],
                         limit_bytes: int | None = None) -> Ticket | None:
        """:meth:`acquire_many` without waiting, and None (not a refusal: nothing is
        counted) when the first object does not fit now. For a caller that has other work
        to do first, such as committing the batch whose ticket holds the room."""
        limit = self._check_batch(sizes, limit_bytes)
        with self._cond:
            return self._admit_prefix(sizes, limit) if self._fits(sizes[0]) else None

    @staticmethod
    def _check_batch(sizes: Sequence[int], limit_bytes: int | None) -> int:
        if not sizes:
            raise InvalidInput("a batch transfer needs at least one object")
        if min(sizes) < 0:
            raise InvalidInput(f"a transfer cannot have negative size ({min(sizes)} bytes)")
        return sum(sizes) if limit_bytes is None else limit_bytes

    def _admit_prefix(self, sizes: Sequence[int], limit: int) -> Ticket:
        """Admit ``sizes[0]`` (which fits) and as many of the rest as fit, within ``limit``."""
        room_objects = self.cap.max_objects - self._objects
        room_bytes = self.cap.max_bytes - self._bytes
        count, total = 1, sizes[0]
        for nbytes in sizes[1 : min(len(sizes), room_objects)]:
            if total + nbytes > min(limit, room_bytes):
                break
            count, total = count + 1, total + nbytes
        return self._admit(total, count)

    def _wait_for_room(self, nbytes: int, deadline: float) -> None:
        self._waiters += 1  # release() notifies only while someone waits
        try:
            while not self._fits(nbytes):
                left = deadline - time.monotonic()
                if left <= 0:
                    self._refused += 1
                    raise AdmissionRefused(
                        f"admission cap reached: {self._objects}/{self.cap.max_objects} objects, "
                        f"{self._bytes}/{self.cap.max_bytes} bytes in transit; retry shortly",
                        retry_after_s=0.05,
                    )
                self._cond.wait(left)
        finally:
            self._waiters -= 1

    def _admit(self, nbytes: int, objects: int = 1) -> Ticket:
        self._objects += objects
        self._bytes += nbytes
        self._peak_objects = max(self._peak_objects, self._objects)
        self._peak_bytes = max(self._peak_bytes, self._bytes)
        self._admitted += objects
        self._next_id += 1
        self._open.add(self._next_id)
        return Ticket(self._next_id, nbytes, objects)

    def release(self, ticket: Ticket) -> None:
        """Return a ticket. Releasing twice is a bug in the caller, so it asserts."""
        with self._cond:
            assert ticket.ticket_id in self._open, "admission ticket released twice"
            self._open.remove(ticket.ticket_id)
            self._objects -= ticket.objects
            self._bytes -= ticket.nbytes
            if self._waiters:
                self._cond.notify_all()

    def stats(self) -> AdmissionStats:
        with self._cond:
            return AdmissionStats(
                self._objects,
                self._bytes,
                self._peak_objects,
                self._peak_bytes,
                self._admitted,
                self._refused,
            )
