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
_LAST_PG_AT, _TXNID_AT = _META_AT + 120, _META_AT + 128
_F_SUBDATA = 0x02


@dataclass(frozen=True)
class Meta:
    psize: int
    last_pg: int
    txnid: int
    main_root: int


def meta(data: bytes) -> Meta:
    """The meta page LMDB uses: of the two, the one with the larger txnid."""
    psize = struct.unpack_from("<I", data, _PSIZE_AT)[0]
    metas = []
    for off in (0, psize):
        last_pg, txnid = struct.unpack_from("<QQ", data, off + _LAST_PG_AT)
        root = struct.unpack_from("<Q", data, off + _MAIN_ROOT_AT)[0]
        metas.append(Meta(psize, last_pg, txnid, root))
    return max(metas, key=lambda m: m.txnid)


def db_root(data: bytes, name: bytes) -> int:
    """Root page of the named sub-database (the main database must fit one leaf page)."""
    m = meta(data)
    page = data[m.main_root * m.psize : (m.main_root + 1) * m.psize]
    marker = struct.pack("<HH", _F_SUBDATA, len(name)) + name
    at = page.find(marker)
    assert at >= 0, f"sub-database {name!r} is not in the main root page"
    return int(struct.unpack_from("<Q", page, at + len(marker) + 40)[0])


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
