"""Walk segments: runs of blocks the funnel's walk verified, reused by every later walk.

A long lookup's walk is one hint read (or dict lookup) and one integer test per block (~0.05
us each in Python, several times that with caches cold between RPCs), so a 2,048-block prompt
pays for 2,048 of them even when every block was walked a moment ago by another prompt sharing
the prefix (a document many questions ask about, a long chat history). A segment certifies one
aligned run of ``S`` blocks ``[j*S, (j+1)*S)``: those ``S`` hashes, byte for byte, are in the
index as these entries, each with ``gate >= Segment.gate``. It hangs on the run's last entry and
registers itself on all ``S`` entries; ``contracts.summarise`` (every change to an entry passes
through it, or through ``contracts.defer``) drops it with the entry's memos, so a segment never
outlives what it certifies::

    walk, run j:  end = index[h[(j+1)*S - 1]]
                  end.segment live, gate >= need, hashes == h[j*S:(j+1)*S] (one memcmp)?
                      yes --> accept its S entries at once
                      no  --> the per-block walk over the run; a run walked whole twice
                              gets a segment (a prefix looked up once pays nothing extra)

Equivalence with the per-block walk: a hash maps to one entry, so equal hash bytes mean the
same entries, and their gates have not changed since (any change dropped the segment). The
run's packed handle records are kept on the segment too (per monotone column, packed on first
use by the state view), so packing a long match joins one piece per run and column instead of
one row per block.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Callable, Iterable, Sequence

from .contracts import settled
from .defaults import DEFAULT_SEGMENT_BLOCKS
from .errors import InvalidInput, MisplacedHash
from .ids import BLOCK_HASH_BYTES, BlockHash, PackedHashes
from .layout import Layout
from .prefix_index import PrefixIndex
from .records import ObjRecord, PrefixEntry, Segment, register

__all__ = ["DEFAULT_SEGMENT_BLOCKS", "Segment", "first_missing", "segment_blocks_for", "walk"]

_GATE = operator.attrgetter("gate")
# What a walk asks for the first block's entry: no entry's parent, no child hint
_NOWHERE = PrefixEntry(BlockHash(b""), None, -1, [])
AlignOf = Callable[[ObjRecord], int]


# Hangs on a run's last entry after its first whole walk: the second builds the segment.
_SEEN = Segment(b"", (), 0, live=False)


@functools.cache  # n < the segment size: bounded by the configured sizes
def _splitter(n: int) -> struct.Struct:
    return struct.Struct("16s" * n)


def walk(index: PrefixIndex, data: bytes, count: int, need: int,
         size: int, layout: Layout | None = None, align_of: AlignOf | None = None
         ) -> tuple[list[PrefixEntry], list[Segment | None]]:
    """The entries of the first ``count`` hashes of ``data`` (packed, 16 bytes each) while
    each is present with ``gate >= need``, as the per-block walk finds them; and, for each
    whole run of ``size`` blocks among them, the segment that certified it (None: walked
    block by block)."""
    entries: list[PrefixEntry] = []
    used: list[Segment | None] = []
    hb = BLOCK_HASH_BYTES
    run_bytes = size * hb
    split = _splitter(size).unpack_from
    for start in range(0, count - count % size, size):
        lo = start * hb
        end = index.get(data[lo + run_bytes - hb : lo + run_bytes])
        seg = end.segment if end is not None else None
        if (end is not None and seg is not None and seg.live and seg.gate >= need
                and data.startswith(seg.hashes, lo)):  # one memcmp, no copy
            if end.depth != start + size - 1:  # (its blocks' depths are consecutive)
                raise MisplacedHash(start, end.depth - size + 1)
            entries += seg.entries
            used.append(seg)
            continue
        if not walk_blocks(index, split(data, lo), need, entries, layout, align_of, start,
                           exact=True):
            return entries, used
        assert end is not None and entries[-1] is end  # the run was walked whole
        used.append(_certify(end, data[lo : lo + run_bytes], entries[-size:]))
    tail = count % size
    if tail:
        walk_blocks(index, _splitter(tail).unpack_from(data, (count - tail) * hb), need,
                    entries, layout, align_of, count - tail, exact=True)
    return entries, used


def walk_blocks(index: PrefixIndex, hashes: Iterable[BlockHash], need: int,
                out: list[PrefixEntry], layout: Layout | None, align_of: AlignOf | None,
                depth: int, exact: bool = False) -> bool:
    """The per-block walk over ``hashes``, the first of them block ``depth``'s, appending to
    ``out``; False where it stopped (a pending entry is summarised first:
    ``contracts.defer``). A hash the index holds at another depth is another block's
    (:class:`MisplacedHash`): its KV, served here, would be read at the wrong position.
    ``exact``: every hash is a ``bytes`` (split from packed ones), none of another type.

    Each block is first asked of the entry before it: its ``child`` is the child a walk
    last went on to (or the last made), and where that child has the block's hash and
    passes the gate it is the entry the index holds for the hash (a hint never outlives
    its child in the index: ``PrefixTree.gc_entry`` clears it), one block below (a child
    is its parent's depth + 1: ``PrefixTree.entry_under``, ``PrefixTree.adopt``): one
    attribute read and one comparison, not a hash, a part and a dict lookup. Elsewhere (the
    first block, a branch, an orphan, a pending entry) the index answers
    (:func:`_from_index`), and the hint is turned to the child found. A hash of another
    type than ``bytes`` (a ``bytearray`` equal to a cached one, say) is never taken from
    a hint: the index answers for it, as it always did."""
    parts, c = index.parts, _NOWHERE  # (c: the entry before the block)
    if exact:
        for h in hashes:
            e = c.child
            if e.gate < need or e.block_hash != h:
                got = _from_index(parts, h, c, depth, need, layout, align_of)
                if got is None:
                    return False
                e = got
            out.append(e)
            c = e
        return True
    for h in hashes:
        e = c.child
        # (the same hash object: a bytes, as every key is; else a bytes equal to it)
        if e.gate < need or (e.block_hash is not h and (
                e.block_hash != h or type(h) is not bytes)):
            got = _from_index(parts, h, c, depth, need, layout, align_of)
            if got is None:
                return False
            e = got
        out.append(e)
        c = e
    return True


def _from_index(parts: list[dict[BlockHash, PrefixEntry]], h: BlockHash, c: PrefixEntry,
                depth: int, need: int, layout: Layout | None, align_of: AlignOf | None
                ) -> PrefixEntry | None:
    """The entry of ``h``, the block after ``c`` (``_NOWHERE``: block ``depth``), as the index
    has it, if the walk goes on through it; None where it stops."""
    try:
        e = parts[h[0]].get(h)  # (PrefixIndex.get, inlined)
    except (IndexError, TypeError):
        return None  # not a block hash: no entry has it (the length check names it)
    if e is None:
        return None
    d = depth if c is _NOWHERE else c.depth + 1
    if e.depth != d:
        raise MisplacedHash(d, e.depth)
    # gate: F_MONO and byte alignment folded in one int (a pending entry: 0 until
    # summarised here, contracts.defer)
    if e.gate < need and not settled(e, need, layout, align_of):
        return None
    if e.parent is c:  # (never _NOWHERE)
        c.child = e  # the next walk through c asks this child first
    return e


def _certify(end: PrefixEntry, hashes: bytes, run: list[PrefixEntry]) -> Segment | None:
    """A run just walked whole: remember it the first time, certify it the second."""
    old = end.segment
    if old is None:
        end.segment = _SEEN
        return None
    if old.live:  # another run ends here (orphans after a restart): one segment per entry
        old.drop()
    seg = Segment(hashes, tuple(run), min(map(_GATE, run)))
    register(seg, run)
    end.segment = seg
    return seg


def first_missing(index: PrefixIndex, hashes: Sequence[BlockHash],
                  count: int) -> int:
    """Where the first of ``hashes[:count]`` the index lacks is, by bisection (log2(count)
    dict lookups), taking present hashes to come before absent ones as they do along a
    chained prefix. A guess where they do not (an orphan after a restart): callers check
    what they conclude from it."""
    data = hashes.data if isinstance(hashes, PackedHashes) else None
    get, lo, hi, hb = index.get, 0, count, BLOCK_HASH_BYTES
    while lo < hi:
        mid = (lo + hi) // 2
        h = hashes[mid] if data is None else data[mid * hb : mid * hb + hb]
        if get(h) is None:
            hi = mid
        else:
            lo = mid + 1
    return lo


def segment_blocks_for(layout: Layout, asked: int | None) -> int:
    """The walk segment size: ``asked`` if the layout can take it (0 = off, else a multiple
    of its period: runs must start where the layout repeats), else InvalidInput; None: the
    smallest multiple of the period from DEFAULT_SEGMENT_BLOCKS up (a spec's period need not
    divide 64: block sizes 64 and 96 repeat every 6 hash blocks of 32)."""
    period = layout.period
    if asked is None:
        return -(-DEFAULT_SEGMENT_BLOCKS // period) * period
    if asked < 0 or asked % period:
        raise InvalidInput(f"segment_blocks must be 0 (off) or a positive multiple of "
                           f"{period} (the layout's period), got {asked}")
    return asked
