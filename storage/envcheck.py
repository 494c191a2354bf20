"""Is an LMDB data file safe to map? Read its two meta pages with plain file reads and check
that the file holds every page they claim. Pure: no LMDB.

Why: LMDB maps ``data.mdb`` and trusts it. A file shorter than its last page in use (cut by
a full disk, a bad copy, a torn restore) maps fine and kills the process with SIGBUS on the
first read of a missing page; nothing at ``lmdb.open`` notices. So before mapping, the file
is checked against the meta page LMDB would pick.

Layout (LMDB 0.9, ``mdb.c``), verified against files written by the bundled py-lmdb. Pages 0
and 1 are meta pages; each starts with the 16-byte page header (``mp_pgno`` size_t, ``mp_pad``
u16, ``mp_flags`` u16, 4 bytes of bounds), then ``MDB_meta``::

    mm_magic u32 = 0xBEEFC0DE    mm_version u32 = 1    mm_address ptr    mm_mapsize size_t
    mm_dbs[2] MDB_db: md_pad u32, md_flags u16, md_depth u16, then size_t each:
                      md_branch_pages, md_leaf_pages, md_overflow_pages, md_entries, md_root
    mm_last_pg size_t            mm_txnid size_t

``mm_dbs[0]`` is the free-page DB, whose ``md_pad`` holds the page size (``mm_psize``); meta
page 1 sits at that offset. LMDB refuses the file unless both meta pages are valid and uses
the one with the larger ``mm_txnid``; every page up to its ``mm_last_pg`` must be in the
file, and its two roots (``md_root``, ``P_INVALID`` for an empty DB) must be among them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DbRecord", "LmdbMeta", "chosen_meta", "data_file_problem", "read_metas"]

MAGIC = 0xBEEFC0DE
DATA_VERSION = 1
P_META = 0x08
_SIZE_T = "Q" if struct.calcsize("N") == 8 else "I"  # LMDB's size_t and pgno_t are native
_PAGE = struct.Struct(f"<{_SIZE_T}HH4x")
_DB = f"IHH{_SIZE_T * 5}"
_META = struct.Struct(f"<II{_SIZE_T}{_SIZE_T}{_DB}{_DB}{_SIZE_T}{_SIZE_T}")
P_INVALID = (1 << (8 * struct.calcsize(_SIZE_T))) - 1
MIN_PSIZE, MAX_PSIZE = 512, 1 << 16


@dataclass(frozen=True, slots=True)
class DbRecord:
    """An ``MDB_db``: a B-tree's flags, depth, page and entry counts and root page."""

    flags: int
    depth: int
    branch_pages: int
    leaf_pages: int
    overflow_pages: int
    entries: int
    root: int  # P_INVALID: the tree is empty


@dataclass(frozen=True, slots=True)
class LmdbMeta:
    """One meta page, the fields the checks need."""

    flags: int  # of its page header
    magic: int
    version: int
    psize: int
    dbs: tuple[DbRecord, DbRecord]  # free-page DB, main DB
    last_pg: int
    txnid: int

    @property
    def roots(self) -> tuple[int, int]:
        return self.dbs[0].root, self.dbs[1].root

    @property
    def needed_bytes(self) -> int:
        """Bytes the file must hold: every page up to ``last_pg``."""
        return (self.last_pg + 1) * self.psize


def _parse(raw: bytes, at: int) -> LmdbMeta | None:
    if len(raw) < at + _PAGE.size + _META.size:
        return None
    _, _, flags = _PAGE.unpack_from(raw, at)
    fields = _META.unpack_from(raw, at + _PAGE.size)
    magic, version, psize = fields[0], fields[1], fields[4]
    dbs = (DbRecord(*fields[5:12]), DbRecord(*fields[13:20]))  # less each md_pad
    return LmdbMeta(flags, magic, version, psize, dbs, fields[20], fields[21])


def read_metas(data: Path) -> tuple[int, list[LmdbMeta | None]]:
    """The file's size and its two meta pages as found (None: the file ends first)."""
    with data.open("rb") as f:
        head = f.read(_PAGE.size + _META.size)
        first = _parse(head, 0)
        second = None
        if first is not None and MIN_PSIZE <= first.psize <= MAX_PSIZE:
            f.seek(first.psize)
            second = _parse(f.read(_PAGE.size + _META.size), 0)
        size = f.seek(0, 2)
    return size, [first, second]


def _meta_problem(index: int, meta: LmdbMeta | None) -> str | None:
    if meta is None:
        return f"the file ends before meta page {index}"
    if not meta.flags & P_META or meta.magic != MAGIC:
        return f"page {index} is not an LMDB meta page (flags {meta.flags:#x}, magic " \
               f"{meta.magic:#x})"
    if meta.version != DATA_VERSION:
        return f"meta page {index} is of LMDB data version {meta.version}, not {DATA_VERSION}"
    psize = meta.psize
    if not MIN_PSIZE <= psize <= MAX_PSIZE or psize & (psize - 1):
        return f"meta page {index} claims a page size of {psize} bytes"
    if any(root != P_INVALID and not 2 <= root <= meta.last_pg for root in meta.roots):
        return f"meta page {index} has a root page past its last page {meta.last_pg}"
    return None


def chosen_meta(metas: list[LmdbMeta | None]) -> LmdbMeta:
    """The meta page LMDB uses: of the valid two, the one with the larger txnid."""
    return max((m for m in metas if m is not None), key=lambda m: m.txnid)


def data_file_problem(data: Path) -> str | None:
    """Why the LMDB data file ``data`` must not be mapped, or None when it may be (or is
    absent: LMDB creates it). Reads at most two small chunks of the file."""
    if not data.exists():
        return None
    size, metas = read_metas(data)
    if size == 0:
        return "data.mdb is empty (0 bytes): its meta pages are gone"
    for index, meta in enumerate(metas):
        problem = _meta_problem(index, meta)
        if problem is not None:
            return f"data.mdb ({size} bytes): {problem}"
    latest = chosen_meta(metas)
    if size < latest.needed_bytes:
        return (f"data.mdb is truncated: {size} bytes, but its meta page (txn {latest.txnid}) "
                f"uses pages 0..{latest.last_pg} of {latest.psize} bytes, "
                f"{latest.needed_bytes} bytes")
    return None
