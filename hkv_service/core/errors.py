"""The one error hierarchy of hkv. Edges translate it (gRPC: ``server/status_map.py``).

::

    HkvError
    ├── InvalidInput                  the caller sent something malformed
    │   ├── SpecError                 a cache spec that cannot describe a model
    │   │   ├── ZeroBlockSize
    │   │   ├── WindowSmallerThanBlock
    │   │   ├── UnknownKind
    │   │   └── BadSpecField
    │   ├── BadHash                   empty or wrongly sized block hash
    │   ├── PositionBeyondHashes
    │   ├── UnknownGroup
    │   └── FutureGeneration          a generation the owner never issued
    ├── NotFound
    │   ├── UnknownObject
    │   ├── UnknownLease
    │   ├── UnknownCapture
    │   └── UnknownOwner
    ├── FailedPrecondition
    │   ├── IllegalTransition         the transition table forbids it; state unchanged
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
    "VersionConflict",
    "WindowSmallerThanBlock",
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


class PositionBeyondHashes(InvalidInput):
    pass


class UnknownGroup(InvalidInput):
    pass


class FutureGeneration(InvalidInput):
    pass


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
    pass


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
