"""Is every page LMDB can reach in a data file what LMDB's code assumes? Pure: no LMDB.

Why: LMDB trusts the pages it reaches. The child's walk (:mod:`storage.envprobe`) lets LMDB
meet the pages its reads go through, where a crash costs only the child; it cannot meet the
free-page DB (LMDB's list of reusable pages, which no API walks), nor what only writes rely
on. Garbage over the free-page DB killed the first write with SIGBUS, at every restart; a
free-page entry naming a page a tree still used let a write overwrite that page, and a reopen
lost the records put since. So before LMDB maps the file, every tree reachable from the meta
page LMDB would pick (the free-page DB, the main DB, each sub-database it names) is held here
to the invariants of LMDB 0.9 (``mdb.c``; 64-bit, no DUPSORT)::

    page       its header names its own number; a branch above the tree's depth, a leaf at
               it; 16 <= lower <= upper <= page size; a branch of 2 entries at least (1 in the
               free-page DB, where LMDB does not assert it), a leaf of 1
    node       at an even offset in [upper, page size), whole inside the page (a delete moves
               the bytes below it by its size), overlapping no other node; a key of at most
               511 bytes
    value      main DB: F_SUBDATA with a 48-byte MDB_db; others: plain, or F_BIGDATA whose
               overflow run starts with a P_OVERFLOW header of its own number, is as long as
               the value needs and ends inside the file (a delete frees that many pages)
    free list  8-byte txnid keys ascending, none past the meta page's; each record's count
               inside the value; the pages it names inside the file, each used nowhere else
    pages      every page is reached once; each tree's depth and counts are what is found

Key order inside the sub-databases is left to the child's walk, which looks every key up.

How: level by level, pages in batches, each batch one array (numpy over a read-only map of
the pages in use, which :func:`storage.envcheck.data_file_problem` has checked the file holds;
only a file cut short while this runs could still fault). Work grows with the tree pages and
the number of overflow values, not with the values' bytes.

What this cannot see: damage to the values (the tier's records carry checksums), a page not
reached from the meta page (LMDB never reads it), and damage done after it ran.
"""

from __future__ import annotations

import itertools
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .envcheck import P_INVALID, DbRecord, LmdbMeta, chosen_meta, read_metas

__all__ = ["PageDamage", "tree_problem"]

P_BRANCH, P_LEAF, P_OVERFLOW = 0x01, 0x02, 0x04
F_BIGDATA, F_SUBDATA = 0x01, 0x02
MDB_INTEGERKEY = 0x08
PAGEHDRSZ = 16
NODESIZE = 8
MAX_KEY = 511
MAX_DEPTH = 32  # CURSOR_STACK
BATCH = 4096  # pages per array: 16 MiB of 4 KiB pages
_MDB_DB = struct.Struct("<IHH5Q")  # pad, flags, depth, branch, leaf, overflow, entries, root
Array = np.ndarray[Any, Any]


class PageDamage(Exception):
    """What is wrong with the file (the message, for a REASON file)."""


@dataclass(frozen=True, slots=True)
class _Tree:
    name: str
    record: DbRecord
    main: bool = False  # values: the MDB_db records of sub-databases
    free: bool = False  # keys: txnids; values: lists of free pages


@dataclass(slots=True)
class _Nodes:
    """A batch of pages' nodes, flat, in entry order: page row, offset, the node's fields."""

    row: Array
    at: Array
    lo_hi: Array  # data size (leaf) or the child page's low 32 bits (branch)
    flags: Array  # node flags (leaf) or the child page's bits 32..47 (branch)
    ksize: Array


@dataclass(slots=True)
class _Found:
    branch: int = 0
    leaf: int = 0
    overflow: int = 0
    entries: int = 0
    values: list[tuple[bytes, bytes]] = field(default_factory=list)  # main and free only


def tree_problem(data: Path) -> str | None:
    """What in ``data``'s reachable pages LMDB would trip on, or None (also when the file is
    absent). Call it once :func:`storage.envcheck.data_file_problem` has found nothing."""
    if not data.exists():
        return None
    meta = chosen_meta(read_metas(data)[1])
    pages = np.memmap(data, dtype=np.uint8, mode="r", shape=(meta.last_pg + 1, meta.psize))
    try:
        _Check(pages, meta).run()
    except PageDamage as exc:
        return f"data.mdb, txn {meta.txnid}: {exc}"
    except (IndexError, ValueError) as exc:  # garbage this check did not foresee: never a
        return f"data.mdb, txn {meta.txnid}: unreadable pages ({exc!r})"  # crash-loop
    finally:
        del pages
    return None


class _Check:
    def __init__(self, pages: Array, meta: LmdbMeta) -> None:
        self.pages, self.meta = pages, meta
        self.psize, self.last = meta.psize, meta.last_pg
        self.singles: list[Array] = [np.array([0, 1], dtype=np.int64)]  # meta pages
        self.runs: list[tuple[Array, Array]] = []  # overflow runs: first pages, lengths

    def run(self) -> None:
        free_db, main_db = self.meta.dbs
        if (free_db.flags, main_db.flags) != (MDB_INTEGERKEY, 0):
            raise PageDamage(f"the free-page and main DBs have flags {free_db.flags:#x}, "
                             f"{main_db.flags:#x}")
        free = self.walk(_Tree("free-page DB", free_db, free=True))
        main = self.walk(_Tree("main DB", main_db, main=True))
        names = [name for name, _ in main.values]
        if names != sorted(set(names)):
            raise PageDamage("the main DB's names are out of order")
        for name, raw in main.values:
            record = DbRecord(*_MDB_DB.unpack(raw)[1:])
            if record.flags != 0:
                raise PageDamage(f"sub-database {name[:32]!r} has flags {record.flags:#x}")
            self.walk(_Tree(f"sub-database {name[:32]!r}", record))
        self.free_lists(free.values)
        self.each_page_once()

    # -- trees ------------------------------------------------------------------------------

    def walk(self, tree: _Tree) -> _Found:
        found, record = _Found(), tree.record
        if record.root == P_INVALID:
            if (record.depth, record.entries) != (0, 0):
                raise PageDamage(f"the {tree.name} is empty but says depth {record.depth}, "
                                 f"{record.entries} entries")
            return found
        if not 1 <= record.depth <= MAX_DEPTH:
            raise PageDamage(f"the {tree.name} says depth {record.depth}")
        level = np.array([record.root], dtype=np.int64)
        for depth in range(1, record.depth + 1):
            self.tree_pages(level, tree)
            leaf = depth == record.depth
            children = []
            for start in range(0, len(level), BATCH):
                batch = level[start : start + BATCH]
                nodes = self.nodes(batch, leaf, tree)
                if leaf:
                    self.leaves(batch, nodes, tree, found)
                else:
                    children.append(nodes.lo_hi | nodes.flags << 32)
            if leaf:
                found.leaf += len(level)
            else:
                found.branch += len(level)
                level = np.concatenate(children)  # in key order: entries in order, per page
        counts = (found.branch, found.leaf, found.overflow, found.entries)
        said = (record.branch_pages, record.leaf_pages, record.overflow_pages, record.entries)
        if counts != said:
            raise PageDamage(f"the {tree.name} says {said} branch, leaf, overflow pages and "
                             f"entries; it has {counts}")
        return found

    def tree_pages(self, level: Array, tree: _Tree) -> None:
        """Claim one level's pages: inside the file, none twice (a cycle, or a page shared by
        two branches, would otherwise multiply the next level)."""
        if level.min() < 2 or level.max() > self.last:
            raise PageDamage(f"the {tree.name} names a page outside 2..{self.last}")
        if len(np.unique(level)) != len(level):
            raise PageDamage(f"the {tree.name} names a page twice")
        self.singles.append(level)

    def nodes(self, batch: Array, leaf: bool, tree: _Tree) -> _Nodes:
        """Check the pages of ``batch`` and their nodes; returns the nodes."""
        page = np.ascontiguousarray(self.pages[batch])
        words = page.view("<u2")
        own = page[:, :8].view("<u8")[:, 0]
        flags, lower, upper = words[:, 5], words[:, 6].astype(np.int64), words[:, 7]
        least = 1 if leaf or tree.free else 2
        bad = ((own != batch) | (flags != (P_LEAF if leaf else P_BRANCH)) | (lower % 2 == 1)
               | (lower < PAGEHDRSZ + 2 * least) | (lower > upper) | (upper > self.psize))
        _fail(bad, batch, f"of the {tree.name} is not a {'leaf' if leaf else 'branch'} page "
              "of its own number and sound bounds")
        count = (lower - PAGEHDRSZ) // 2
        row, index = np.nonzero(np.arange(count.max()) < count[:, None])
        at = words[row, 8 + index].astype(np.int64)
        _fail((at % 2 == 1) | (at < upper[row]) | (at > self.psize - NODESIZE), batch[row],
              f"of the {tree.name} has a node outside its free space")
        half = at // 2
        lo_hi = words[row, half].astype(np.int64) | words[row, half + 1].astype(np.int64) << 16
        nflags, ksize = words[row, half + 2].astype(np.int64), words[row, half + 3]
        data = np.where(nflags & F_BIGDATA, 8, lo_hi) if leaf else 0
        end = at + NODESIZE + ksize + data
        _fail((ksize > MAX_KEY) | (end > self.psize), batch[row],
              f"of the {tree.name} has a node past its end")
        order = np.lexsort((at, row))
        same = row[order][1:] == row[order][:-1]
        _fail(same & (end[order][:-1] > at[order][1:]), batch[row[order][1:]],
              f"of the {tree.name} has overlapping nodes")
        return _Nodes(row, at, lo_hi, nflags, ksize)

    def leaves(self, batch: Array, nodes: _Nodes, tree: _Tree, found: _Found) -> None:
        found.entries += len(nodes.row)
        if tree.main:
            _fail((nodes.flags != F_SUBDATA) | (nodes.lo_hi != _MDB_DB.size), batch[nodes.row],
                  "of the main DB has an entry that is no sub-database")
        else:
            _fail(nodes.flags & ~F_BIGDATA != 0, batch[nodes.row],
                  f"of the {tree.name} has an entry of unknown flags")
        big = nodes.flags & F_BIGDATA != 0
        if big.any():
            found.overflow += self.overflow(batch, nodes, big, tree)
        if tree.main or tree.free:
            found.values += [self.value(batch, nodes, i) for i in range(len(nodes.row))]

    def overflow(self, batch: Array, nodes: _Nodes, big: Array, tree: _Tree) -> int:
        """Check the overflow runs of the F_BIGDATA values among ``nodes``; their pages."""
        row, at, ksize = nodes.row[big], nodes.at[big], nodes.ksize[big]
        size = nodes.lo_hi[big]
        page = np.ascontiguousarray(self.pages[batch[row][:, None],
                                               (at + NODESIZE + ksize)[:, None] + np.arange(8)])
        first = page.view("<u8")[:, 0].astype(np.int64)
        _fail((first < 2) | (first > self.last), batch[row],
              f"of the {tree.name} has a value on a page outside 2..{self.last}")
        head = np.ascontiguousarray(self.pages[first[:, None], np.arange(PAGEHDRSZ)])
        own, flags = head[:, :8].view("<u8")[:, 0], head[:, 10:12].view("<u2")[:, 0]
        length = head[:, 12:16].view("<u4")[:, 0].astype(np.int64)
        need = (PAGEHDRSZ - 1 + size) // self.psize + 1  # OVPAGES
        _fail((own != first) | (flags != P_OVERFLOW) | (length < need)
              | (first + length - 1 > self.last), batch[row],
              f"of the {tree.name} has a value whose overflow run is not one")
        self.runs.append((first, length))
        return int(length.sum())

    def value(self, batch: Array, nodes: _Nodes, i: int) -> tuple[bytes, bytes]:
        """(key, value) of node ``i``: the main DB's and the free-page DB's, small."""
        pgno, at, ksize = int(batch[nodes.row[i]]), int(nodes.at[i]), int(nodes.ksize[i])
        size = int(nodes.lo_hi[i])
        start = at + NODESIZE + ksize
        page = self.pages[pgno]
        key = bytes(page[at + NODESIZE : start])
        if not nodes.flags[i] & F_BIGDATA:
            return key, bytes(page[start : start + size])
        first = int(page[start : start + 8].view("<u8")[0])
        flat = self.pages.reshape(-1)
        return key, bytes(flat[first * self.psize + PAGEHDRSZ :][:size])

    # -- the free list and the whole file ---------------------------------------------------

    def free_lists(self, records: list[tuple[bytes, bytes]]) -> None:
        txnids = [int.from_bytes(key, "little") if len(key) == 8 else -1 for key, _ in records]
        if any(a >= b for a, b in itertools.pairwise(txnids)) or \
                any(not 0 <= t <= self.meta.txnid for t in txnids):
            raise PageDamage(f"the free-page DB's txnids are not ascending up to "
                             f"{self.meta.txnid}")
        for txnid, (_, idl) in zip(txnids, records, strict=True):
            count = int.from_bytes(idl[:8], "little") if len(idl) >= 8 else -1
            if not 0 <= count <= len(idl) // 8 - 1:
                raise PageDamage(f"the free-page list of txn {txnid} ({len(idl)} bytes) says "
                                 f"it holds {count} pages")
            listed = np.frombuffer(idl, dtype="<u8", count=count, offset=8).astype(np.int64)
            if count and (listed.min() < 2 or listed.max() > self.last):
                raise PageDamage(f"the free-page list of txn {txnid} names a page outside "
                                 f"2..{self.last}")
            self.singles.append(listed)

    def each_page_once(self) -> None:
        """No page is two things: a tree page, part of an overflow run, free (twice)."""
        uses = np.bincount(np.concatenate(self.singles), minlength=self.last + 2)
        edges = np.zeros(self.last + 2, dtype=np.int64)
        for first, length in self.runs:
            np.add.at(edges, first, 1)
            np.add.at(edges, first + length, -1)
        uses = uses + np.cumsum(edges)
        twice = np.flatnonzero(uses > 1)
        if len(twice):
            raise PageDamage(f"page {int(twice[0])} is used twice (by trees, overflow runs or "
                             f"the free-page list), {len(twice)} such pages")


def _fail(bad: Array, pgnos: Array, what: str) -> None:
    if np.any(bad):
        where = np.flatnonzero(bad)
        raise PageDamage(f"page {int(pgnos[where[0]])} {what} ({len(where)} such)")
