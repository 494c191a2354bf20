"""Copy and verify on two cores at once: the checksum pass runs beside the copy, not after it.

A load copies the payload out of the LMDB map and checks its xxh3-128. Run one after the other
the hash adds 20-35% to the copy on the development machine (2 cores: the hash of a just-copied
1 MiB object runs at ~14-17 GB/s against a ~6 GB/s page-cache copy), which alone held loads
under 0.8x of a bare LMDB get + copy. Both passes only read the source and release the GIL
(``xxhash`` for buffers over 64 KiB, ``np.copyto`` for plain byte arrays), so here the hash
runs on the helper thread (:mod:`storage.helper`) while the caller copies; the load then
costs about the copy.

What is hashed is the *source* in the map, not the copy: the two run at once over the same
bytes. That is sound because the source is immutable for as long as the caller's read
snapshot is open (LMDB's MVCC never reuses a page a live reader can see, and the tier never
writes through the map: no ``writemap``), and :func:`copy_all` returns only after both passes
ended, inside that snapshot. A copy from verified, immutable bytes is those bytes.

Handing work to the helper costs ~20-40 us (a futex wake on a busy 2-core host), more than
hashing 256 KiB, so a batch goes parallel only from :data:`PARALLEL_MIN_BYTES` in all; below,
the caller copies and hashes alone (:func:`storage.record.copy_digest`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait as wait_for

import numpy as np
import xxhash

from .helper import run_beside

__all__ = ["PARALLEL_MIN_BYTES", "copy_all"]

# Measured on 2 cores against raw get + copy: one 1 MiB object 0.79-0.94 with the helper,
# 0.71-0.77 alone; one 256 KiB object 0.57-0.65 with it (the handoff outweighs its hash),
# 0.83-0.87 alone; batches of 16 x 256 KiB 0.88-0.94 with it, 0.85 alone.
PARALLEL_MIN_BYTES = 512 * 1024


def _digests(sources: list[memoryview]) -> list[bytes]:
    return [xxhash.xxh3_128_digest(src) for src in sources]


def copy_all(pairs: Sequence[tuple[memoryview, memoryview]],
             copy_digest: Callable[[memoryview, memoryview], bytes]) -> list[bytes]:
    """``out[:] = src`` for every ``(src, out)`` (equal lengths), returning the xxh3-128 of
    each source in order. The sources must stay valid and unchanged until this returns.

    Under :data:`PARALLEL_MIN_BYTES` in all, ``copy_digest`` does each pair on this thread.
    """
    if sum(len(out) for _, out in pairs) < PARALLEL_MIN_BYTES:
        return [copy_digest(src, out) for src, out in pairs]
    hashing = run_beside(_digests, [src for src, _ in pairs])
    try:
        for src, out in pairs:
            np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(src, np.uint8))
    finally:
        # Never return (and so never let the snapshot close) while the helper reads the map.
        wait_for([hashing])
    return hashing.result()
