"""Block pools and five-type routing (runtime check 2): each kind allocates and evicts by
its own policy; there is no shared one-size policy.

A :class:`BlockPool` mirrors one shard's pool for one column: a free list, the generation of
every physical block (bumped on every free, so a handle to a freed or reused block is stale),
and which record occupies each block. The shard holds the bytes; this is the metadata twin.

Eviction policies, chosen through ``EVICTION_POLICIES[kind]`` (lower key = evicted first):

* SWA: blocks that left every live window (no resume point within one window after them)
  go first, then least recently used.
* COMPRESSED and INDEXER: leaves of the prefix tree before their parents (evicting a parent
  makes every descendant unusable), then LRU. An INDEXER goes with its KV and vice versa: the
  state view evicts both columns of the entry together.
* TAIL: only complete tails; a tail being written (TAIL_PARTIAL) is never a candidate.
* DISK: LRU by bytes inside the disk tier itself (``storage``), not here.

Candidates are examined exactly when the pool holds few blocks and by a fixed-size sample
otherwise (sampled LRU, as Redis does), so eviction is O(1) in the pool size.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .checks import Holds
from .records import ObjRecord
from .states import Kind, State

__all__ = ["EVICTION_POLICIES", "BlockPool", "PoolConfig"]

_SAMPLE = 48
_EVICTABLE = frozenset(
    {
        State.COMPRESSED_READY,
        State.TAIL_COMPLETE,
        State.SWA_VALID,
        State.ON_DISK_READY,
        State.INDEXER_WRITTEN,
        State.INDEXER_SYNCED,
    }
)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_blocks: int
    stride: int  # bytes between block starts
    base_align: int = 4096  # alignment of the pool's base address (power of two)


_POWERS = {1 << i: 1 << i for i in range(31)}  # one shared int object per power of two


def _alignment(address: int, nbytes: int, base_align: int) -> int:
    value = address | nbytes
    low = value & -value if value else 1 << 30
    return _POWERS[min(low, base_align, 1 << 30)]


class BlockPool:
    def __init__(self, config: PoolConfig, seed: int = 0) -> None:
        self.config = config
        self.free: deque[int] = deque(range(config.num_blocks))
        self.generation = [0] * config.num_blocks
        self.owner: list[ObjRecord | None] = [None] * config.num_blocks
        self._rng = random.Random(seed)

    def take(self) -> int | None:
        return self.free.popleft() if self.free else None

    def alignment_of(self, block: int, nbytes: int) -> int:
        return _alignment(block * self.config.stride, nbytes, self.config.base_align)

    def release(self, block: int) -> None:
        """Free a block; its generation moves on so every outstanding handle goes stale."""
        self.owner[block] = None
        self.generation[block] += 1
        self.free.append(block)

    def victim(self, kind: Kind, holds: Holds) -> ObjRecord | None:
        """The best eviction candidate by ``kind``'s policy, or None if nothing may go
        (leased or captured records never go)."""
        occupied = self.config.num_blocks - len(self.free)
        if occupied == 0:
            return None
        if occupied <= _SAMPLE:
            pool = [r for r in self.owner if r is not None]
        else:
            pool = [
                r
                for r in (
                    self.owner[self._rng.randrange(self.config.num_blocks)] for _ in range(_SAMPLE)
                )
                if r is not None
            ]
        candidates = [r for r in pool if _evictable(r, holds)]
        if not candidates:
            return None
        return min(candidates, key=EVICTION_POLICIES[kind])


def _evictable(rec: ObjRecord, holds: Holds) -> bool:
    return rec.state in _EVICTABLE and not holds.held(rec)


def _swa_key(rec: ObjRecord) -> tuple[int, int]:
    return (1 if rec.entry.swa_need else 0, rec.entry.last_used)


def _tree_key(rec: ObjRecord) -> tuple[int, int]:
    return (1 if rec.entry.children else 0, rec.entry.last_used)


EVICTION_POLICIES: dict[Kind, Callable[[ObjRecord], tuple[int, int]]] = {
    Kind.SWA: _swa_key,
    Kind.COMPRESSED: _tree_key,
    Kind.INDEXER: _tree_key,
    Kind.TAIL: _tree_key,
}
