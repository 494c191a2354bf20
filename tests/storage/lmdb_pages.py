"""Reading an LMDB data file's pages by hand, so a test can damage exactly what it means to.

Independent of ``storage`` on purpose (the tests must not locate pages with the code under
test). Layout of LMDB 0.9 on a 64-bit host: every page starts with a 16-byte header
(``pgno`` u64, pad u16, flags u16, lower u16, upper u16); pages 0 and 1 are meta pages whose
``MDB_meta`` follows the header (see ``storage/envcheck.py`` for the field list). Named
sub-databases are nodes of the main database: ``flags`` u16 = F_SUBDATA, ``ksize`` u16, the
name, then the 48-byte ``MDB_db`` whose last field is the root page number.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from pathlib import Path

P_BRANCH, P_LEAF = 0x01, 0x02
_PAGE = struct.Struct("<QHH")  # pgno, pad, flags
_META_AT = 16
_PSIZE_AT = _META_AT + 24  # mm_dbs[FREE].md_pad holds the page size
_MAIN_ROOT_AT = _META_AT + 72 + 40
_FREE_ROOT_AT = _META_AT + 24 + 40
_LAST_PG_AT, _TXNID_AT = _META_AT + 120, _META_AT + 128
_F_SUBDATA = 0x02


@dataclass(frozen=True)
class Meta:
    psize: int
    last_pg: int
    txnid: int
    main_root: int
    free_root: int  # the free-page DB's (2**64 - 1: empty)


def meta(data: bytes) -> Meta:
    """The meta page LMDB uses: of the two, the one with the larger txnid."""
    psize = struct.unpack_from("<I", data, _PSIZE_AT)[0]
    metas = []
    for off in (0, psize):
        last_pg, txnid = struct.unpack_from("<QQ", data, off + _LAST_PG_AT)
        root = struct.unpack_from("<Q", data, off + _MAIN_ROOT_AT)[0]
        free = struct.unpack_from("<Q", data, off + _FREE_ROOT_AT)[0]
        metas.append(Meta(psize, last_pg, txnid, root, free))
    return max(metas, key=lambda m: m.txnid)


def db_record_at(data: bytes, name: bytes) -> int:
    """File offset of the named sub-database's MDB_db (pad u32, flags u16, depth u16, then
    branch, leaf, overflow pages, entries, root: u64 each) in the main root page."""
    m = meta(data)
    page = data[m.main_root * m.psize : (m.main_root + 1) * m.psize]
    marker = struct.pack("<HH", _F_SUBDATA, len(name)) + name
    at = page.find(marker)
    assert at >= 0, f"sub-database {name!r} is not in the main root page"
    return m.main_root * m.psize + at + len(marker)


def db_root(data: bytes, name: bytes) -> int:
    """Root page of the named sub-database (the main database must fit one leaf page)."""
    return int(struct.unpack_from("<Q", data, db_record_at(data, name) + 40)[0])


def free_list_at(data: bytes) -> int:
    """File offset of the first page number listed by the first record of the free-page DB,
    whose root must be a leaf holding it inline (count u64, then the page numbers)."""
    m = meta(data)
    base = m.free_root * m.psize
    assert _PAGE.unpack_from(data, base)[2] == P_LEAF, "the free-page DB is not one leaf"
    node = base + struct.unpack_from("<H", data, base + 16)[0]
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, node)
    assert flags == 0 and (lo | hi << 16) >= 16, "its first record is not inline, or empty"
    return node + 8 + ksize + 8


def tree_pages(data: bytes) -> list[int]:
    """Branch and leaf pages up to the last page in use (stale copies included)."""
    m = meta(data)
    found = []
    for pgno in range(2, min(m.last_pg + 1, len(data) // m.psize)):
        own, _, flags = _PAGE.unpack_from(data, pgno * m.psize)
        if own == pgno and flags in (P_BRANCH, P_LEAF):
            found.append(pgno)
    return found


def garble_page(path: Path, pgno: int, seed: int, keep_header: bool) -> None:
    """Overwrite page ``pgno`` with seeded random bytes (its 16-byte header kept when asked,
    so LMDB still takes it for the same kind of page and follows its garbage)."""
    data = path.read_bytes()
    psize = meta(data).psize
    keep = 16 if keep_header else 0
    junk = random.Random(seed).randbytes(psize - keep)
    with path.open("r+b") as f:
        f.seek(pgno * psize + keep)
        f.write(junk)



def tree_pages_of(data: bytes, tree: bytes) -> list[int]:
    """Every branch and leaf page of sub-database ``tree``."""
    psize = meta(data).psize
    stack, pages = [db_root(data, tree)], []
    while stack:
        pgno = stack.pop()
        pages.append(pgno)
        if _PAGE.unpack_from(data, pgno * psize)[2] == P_BRANCH:
            stack += _children(data, pgno)
    return pages


def _children(data: bytes, pgno: int) -> list[int]:
    base = pgno * meta(data).psize
    lower = struct.unpack_from("<H", data, base + 12)[0]
    children = []
    for i in range((lower - 16) // 2):
        at = base + struct.unpack_from("<H", data, base + 16 + 2 * i)[0]
        lo, hi, top = struct.unpack_from("<HHH", data, at)
        children.append(lo | hi << 16 | top << 32)
    return children


def leaf_pages(data: bytes, root: int) -> list[int]:
    """The leaf pages of the tree under ``root``, following its branch pages' child page
    numbers (branch node: lo u16, hi u16, flags u16 = the page number's bits 32..47)."""
    psize = meta(data).psize
    stack, leaves = [root], []
    while stack:
        pgno = stack.pop()
        _, _, flags = _PAGE.unpack_from(data, pgno * psize)
        if flags != P_BRANCH:
            leaves.append(pgno)
            continue
        lower = struct.unpack_from("<H", data, pgno * psize + 12)[0]
        for i in range((lower - 16) // 2):
            at = pgno * psize + struct.unpack_from("<H", data, pgno * psize + 16 + 2 * i)[0]
            lo, hi, top = struct.unpack_from("<HHH", data, at)
            stack.append(lo | hi << 16 | top << 32)
    return leaves


def leaf_keys(data: bytes, tree: bytes) -> list[tuple[int, bytes]]:
    """(file offset, key) of every key in the leaf pages of sub-database ``tree``, read
    through each page's node offsets (a page's free space holds stale copies of nodes)."""
    psize = meta(data).psize
    keys = []
    for pgno in leaf_pages(data, db_root(data, tree)):
        base = pgno * psize
        lower = struct.unpack_from("<H", data, base + 12)[0]
        for i in range((lower - 16) // 2):
            node = base + struct.unpack_from("<H", data, base + 16 + 2 * i)[0]
            ksize = struct.unpack_from("<H", data, node + 6)[0]
            keys.append((node + 8, data[node + 8 : node + 8 + ksize]))
    return keys


def node_flags(data: bytes, pgno: int) -> list[int]:
    """The flags of each node of page ``pgno`` (a leaf's: 0x01 = its value is on overflow
    pages)."""
    base = pgno * meta(data).psize
    lower = struct.unpack_from("<H", data, base + 12)[0]
    return [struct.unpack_from("<H", data, base + struct.unpack_from(
        "<H", data, base + 16 + 2 * i)[0] + 4)[0] for i in range((lower - 16) // 2)]


def key_offset(data: bytes, tree: bytes, tail: bytes) -> int:
    """The file offset of the one key of sub-database ``tree`` that ends with ``tail`` (a
    record key; in lru, the key is a tick and then the record key)."""
    found = [at for at, key in leaf_keys(data, tree) if key.endswith(tail)]
    assert len(found) == 1, f"{len(found)} keys in {tree!r} end with {tail.hex()}"
    return found[0]


def repoint_child(path: Path, tree: bytes, index: int, target: int) -> None:
    """Make entry ``index`` of the root branch page of sub-database ``tree`` name page
    ``target`` (LMDB takes it for the child it descends to)."""
    data = path.read_bytes()
    psize = meta(data).psize
    root = db_root(data, tree)
    base = root * psize
    assert _PAGE.unpack_from(data, base)[2] == P_BRANCH, f"the root of {tree!r} is a leaf"
    node = base + struct.unpack_from("<H", data, base + 16 + 2 * index)[0]
    with path.open("r+b") as f:
        f.seek(node)
        f.write(struct.pack("<HHH", target & 0xFFFF, (target >> 16) & 0xFFFF, target >> 32))
