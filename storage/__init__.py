"""hkv's disk tier: cache objects at rest in LMDB, checksummed, admission-capped, LRU by bytes.

Layers, each its own module::

    tier.DiskTier         put/get/scan/evict; admission tickets; quarantine; counters
      catalog.Catalog     records/index/lru/quarantine bookkeeping inside one transaction
      record              key and record format, header checksum, payload verification
      verify, helper      copy beside hash; the one helper thread (encode beside commit)
      codec               raw or zstd (only when it saves >= 10%)
      lmdb_store          one LMDB env per owner: sync mode, map growth, error translation,
                          damage found at open or while running -> set aside, start cold
        envcheck          data.mdb against its meta pages before LMDB maps it (no SIGBUS)
        pagecheck         every page reachable from them against LMDB's invariants, the
                          free-page list included (no LMDB; writes rely on what reads skip)
        envprobe          LMDB's walk of the environment in a child process (envwalk), so a
                          crash on a damaged page ends the child, not the shard
"""

from __future__ import annotations

from .errors import CorruptEntry, DiskFull, NotOnDisk, StorageFailure
from .record import KIND_CODES, DiskKey, RecordMeta
from .tier import DiskTier, TierStats

__all__ = [
    "KIND_CODES",
    "CorruptEntry",
    "DiskFull",
    "DiskKey",
    "DiskTier",
    "NotOnDisk",
    "RecordMeta",
    "StorageFailure",
    "TierStats",
]
