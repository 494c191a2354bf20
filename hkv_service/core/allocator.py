"""Block pools and five-type routing (runtime check 2): each kind allocates and evicts by
its own policy; there is no shared one-size policy.

A :class:`BlockPool` mirrors one shard's pool for one column: a free list, the generation of
every physical block (bumped on every free, so a handle to a freed or reused block is stale),
and which record occupies each block. The shard holds the bytes; this is the metadata twin.

Eviction policies, chosen through ``EVICTION_POLICIES[kind]`` (lower key = evicted first):

* SWA: blocks that left every live window of their own group (no resume point within the
  group's window after them: ``swa_need`` keeps one 32-bit count per SWA column) go first,
  then least recently used.
* COMPRESSED and INDEXER: least recently used, deepest first among equals. A lookup ages the
  whole path it used (``PrefixTree.age``) and a write ages the path it wrote, so a block is
  never more recent than its parent: a block with a deeper block of its column behind it
  goes only after that one (evicting a parent makes every descendant unusable), a shared
  root last. An INDEXER goes with its KV and vice versa: the state view evicts both columns
  of the entry together.
* TAIL: only complete tails (a tail being written, TAIL_PARTIAL, is never a candidate);
  those at resume points no longer prompt extends first, then LRU.
* STATE (recurrent checkpoints): one inside a chain first; the latest of a chain and a
  shared-prefix junction last (:func:`state_rank`); LRU among equals.
* DISK: LRU by bytes inside the disk tier itself (``storage``), not here.

Candidates are examined exactly when the pool holds few blocks and by a fixed-size sample
otherwise (sampled LRU, as Redis does), so eviction is O(1) in the pool size.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeAlias

from .checks import Holds
from .ids import shared_int
from .records import ObjRecord
from .states import Kind, State

__all__ = ["EVICTION_POLICIES", "SWA_LANE_BITS", "BlockPool", "Policy", "PoolConfig",
           "state_rank", "swa_policy"]

_SAMPLE = 48
_EVICTABLE = frozenset(
    {
        State.COMPRESSED_READY,
        State.TAIL_COMPLETE,
        State.STATE_READY,
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
    # The first block this view hands out: blocks [first, num_blocks) are its own. A shard
    # registered with N metadata partitions gives each its own range (core/partitions.py).
    first: int = 0
    # Where the pool's blocks live ("cpu", "cuda"): what a router is told the tier is
    # (the residency feed's medium, core/kvevents.py); not part of any placement decision.
    device: str = "cpu"
    # The generation a block is first handed out at: above every generation an earlier
    # registration of this owner handed out (workers/generations.py picks it), so a claim
    # from before a service restart is older than every block of the new registration.
    generation_floor: int = 0


_POWERS = {1 << i: 1 << i for i in range(31)}  # one shared int object per power of two
_SHARED_GENERATIONS = 257  # as many as Python shares small ints (0..256)
_DENSE_MIN = 1024  # a block this near the start, or within twice the arrays, grows them
_NO_BLOCK = 1 << 62  # above every block number


class _Unseen:
    """An array slot of a block never handed out (or forgotten)."""

    __slots__ = ()


_UNSEEN = _Unseen()
_Slot: TypeAlias = "ObjRecord | int | _Unseen"  # a block's books: its holder, else its generation


_MAX_ALIGN = 1 << 30  # what "aligned to everything" reads as (an address and length of 0)


def _lowbit(value: int) -> int:
    return value & -value if value else _MAX_ALIGN


def alignment(address: int, nbytes: int, base_align: int) -> int:
    """The largest power of two dividing ``address`` and ``nbytes``, at most ``base_align``
    (the pool's base address is aligned to that much only): layer 4's rule, its one home."""
    return _POWERS[min(_lowbit(address | nbytes), base_align, _MAX_ALIGN)]


class BlockPool:
    """Per-block metadata grows with the blocks used, not the blocks declared: a block has
    books only once it was handed out, so a registration declaring millions of blocks, or a
    re-confirm naming its last block, costs nothing for the blocks in between. Blocks go out
    in order from ``first``, so their books are one list indexed by ``block - first``
    (8 B a block, where an owner dict and a generation dict took ~72 B), grown as blocks go
    out: a held block's slot is the record holding it (whose ``generation`` is the block's:
    every path that places a record gives it the block's, :meth:`hold` checks it), a free
    one's its generation, a block never handed out (or forgotten) :data:`_UNSEEN`. A block
    claimed far past the list's end (a re-confirm naming a late block first) keeps its slot
    in a small dict until the list reaches it. Blocks ``>= _next`` are free unless a
    re-confirm claimed them ahead, which :meth:`take` steps over. Released blocks wait in
    ``free`` (a deque, oldest first) and ``_free`` (membership): a block claimed by a
    restart's re-confirm leaves the set at once and is skipped when the deque reaches it, so
    every operation is O(1) amortized."""

    def __init__(self, config: PoolConfig, *, nbytes: int, seed: int = 0) -> None:
        self.config = config
        # alignment(block * stride, nbytes, base_align), split so a lookup's summaries pay
        # one multiply per block: lowbit(b * s) = lowbit(b) * lowbit(s), and the low bit of
        # an OR is the lesser one. ``nbytes`` (the size of its column's objects) has no
        # default: a pool that ignored it would call a misaligned length aligned
        self._align_cap = min(_lowbit(nbytes), config.base_align, _MAX_ALIGN)
        self._align_step = _lowbit(config.stride)
        self.free: deque[int] = deque()
        self._free: set[int] = set()
        self._books: list[_Slot] = []  # blocks [first, first + len)
        self._far: dict[int, _Slot] = {}  # blocks claimed far past the list's end
        self._far_min = _NO_BLOCK  # at most the least of them
        self._out = 0  # blocks with books
        self._next = config.first  # [_next, num_blocks): free, unless handed out ahead
        self._floor = config.generation_floor  # a fresh block's first generation
        # floor + n for the first few n, one int object each: records hold these (a block
        # freed n times), and a large floor's ints are not Python's shared small ints
        self._gens = [config.generation_floor + n for n in range(_SHARED_GENERATIONS)]
        self._span = 0  # 1 + the highest block ever handed out (eviction samples below it)
        self._rng = random.Random(seed)

    def free_count(self) -> int:
        return len(self._free) + self.config.num_blocks - self.config.first - self._out

    def occupied(self) -> int:
        """Blocks handed out and not free."""
        return self._out - len(self._free)

    def tracked(self) -> int:
        """Blocks with books: every block handed out and not forgotten."""
        return self._out

    @property
    def span(self) -> int:
        """1 + the highest block ever handed out: every occupied block lies below it."""
        return self._span

    def _slot(self, block: int) -> _Slot:
        i = block - self.config.first
        if 0 <= i < len(self._books):
            return self._books[i]
        return self._far.get(block, _UNSEEN)

    def _put(self, block: int, slot: _Slot) -> None:
        i = block - self.config.first
        if 0 <= i < len(self._books):
            self._books[i] = slot
        else:
            self._far[block] = slot

    def handed_out(self, block: int) -> bool:
        """Whether ``block`` has books (handed out, and not forgotten since)."""
        return self._slot(block) is not _UNSEEN

    def generation_of(self, block: int) -> int:
        """``block``'s generation (KeyError: it was never handed out)."""
        slot = self._slot(block)
        if type(slot) is int:
            return slot
        if slot is _UNSEEN:
            raise KeyError(block)
        return slot.generation  # type: ignore[union-attr]

    def owner_of(self, block: int) -> ObjRecord | None:
        """The record holding ``block``, or None (free, or never handed out)."""
        slot = self._slot(block)
        return None if type(slot) is int or slot is _UNSEEN else slot  # type: ignore[return-value]

    def hold(self, block: int, rec: ObjRecord) -> None:
        """``rec`` holds ``block`` now (handed out by :meth:`take` or a claim, free, and
        ``rec`` placed at its generation)."""
        slot = self._slot(block)
        assert type(slot) is int and slot == rec.generation, \
            f"block {block} held at generation {rec.generation}, its books say {slot!r}"
        self._put(block, rec)

    def books(self) -> Iterator[tuple[int, int, ObjRecord | None]]:
        """``(block, generation, the record holding it or None)`` of every block with books,
        in no particular order."""
        first = self.config.first
        slots = itertools.chain(enumerate(self._books, first), self._far.items())
        for block, slot in slots:
            if type(slot) is int:
                yield block, slot, None
            elif slot is not _UNSEEN:
                yield block, slot.generation, slot  # type: ignore[union-attr, misc]

    def held(self) -> list[ObjRecord]:
        """Every record holding a block."""
        return [r for _, _, r in self.books() if r is not None]

    def take(self) -> int | None:
        while self.free:
            block = self.free.popleft()
            if block in self._free:
                self._free.discard(block)
                return block
        while self.handed_out(self._next):  # claimed ahead by a re-confirm
            self._next += 1
        if self._next >= self.config.num_blocks:
            return None
        block, self._next = self._next, self._next + 1
        return self._hand_out(block, self._floor)

    def _hand_out(self, block: int, generation: int = 0) -> int:
        """Give ``block`` (free, never handed out) books; the block, as a shared int."""
        cfg = self.config
        i = block - cfg.first
        n = len(self._books)
        if n <= i < max(2 * n, _DENSE_MIN):  # near the list's end: grow it past the block
            self._grow(min(cfg.num_blocks, cfg.first + max(i + 1, n + n // 8 + 64)))
        elif i >= n:  # far ahead: its books wait in the dict until the list reaches it
            self._far_min = min(self._far_min, block)
        self._put(block, generation)
        self._out += 1
        if block >= self._span:
            self._span = block + 1
        return shared_int(block)

    def _grow(self, end: int) -> None:
        """The list covers blocks ``[first, end)``; a block claimed far ahead that it now
        reaches moves its books into it."""
        first = self.config.first
        self._books.extend(itertools.repeat(_UNSEEN, end - first - len(self._books)))
        if self._far_min < end:  # (the list grows by an eighth at least: O(log) scans)
            for block in [b for b in self._far if b < end]:
                self._books[block - first] = self._far.pop(block)
            self._far_min = min(self._far, default=_NO_BLOCK)

    def claim(self, block: int) -> bool:
        """Take the free ``block`` itself (an owner re-confirms what it still holds there);
        False if it is not free or outside the pool."""
        return self.claim_at(block, 0) is not None

    def claim_at(self, block: int, generation: int) -> int | None:
        """:meth:`claim` for an owner that issued ``generation`` there: the block's generation
        from now on (the greater of the two: generations issued stay issued), or None if
        it is not free or outside the pool. (One call a re-confirmed block, not four.)"""
        cfg = self.config
        if not cfg.first <= block < cfg.num_blocks:
            return None
        generation = self._shared(generation)  # a re-confirmed record keeps it
        known = self._slot(block)
        if known is not _UNSEEN:
            if block not in self._free:
                return None
            self._free.discard(block)
            assert type(known) is int, "a free block held by a record"
            if generation > known:
                self._put(block, generation)
                return generation
            return known
        self._hand_out(block, generation)  # (take() steps over it if it is ahead)
        return generation

    def _shared(self, generation: int) -> int:
        """``generation`` as the pool's shared int object where it has one."""
        n = generation - self._floor
        return self._gens[n] if 0 <= n < _SHARED_GENERATIONS else generation

    def alignment_of(self, block: int) -> int:
        """:func:`alignment` of ``block``'s address and the column's object size."""
        cap = self._align_cap
        return _POWERS[min((block & -block) * self._align_step, cap) if block else cap]

    def forget(self, block: int) -> None:
        """A retired pool (its owner incarnation lost) lets go of ``block``'s books as the
        reaper passes it (the record it held goes then, not all at once when the pool is
        dropped), and of as many queued free blocks."""
        i = block - self.config.first
        if 0 <= i < len(self._books):
            if self._books[i] is not _UNSEEN:
                self._books[i] = _UNSEEN
                self._out -= 1
        elif self._far.pop(block, _UNSEEN) is not _UNSEEN:
            self._out -= 1
        self._free.discard(block)
        for _ in range(min(2, len(self.free))):
            self.free.popleft()

    def release(self, block: int) -> None:
        """Free a block; its generation moves on so every outstanding handle goes stale."""
        self._put(block, self._shared(self.generation_of(block) + 1))
        self.free.append(block)
        self._free.add(block)

    def victim(self, kind: Kind, holds: Holds, key: Policy | None = None) -> ObjRecord | None:
        """The best eviction candidate by ``kind``'s policy (or ``key``), or None if nothing
        may go (leased or captured records never go)."""
        occupied = self.occupied()
        if occupied == 0:
            return None
        if occupied <= _SAMPLE:
            pool = self.held()
        else:  # sampled over the block numbers in use (claimed ones ahead may be sparse)
            get, rnd = self.owner_of, self._rng.random
            lo = self.config.first
            n = self._span - lo  # (random() scaled: randrange is ~4x its cost, 48 a victim)
            pool = [r for r in (get(lo + int(rnd() * n)) for _ in range(_SAMPLE))
                    if r is not None]
        candidates = [r for r in pool if _evictable(r, holds)]
        if not candidates:
            return None
        return min(candidates, key=key or EVICTION_POLICIES[kind])


def _evictable(rec: ObjRecord, holds: Holds) -> bool:
    return rec.state in _EVICTABLE and not holds.held(rec)


Policy = Callable[[ObjRecord], tuple[int, int]]
SWA_LANE_BITS = 32  # PrefixEntry.swa_need: one count of this many bits per SWA column


def swa_policy(lane: int) -> Policy:
    """The SWA policy of the ``lane``-th SWA column: its own window's count decides."""
    shift, mask = lane * SWA_LANE_BITS, (1 << SWA_LANE_BITS) - 1

    def key(rec: ObjRecord) -> tuple[int, int]:
        return (1 if rec.entry.swa_need >> shift & mask else 0, rec.entry.last_used)

    return key


def _path_key(rec: ObjRecord) -> tuple[int, int]:
    return (rec.entry.last_used, -rec.entry.depth)


def _tail_key(rec: ObjRecord) -> tuple[int, int]:
    return (1 if rec.entry.children else 0, rec.entry.last_used)


def state_rank(rec: ObjRecord) -> int:
    """Which recurrent checkpoints go first: 0 for one inside a chain (its entry has one
    child: the prompt went on past it, to a later checkpoint as a rule), 1 for the latest of
    a chain (no child) and for a shared-prefix junction (two or more: every prompt through
    it can resume there)."""
    return 0 if rec.entry.children == 1 else 1


def _state_key(rec: ObjRecord) -> tuple[int, int]:
    return (state_rank(rec), rec.entry.last_used)


EVICTION_POLICIES: dict[Kind, Policy] = {
    Kind.SWA: swa_policy(0),
    Kind.COMPRESSED: _path_key,
    Kind.INDEXER: _path_key,
    Kind.TAIL: _tail_key,
    Kind.STATE: _state_key,
}
