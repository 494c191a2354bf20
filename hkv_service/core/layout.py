"""Columns of a prefix entry, derived once from a :class:`CacheSpec`.

Every spec group is a column; every COMPRESSED group with an ``overlap`` also gets a TAIL
column (without one, its tail holds no token at any resume point: see
:attr:`GroupSpec.tail_tokens_max`). A group's
block ``k`` covers tokens ``[k*bs, (k+1)*bs)`` and lives at the entry whose hash block ends at
token ``(k+1)*bs``, i.e. at ``depth = (k+1)*bs/H - 1``. Tails live at resume points: entries
whose end is a multiple of the LCM block size ``L``::

    depth:        0     1     2     3        (H = 64, L = 128)
    tokens:     [0,64)[64,128)[128,192)[192,256)
    c4  (bs 64)   x     x     x     x
    c128(bs128)         x           x
    c4.tail             x           x        <- resume points p = 128, 256 (c128: no tail)

A RECURRENT group's column (Kind.STATE) lives at resume points too: its object there is the
group's state as of exactly that boundary. Tails and states are the objects a reader needs
*at* the resume point and nowhere else (:data:`AT_BOUNDARY`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .ids import GroupName, grow_by
from .spec import CacheSpec, GroupKind, GroupSpec
from .states import Kind

__all__ = ["AT_BOUNDARY", "Column", "Layout"]

_KIND_OF_GROUP = {
    GroupKind.COMPRESSED: Kind.COMPRESSED,
    GroupKind.SWA: Kind.SWA,
    GroupKind.INDEXER: Kind.INDEXER,
    GroupKind.RECURRENT: Kind.STATE,
}
# Objects needed exactly at the resume point (a tail's raw tokens, a recurrent state as of it)
# and nowhere else: they live at resume points only and are checked there.
AT_BOUNDARY = frozenset({Kind.TAIL, Kind.STATE})


@dataclass(frozen=True, slots=True)
class Column:
    index: int
    kind: Kind
    group: GroupSpec
    nbytes: int  # bytes of one block of this column
    name: GroupName  # the group's name, or "<group>.tail"
    abi_fingerprint: int  # computed once: handles carry it on every lookup
    indexes: int | None = None  # INDEXER: column of the KV it indexes

    def tail_tokens_at(self, position: int) -> int:
        """Raw tokens a TAIL must hold to resume at ``position`` (carried overlap included)."""
        g = self.group
        return position % g.ratio + min(g.overlap, position - position % g.ratio)


def _column(index: int, kind: Kind, group: GroupSpec, nbytes: int) -> Column:
    name = GroupName(f"{group.name}.tail") if kind is Kind.TAIL else group.name
    return Column(index, kind, group, nbytes, name, group.abi.fingerprint())


class Layout:
    def __init__(self, spec: CacheSpec) -> None:
        self.spec = spec
        self.hash_block = spec.hash_block_size
        self.lcm = spec.lcm_block_size
        self.step = self.lcm // self.hash_block  # entries per LCM block
        # k * hash_block, one object each: block bounds records keep (block_range)
        self._positions = [k * self.hash_block for k in range(1024)]
        cols = [
            _column(i, _KIND_OF_GROUP[g.kind], g, g.bytes_per_block)
            for i, g in enumerate(spec.groups)
        ]
        for g in spec.groups:
            if g.kind is GroupKind.COMPRESSED and g.tail_tokens_max:
                # a tail with nothing in it (no overlap: e.g. c128) is no object: never
                # allocated, written, required or a reason for a downgrade
                cols.append(_column(len(cols), Kind.TAIL, g, g.tail_bytes))
        by_name: dict[str, int] = {c.name: c.index for c in cols}
        self.columns: tuple[Column, ...] = tuple(
            dataclasses.replace(c, indexes=by_name[c.group.indexes])
            if c.group.indexes is not None and c.kind is Kind.INDEXER
            else c
            for c in cols
        )
        self.by_name = by_name
        self.swa_columns = tuple(c.index for c in self.columns if c.kind is Kind.SWA)
        # COMPRESSED and INDEXER: needed at every block they live at in [0, p), so a lookup
        # packs them from per-entry rows (PrefixEntry.row), in this order
        self.mono_columns = tuple(
            c.index for c in self.columns if c.kind in (Kind.COMPRESSED, Kind.INDEXER)
        )
        # COMPRESSED column -> the INDEXER columns indexing it (served at its version)
        self.indexers_of: dict[int, tuple[int, ...]] = {
            c.index: tuple(x.index for x in self.columns if x.indexes == c.index)
            for c in self.columns
        }
        self.max_window = max(
            (c.group.window for c in self.columns if c.kind is Kind.SWA), default=0
        )
        # attached[depth % period] -> column indexes living at such an entry
        self.period = self.step
        self.attached: tuple[tuple[int, ...], ...] = tuple(
            tuple(c.index for c in self.columns if self._lives_at(c, d)) for d in range(self.period)
        )
        # the same, each with its kind: what a summary asks per column (contracts.summarise)
        self.kinds_attached: tuple[tuple[tuple[int, Kind], ...], ...] = tuple(
            tuple((c, self.columns[c].kind) for c in cols) for cols in self.attached
        )

    def _lives_at(self, col: Column, depth: int) -> bool:
        end = (depth + 1) * self.hash_block
        if col.kind in AT_BOUNDARY:
            return end % self.lcm == 0
        return end % col.group.block_size == 0

    def lives_at(self, column: int, depth: int) -> bool:
        return column in self.attached[depth % self.period]

    def needed_depths(self, column: int, usable: int, lo: int = 0, hi: int | None = None
                      ) -> range:
        """Depths of the entries whose ``column`` objects a reader resuming at ``usable`` (a
        multiple of L) needs, in token order: every block in ``[0, usable)``; an SWA block only
        if it meets ``[usable - W, usable)``; a TAIL or a STATE only at ``usable`` itself.
        Only depths in ``[lo, hi)`` (a range of a chain split across partitions: the ones it
        holds)."""
        col = self.columns[column]
        n = usable // self.hash_block
        n_end = n if hi is None else min(n, hi)
        if col.kind in AT_BOUNDARY:
            return range(n - 1, n) if n and lo <= n - 1 < n_end else range(0)
        every = col.group.block_size // self.hash_block
        first = every - 1
        if col.kind is Kind.SWA:
            lo = max(lo, max(0, usable - col.group.window) // self.hash_block)  # meeting [p-W, p)
        first += max(0, -(-(lo - first) // every)) * every
        return range(first, n_end, every)

    def tail_tokens(self, column: int, depth: int) -> int:
        """Raw tokens the TAIL ``column`` at ``depth`` holds when complete (its boundary's)."""
        return self.columns[column].tail_tokens_at((depth + 1) * self.hash_block)

    def object_bytes(self, column: int, depth: int, lo: int | None = None,
                     hi: int | None = None, tail_len: int | None = None) -> int:
        """Exactly the bytes an object of ``column`` at ``depth`` holds: a COMPRESSED or
        INDEXER block whole; an SWA block's valid tokens ``[lo, hi)`` (default: the whole
        block); a TAIL's ``tail_len`` raw tokens (default: what its boundary needs). A write
        of any other size is refused and a read returns exactly this many bytes."""
        col = self.columns[column]
        if col.kind is Kind.SWA:
            start, end = self.block_range(column, depth)
            lo, hi = start if lo is None else lo, end if hi is None else hi
            return max(0, hi - lo) * col.group.element_bytes
        if col.kind is Kind.TAIL:
            n = self.tail_tokens(column, depth) if tail_len is None else tail_len
            return n * col.group.element_bytes
        return col.nbytes

    def block_range(self, column: int, depth: int) -> tuple[int, int]:
        """Token range [start, end) covered by the block of ``column`` ending at ``depth``.
        (The bounds are shared int objects where they are multiples of the hash block: an
        SWA record keeps them as its valid range, one per block of every prompt.)"""
        hb, end = self.hash_block, self._at(depth + 1)
        col = self.columns[column]
        if col.kind in AT_BOUNDARY:
            return end, end
        size = col.group.block_size
        return (self._at(depth + 1 - size // hb) if size % hb == 0 else end - size), end

    def _at(self, k: int) -> int:
        """Token position ``k * hash_block``, a shared object for ``k`` in the table."""
        table = self._positions
        if 0 <= k < len(table):
            return table[k]
        if 0 <= k < 2 * len(table):  # grown by copy, as ids.shared_int's table is
            hb = self.hash_block
            table = self._positions = table + [
                j * hb for j in range(len(table), k + 1 + grow_by(len(table)))]
            return table[k]
        return k * self.hash_block
