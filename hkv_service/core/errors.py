"""The one error hierarchy of hkv. Edges translate it (gRPC: ``wire/status_map.py``).

::

    HkvError
    ├── InvalidInput                  the caller sent something malformed
    │   ├── SpecError                 a cache spec that cannot describe a model
    │   │   ├── ZeroBlockSize
    │   │   ├── WindowSmallerThanBlock
    │   │   ├── UnknownKind
    │   │   └── BadSpecField
    │   ├── BadHash                   empty or wrongly sized block hash
    │   │   └── MisplacedHash         another block's hash (.depth, .known_depth)
    │   ├── PositionBeyondHashes
    │   ├── UnknownGroup
    │   ├── FutureGeneration          a generation the owner never issued
    │   ├── WrongSize                 bytes that are not exactly the object's (carries sizes)
    │   └── UnsetVersion              version 0 where a KV version is required
    ├── NotFound
    │   ├── UnknownObject
    │   ├── UnknownLease
    │   ├── UnknownCapture
    │   └── UnknownOwner
    ├── FailedPrecondition
    │   ├── IllegalTransition         the transition table forbids it; state unchanged (.state,
    │   │                             .event, .precondition, .index: the refused move)
    │   ├── VersionConflict           compare-and-set on an object's version failed
    │   ├── AbiMismatch
    │   ├── StaleHandle               generation moved on: recompute, never old bytes
    │   ├── LeaseExpired
    │   └── TopologyPinned            a live graph capture pins the block
    ├── ResourceExhausted
    │   ├── AdmissionRefused          in-transit cap reached (carries retry_after_s)
    │   └── PoolExhausted             no evictable block left in a pool
    └── Unavailable
        └── OwnerLost                 the shard holding the bytes is gone
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .states import Event, State

__all__ = [
    "AbiMismatch",
    "AdmissionRefused",
    "BadHash",
    "BadSpecField",
    "FailedPrecondition",
    "FutureGeneration",
    "HkvError",
    "IllegalTransition",
    "InvalidInput",
    "LeaseExpired",
    "MisplacedHash",
    "NotFound",
    "OwnerLost",
    "PoolExhausted",
    "PositionBeyondHashes",
    "ResourceExhausted",
    "SpecError",
    "StaleHandle",
    "TopologyPinned",
    "Unavailable",
    "UnknownCapture",
    "UnknownGroup",
    "UnknownKind",
    "UnknownLease",
    "UnknownObject",
    "UnknownOwner",
    "UnsetVersion",
    "VersionConflict",
    "WindowSmallerThanBlock",
    "WrongPartition",
    "WrongSize",
    "ZeroBlockSize",
]


class HkvError(Exception):
    """Base of every error hkv raises on purpose. ``str(err)`` is a sentence for a person."""


class InvalidInput(HkvError):
    pass


class SpecError(InvalidInput):
    pass


class ZeroBlockSize(SpecError):
    pass


class WindowSmallerThanBlock(SpecError):
    pass


class UnknownKind(SpecError):
    pass


class BadSpecField(SpecError):
    pass


class BadHash(InvalidInput):
    pass


class MisplacedHash(BadHash):
    """A lookup's hash at block ``depth`` is the hash of block ``known_depth`` of a chain
    the cache holds: served, that block's KV would be read at another position (a client
    that skipped blocks it holds without saying where its hashes start)."""

    def __init__(self, depth: int | str, known_depth: int | None = None) -> None:
        if isinstance(depth, str):  # (message) alone: as an edge rebuilds it from a status
            super().__init__(depth)
            self.depth: int | None = None
            self.known_depth = known_depth
            return
        super().__init__(f"the hash given for block {depth} is the hash of block "
                         f"{known_depth} of a cached chain; send a prompt's hashes from its "
                         "first block (a range of a split chain: from first_block)")
        self.depth, self.known_depth = depth, known_depth


class PositionBeyondHashes(InvalidInput):
    pass


class UnknownGroup(InvalidInput):
    pass


class FutureGeneration(InvalidInput):
    pass


class WrongSize(InvalidInput):
    """A write whose bytes are not exactly its object's: a short one would leave the block's
    tail showing the previous occupant's bytes, a long one would not fit."""

    def __init__(self, what: str, expected: int | None = None, got: int | None = None) -> None:
        # (message) alone: as an edge rebuilds it from a status, sizes unknown
        super().__init__(what if expected is None else
                         f"{what}: {got} bytes given, the object is exactly {expected} bytes")
        self.what, self.expected, self.got = what, expected, got


class UnsetVersion(InvalidInput):
    """Version 0 is what an unset proto field reads as: it never names a KV version."""


class NotFound(HkvError):
    pass


class UnknownObject(NotFound):
    pass


class UnknownLease(NotFound):
    pass


class UnknownCapture(NotFound):
    pass


class UnknownOwner(NotFound):
    pass


class FailedPrecondition(HkvError):
    pass


class IllegalTransition(FailedPrecondition):
    """The refused move, where known (``transitions.apply`` always says; an edge rebuilding
    the error from a bare status may not): ``state`` the object was in, ``event`` refused,
    ``precondition`` the sentence of the check that refused it (None: the table has no such
    move), ``index`` the event's place in its item of a ``transition_many`` call."""

    def __init__(self, message: str, *, state: State | None = None,
                 event: Event | None = None, precondition: str | None = None,
                 index: int | None = None) -> None:
        super().__init__(message)
        # instance attributes only: Ray's re-raised copy of an actor's error reads them
        # through to the original (a class default would answer first)
        self.state, self.event, self.precondition, self.index = state, event, precondition, index


class VersionConflict(FailedPrecondition):
    pass


class AbiMismatch(FailedPrecondition):
    pass


class StaleHandle(FailedPrecondition):
    pass


class LeaseExpired(FailedPrecondition):
    pass


class TopologyPinned(FailedPrecondition):
    pass


class WrongPartition(FailedPrecondition):
    """Sent to a metadata partition that does not hold it: ``partition`` is the one that
    was asked (``I/N``), ``expected`` the index that holds it (a client whose partition list
    is in another order than the deployment's, or of another length)."""

    def __init__(self, message: str, *, partition: str | None = None,
                 expected: int | None = None) -> None:
        super().__init__(message)
        self.partition, self.expected = partition, expected


class ResourceExhausted(HkvError):
    pass


class AdmissionRefused(ResourceExhausted):
    def __init__(self, message: str, retry_after_s: float = 0.05) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PoolExhausted(ResourceExhausted):
    pass


class Unavailable(HkvError):
    pass


class OwnerLost(Unavailable):
    pass
