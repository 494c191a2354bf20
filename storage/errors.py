"""Errors of the disk tier, all grafted onto the one hkv tree (``hkv_service.core.errors``).

::

    HkvError
    ├── NotFound
    │   └── UnknownObject
    │       ├── NotOnDisk          no record under this key (never written, evicted, deleted)
    │       └── CorruptEntry       the record failed verification; it was quarantined
    ├── ResourceExhausted
    │   └── DiskFull               byte budget, map size or the file system is full
    └── Unavailable
        └── StorageFailure         any other LMDB failure (env closed, used across fork ...)
            └── StoreDamaged       the LMDB environment itself is damaged; it was set aside

``CorruptEntry`` is a ``NotFound`` on purpose: after the read it is quarantined, so for the
caller it is a miss (recompute), never data. ``StoreDamaged`` never leaves the tier: it turns it
into a miss (or a retry on the fresh environment). LMDB's own exceptions are translated to these in
exactly one place, :func:`storage.lmdb_store.translate`.
"""

from __future__ import annotations

from hkv_service.core.errors import ResourceExhausted, Unavailable, UnknownObject

__all__ = ["CorruptEntry", "DiskFull", "NotOnDisk", "StorageFailure", "StoreDamaged"]


class NotOnDisk(UnknownObject):
    pass


class CorruptEntry(UnknownObject):
    def __init__(self, message: str, reason: str, key: bytes = b"") -> None:
        super().__init__(message)
        self.reason = reason
        self.key = key  # the record's key bytes, to quarantine it


class DiskFull(ResourceExhausted):
    pass


class StorageFailure(Unavailable):
    pass


class StoreDamaged(StorageFailure):
    """A transaction met damage in the environment's own structure (a page LMDB cannot use,
    a truncated file). ``generation``: the environment it was met in (see DiskStore.reset)."""

    def __init__(self, message: str, reason: str, generation: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.generation = generation
