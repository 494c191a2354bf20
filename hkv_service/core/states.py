"""Kinds of cache object, their states, the events that move them, and downgrade reasons.

All are ``StrEnum`` so they cross process boundaries (gRPC, Ray) as plain strings. The rules
that connect them live in one place: :mod:`hkv_service.core.transitions`.
"""

from __future__ import annotations

import enum

__all__ = ["TERMINAL_STATES", "Event", "Kind", "Reason", "State"]


class Kind(enum.StrEnum):
    COMPRESSED = "COMPRESSED"  # compressed KV of whole blocks
    TAIL = "TAIL"  # raw tokens not yet compressed (+ compressor overlap state) at a boundary
    SWA = "SWA"  # sliding-window raw KV
    INDEXER = "INDEXER"  # sparse-router index keys of a compressed block
    DISK = "DISK"  # any of the above, swapped out to the disk tier
    # a recurrent group's whole-history state (GatedDeltaNet / Mamba conv + SSM state) as of
    # exactly one boundary: usable only to resume there
    STATE = "STATE"


class State(enum.StrEnum):
    ALLOCATED = "ALLOCATED"  # a block is reserved; nothing readable in it
    WRITING = "WRITING"  # a writer is filling the block (or the async copy is in flight)
    COMPRESSED_READY = "COMPRESSED_READY"
    TAIL_PARTIAL = "TAIL_PARTIAL"  # some raw tokens appended; never readable
    TAIL_COMPLETE = "TAIL_COMPLETE"
    SWA_VALID = "SWA_VALID"  # tokens [lo, hi) of the block are valid
    INDEXER_WRITTEN = "INDEXER_WRITTEN"  # keys written, not yet synced to the KV's version
    INDEXER_SYNCED = "INDEXER_SYNCED"  # synced to ``version`` of the KV it indexes
    OFFLOADING = "OFFLOADING"  # disk write in progress; not yet at rest
    ON_DISK = "ON_DISK"  # at rest: LMDB commit done; needs a load before reading
    ON_DISK_INFLIGHT = "ON_DISK_INFLIGHT"  # loading back; not readable
    ON_DISK_READY = "ON_DISK_READY"  # loaded into a block and checksum-verified
    EVICTED = "EVICTED"  # terminal: freed by policy
    LOST = "LOST"  # terminal: the owner of the bytes died
    CORRUPT = "CORRUPT"  # terminal: checksum mismatch, quarantined
    STATE_READY = "STATE_READY"  # STATE: the state as of its boundary, readable


TERMINAL_STATES = frozenset({State.EVICTED, State.LOST, State.CORRUPT})


class Event(enum.StrEnum):
    BEGIN_WRITE = "BEGIN_WRITE"
    WRITE_DONE = "WRITE_DONE"  # COMPRESSED -> READY; SWA -> VALID(lo, hi); INDEXER -> WRITTEN
    TAIL_APPEND = "TAIL_APPEND"  # tail progress (length grows)
    TAIL_DONE = "TAIL_DONE"  # tail holds every raw token its boundary needs
    INDEXER_SYNC = "INDEXER_SYNC"  # indexer synced to version v of its KV
    OFFLOAD_BEGIN = "OFFLOAD_BEGIN"
    OFFLOAD_COMMITTED = "OFFLOAD_COMMITTED"  # LMDB transaction committed
    OFFLOAD_FAILED = "OFFLOAD_FAILED"
    LOAD_BEGIN = "LOAD_BEGIN"
    LOAD_VERIFIED = "LOAD_VERIFIED"  # bytes in a block, checksum matched
    LOAD_FAILED = "LOAD_FAILED"  # I/O or admission failure: back to at rest
    DROP_COPY = "DROP_COPY"  # the loaded memory copy was freed; disk copy stays at rest
    COPY_LOST = "COPY_LOST"  # the loaded copy's memory owner was lost; disk copy stays at rest
    EVICT = "EVICT"
    LOSE = "LOSE"
    MARK_CORRUPT = "MARK_CORRUPT"


class Reason(enum.StrEnum):
    """Why the funnel (or a read) gave less than the hashes matched. Counted as metrics."""

    PARTIAL_BLOCK = "PARTIAL_BLOCK"  # layer 1: cut back to a whole LCM block
    ABI_MISMATCH = "ABI_MISMATCH"  # layer 2
    MISSING_COMPONENT = "MISSING_COMPONENT"  # layer 3: some group has no object here
    NOT_WRITTEN = "NOT_WRITTEN"  # layer 3: allocated or still being written
    TAIL_INCOMPLETE = "TAIL_INCOMPLETE"  # layer 3: TAIL_PARTIAL or missing at the resume point
    SWA_WINDOW_INCOMPLETE = "SWA_WINDOW_INCOMPLETE"  # layer 3: window not covered at p
    INDEXER_STALE = "INDEXER_STALE"  # layer 3: indexer version != KV version
    DISK_INFLIGHT = "DISK_INFLIGHT"  # layer 3: being loaded or offloaded
    OWNER_LOST = "OWNER_LOST"  # layer 3: shard died
    CORRUPT = "CORRUPT"  # layer 3: checksum mismatch found earlier
    MISALIGNED = "MISALIGNED"  # layer 4: a handle's address or length is misaligned
    STALE_HANDLE = "STALE_HANDLE"  # read time: generation moved on (TOCTOU)
    ADMISSION = "ADMISSION"  # a needed disk load was refused by the admission cap
    TOPOLOGY_CHANGED = "TOPOLOGY_CHANGED"  # a captured graph's blocks changed
    # a worker's call could not reach the metadata service (restarting, down): recompute
    SERVICE_UNAVAILABLE = "SERVICE_UNAVAILABLE"
    # layer 3: a recurrent group keeps no state at exactly this boundary (the engine kept
    # states only at some boundaries, or this one's was evicted): resume at one that has
    NO_STATE_AT_BOUNDARY = "NO_STATE_AT_BOUNDARY"
