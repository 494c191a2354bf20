"""The prefix tree: entries, their parent links, orphans waiting for a parent, and what is
counted along the links (resume points per SWA window, LRU ages).

An entry is one hash block of some prefix (``records.PrefixEntry``), kept in the index by
its hash (``prefix_index.PrefixIndex``) and linked to its parent. Entries are made on the way
down a path (an allocation, a confirm: :meth:`PrefixTree.entry_under`) and collected on the
way up once nothing is left in them (:meth:`PrefixTree.gc_entry`)::

    depth    0        1        2              L/H-1 (a resume point: (depth+1)*H % L == 0)
    root --> e0 <-- e1 <-- e2 <-- ... <-- e(L/H-1)     children counted on the parent
             swa_need += one count per complete resume point within each SWA window below

A re-confirm in random order reports a block before its parent: its entry is an *orphan*
(parentless, ``awaits`` its parent's hash) until the parent's entry is made, and then it is
adopted a slice at a time (:meth:`PrefixTree.adopt_some`). A resume-point count whose walk up
stopped at an orphan goes on from there when it is adopted (``cut_walks``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from . import contracts
from .allocator import SWA_LANE_BITS
from .errors import BadHash
from .ids import BLOCK_HASH_BYTES, BlockHash, shared_int
from .layout import Layout
from .prefix_index import Orphans, PrefixIndex
from .records import NO_CHILD, ObjRecord, PrefixEntry, mem_at
from .states import Kind

__all__ = [
    "ADOPT_SLICE",
    "AGE_SLACK",
    "PrefixTree",
    "other_parent",
    "unchained",
    "unchained_report",
]

# Orphans adopted in one lock hold (as a confirm or an allocation returns, and per reap call;
# the rest in later ones): a slice holds the lock ~1 ms however many blocks were confirmed
# before their parents (benchmarks/README.md, "Measured while deciding").
ADOPT_SLICE = 4096
AGE_SLACK = 64  # lookups: LRU order is kept to this precision (see PrefixTree.age)
_READABLE = contracts.READY_STATES


class PrefixTree:
    """The entries of one state view and the counts kept along their links; called under
    the view's lock."""

    def __init__(self, layout: Layout, range_blocks: int) -> None:
        self.layout = layout
        self.range_blocks = range_blocks
        self.index = PrefixIndex()  # (in parts: one dict's resize was O(all entries))
        self._empty_summary = _empty_summaries(layout)
        self._no_mem = (None,) * len(layout.columns)  # a new entry's (set_mem replaces it)
        # entries a re-confirm made before their parent's, and the complete resume points whose
        # walk up waits at one of them, with the increment each goes on with when adopted
        self.orphans = Orphans()
        self.adopting: deque[PrefixEntry] = deque()  # made with orphans still to adopt
        self.cut_walks: dict[PrefixEntry, dict[PrefixEntry, int]] = {}
        # per SWA column (its lane in swa_need): the increments a complete tail adds to the
        # entries within each window above it (step 0: its own entry)
        lanes = {c: i for i, c in enumerate(layout.swa_columns)}
        hb = layout.hash_block
        reach = {c: -(-layout.columns[c].group.window // hb) for c in lanes}
        self._swa_steps = tuple(
            sum(1 << (SWA_LANE_BITS * i) for c, i in lanes.items() if reach[c] > step)
            for step in range(max(reach.values(), default=0)))
        self.tick = 0  # lookups counted: the LRU clock entries are aged by

    # ---- entries made and collected ------------------------------------------------------

    def entry_under(self, h: BlockHash, parent: PrefixEntry | None, depth: int,
                    parent_hash: BlockHash | None = None) -> PrefixEntry:
        """The entry of ``h`` at ``depth`` under ``parent``; made if the index lacks it.
        ``parent_hash``: the parent's hash where its entry is not there yet (a re-confirm's
        report): the entry waits for it as an orphan (:class:`Orphans`)."""
        part = self.index.parts[h[0]]  # (a checked 16-byte hash: its part, looked up once)
        e = part.get(h)
        if e is None:
            if parent is not None and parent.depth != depth - 1:  # (the walk relies on it)
                raise AssertionError(f"a parent at depth {parent.depth} for depth {depth}")
            e = PrefixEntry(h, parent, shared_int(depth), self._no_mem)
            e.flags, e.gate = self._empty_summary[depth % self.layout.period]
            part[h] = e
            if parent is not None:
                parent.children += 1
                parent.child = e
            elif parent_hash is not None:
                self.orphans.wait(e, parent_hash)
            if self.orphans and self.orphans.waits_for(h):
                self.adopting.append(e)  # adopted a slice per lock hold (adopt_some)
            return e
        if e.depth != depth or (None not in (e.parent, parent) and e.parent is not parent):
            raise unchained(depth, e.depth)
        if e.parent is None and parent is not None:  # an orphan of a restart rebuild
            # (not reached while confirms and writes refuse another parent than the one it
            # waits for: kept so that a waiting orphan is never adopted twice)
            if e.awaits is not None:
                self.orphans.forget(e)
            self.adopt(e, parent)
        return e

    def gc_entry(self, entry: PrefixEntry | None) -> None:
        while (
            entry is not None
            and entry.children == 0
            and not any(entry.mem)
            and not any(entry.disk or ())
        ):
            if self.index.get(entry.block_hash) is entry:
                del self.index[entry.block_hash]
            if entry.awaits is not None:
                self.orphans.forget(entry)
            parent = entry.parent
            if parent is not None:
                parent.children -= 1
                if parent.child is entry:  # (a walk's hint never names an entry gone)
                    parent.child = NO_CHILD
            entry = parent

    def age(self, entries: Sequence[PrefixEntry]) -> None:
        """Age the whole path a lookup used (or a write made), root first: an entry is then
        never more recent than its parent, which is what eviction's order rests on. A path
        whose last entry was aged within ``AGE_SLACK`` lookups was aged whole then: skipped,
        so a hot long prefix costs a walk of its path once per that many lookups."""
        if not entries:
            return
        last = entries[-1].last_used
        if last and last + AGE_SLACK >= self.tick:
            return
        tick = self.tick
        for e in entries:
            e.last_used = tick

    def starts_range(self, depth: int) -> bool:
        """Whether an entry at ``depth`` has no parent in this view: a chain's root, or the
        first block of a range when chains are split (its parent is another partition's)."""
        r = self.range_blocks
        return depth % r == 0 if r else depth == 0

    # ---- orphans adopted -----------------------------------------------------------------

    def adopt_some(self, budget: int | None = None) -> bool:
        """Adopt up to ``budget`` (default :data:`ADOPT_SLICE`) of the orphans waiting for the
        entries queued in ``adopting`` (made while orphans waited for them), oldest first: one
        slice as a
        confirm or an allocation returns, and in the reaper's slices, so no call adopts more
        than a slice however many entries it made that others wait for; True while some are
        left. (One whose entry left the index since
        waits for the next entry of its hash, as if it had never been made.) Until adopted an
        orphan is what it was before its parent came: the walk checks depths and reads no
        parent link, a confirm or write naming it under that parent adopts it at once, and
        only the eviction policies' counts above it lag."""
        if budget is None:
            budget = ADOPT_SLICE
        while self.adopting and budget > 0:
            e = self.adopting[0]
            h = e.block_hash
            if self.index.parts[h[0]].get(h) is e:
                children = self.orphans.take(h, budget)
                for child in children:
                    self.adopt(child, e)
                budget -= len(children)
                if self.orphans.waits_for(h):
                    return True  # (the budget is spent)
            self.adopting.popleft()
        return bool(self.adopting)

    def adopt(self, orphan: PrefixEntry, parent: PrefixEntry) -> None:
        """``parent`` is ``orphan``'s, made after it; the resume-point counts that stopped at
        the orphan go on above it. (One of another depth is not its parent: the reports
        contradict each other; it stays an orphan, and the walk, which checks every block's
        depth, never serves it out of place.)"""
        if parent.depth != orphan.depth - 1:
            return
        orphan.parent = parent
        parent.children += 1
        if parent.child is NO_CHILD:
            parent.child = orphan
        for point, step in self.cut_walks.pop(orphan, {}).items():
            self.count_resume_point(point, parent, step, 1)

    # ---- resume points counted for the SWA policy ------------------------------------------

    def resume_point_of(self, rec: ObjRecord) -> bool:
        """``rec`` is a memory object at a resume point's entry (one ending at a multiple of
        L): its changes may complete or break that resume point."""
        return rec.kind is not Kind.DISK and (rec.entry.depth + 1) % self.layout.period == 0

    def complete(self, entry: PrefixEntry, rec: ObjRecord) -> bool:
        """Every memory object the resume point at ``entry`` needs is ready there (its
        COMPRESSED, INDEXER and SWA blocks, its tails): what completes a resume point, with a
        tail or without (a spec with no overlap has none). ``rec``, one of them, first."""
        ready = _READABLE
        if rec.state not in ready[rec.kind] or mem_at(entry, rec.column) is not rec:
            return False
        for c in self.layout.attached[self.layout.period - 1]:
            other = mem_at(entry, c)
            if other is None or other.state not in ready[other.kind]:
                return False
        return True

    def track(self, entry: PrefixEntry, was: bool, now: bool) -> None:
        """Keep ``swa_need`` = complete resume points within one window after each block, per
        SWA column and its own window (the SWA policy keeps the blocks they need)."""
        if now != was:
            self.count_resume_point(entry, entry, 0, 1 if now else -1)

    def count_resume_point(self, point: PrefixEntry, e: PrefixEntry, step: int,
                           delta: int) -> None:
        """Add ``delta`` times the increments of the resume point at ``point`` to ``e`` and
        the entries above it, the ``step``-th increment first. A re-confirm in random order
        makes a block's entry before its parent's (an orphan, adopted when the parent's
        report arrives): a walk cut there is remembered (``cut_walks``) and
        :meth:`entry_under` goes on with it when it adopts the orphan, so a count taken
        back later walks exactly the entries it was added to. (Stopping at the orphan for
        good under-counted the blocks above it, and taking the count back once the parent
        was there went below zero, into the next column's lane.)"""
        steps = self._swa_steps
        while step < len(steps):
            e.swa_need += delta * steps[step]
            step += 1
            if e.parent is None:
                if step < len(steps) and not self.starts_range(e.depth):
                    self._cut_walk(e, point, step if delta > 0 else None)
                return
            e = e.parent

    def _cut_walk(self, orphan: PrefixEntry, point: PrefixEntry, step: int | None) -> None:
        """The walk of the resume point at ``point`` waits at ``orphan`` from its
        ``step``-th increment on (None: it no longer waits, the point is no longer complete)."""
        waiting = self.cut_walks.setdefault(orphan, {})
        if step is not None:
            waiting[point] = step
            return
        waiting.pop(point, None)
        if not waiting:
            del self.cut_walks[orphan]


def _empty_summaries(layout: Layout) -> tuple[tuple[int, int], ...]:
    """Per depth residue, ``contracts.summarise``'s flags and gate of an entry holding no
    record (what a new entry starts with: computed once, not per entry)."""
    out = []
    for d in range(layout.period):
        e = PrefixEntry(BlockHash(bytes(BLOCK_HASH_BYTES)), None, d, [None] * len(layout.columns))
        contracts.summarise(e, layout, lambda _rec: 1)  # (no record: alignment never asked)
        out.append((e.flags, e.gate))
    return tuple(out)


def unchained_report(depth: int, known: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known at depth {known}; "
                   "hashes must be chained")


def other_parent(depth: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known with another parent; "
                   "hashes must be chained")


def unchained(depth: int, known: int) -> BadHash:
    return BadHash(f"block hash at depth {depth} is already known at depth {known} "
                   "with another parent; hashes must be chained")
