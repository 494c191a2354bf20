"""Save admission: how often each chain block was offered for saving (a doorkeeper).

A prefix that is never asked for again costs a save (staging, allocation, shard writes,
commits) and returns nothing; on a workload without reuse that is all a cache does. A save
offered with ``needed=2`` lands only for the leading blocks offered at least twice (this offer
included), as SGLang's HiCache ``write_through_selective`` writes a node back on its second
hit: a system prompt or a conversation's earlier turns are saved when a second request
brings them; a one-off prompt never is.

The table is direct-mapped (as TinyLFU's doorkeeper): ``SLOTS`` fingerprints and counts,
9 MiB whatever the traffic. Two hashes in one slot take it in turn, so a block may need
one offer more than ``needed``, or (fingerprints of 64 bits: never in practice) one less.
Either costs a hit or a save, never bytes: admission decides only whether a save is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .errors import InvalidInput
from .ids import BlockHash, check_hash_lengths

__all__ = ["MAX_NEEDED", "SLOTS", "Sightings"]

SLOTS = 1 << 20  # 8 MiB of fingerprints, 1 MiB of counts
MAX_NEEDED = 255  # counts saturate at a byte


class Sightings:
    """Offers per block hash, for :meth:`admit`. Not thread-safe: its owner's lock guards it."""

    def __init__(self, slots: int = SLOTS) -> None:
        self._slots = slots
        # made at the first offer: a service no connector asks for admission pays nothing
        self._fps: np.ndarray | None = None
        self._counts: np.ndarray | None = None

    def admit(self, block_hashes: Sequence[BlockHash], needed: int, offered_from: int = 0
              ) -> int:
        """Record one offer of each block of the chain ``block_hashes`` (from its root) from
        depth ``offered_from`` on (a request offers a block once: its saves come step by step,
        each with the chain so far; the blocks before are its earlier saves' or hits');
        the depth up to which those blocks are admitted: offered at least ``needed`` times by
        now, leading (a block past one that is not admitted is not either: no hit reaches it
        before the one in between is saved). ``needed`` 1 admits them all. Raises
        InvalidInput (``needed`` outside 1..MAX_NEEDED, ``offered_from`` outside the chain)
        or BadHash, recording nothing."""
        if not 1 <= needed <= MAX_NEEDED:
            raise InvalidInput(f"needed must be 1..{MAX_NEEDED} offers, got {needed}")
        if not 0 <= offered_from <= len(block_hashes):
            raise InvalidInput(f"offered_from {offered_from} is outside the chain of "
                               f"{len(block_hashes)} blocks")
        check_hash_lengths(block_hashes)
        if self._fps is None:
            self._fps = np.zeros(self._slots, np.uint64)
            self._counts = np.zeros(self._slots, np.uint8)
        admitted = None
        for depth in range(offered_from, len(block_hashes)):
            count = self._offer(bytes(block_hashes[depth]))
            if admitted is None and count < needed:
                admitted = depth
        return len(block_hashes) if admitted is None else admitted

    def _offer(self, h: bytes) -> int:
        """``h``'s offers, this one included."""
        fps, counts = self._fps, self._counts
        assert fps is not None and counts is not None
        fp = int.from_bytes(h[:8], "little") | 1  # 0 marks an empty slot
        slot = int.from_bytes(h[8:16], "little") % self._slots
        if int(fps[slot]) != fp:
            fps[slot] = fp
            counts[slot] = 1
            return 1
        count = min(int(counts[slot]) + 1, MAX_NEEDED)
        counts[slot] = count
        return count
