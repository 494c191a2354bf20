"""Handle packing: the records a lookup's match names, as packed ``HANDLE_DTYPE`` columns.

The funnel accepted a path of entries; a reader resuming at ``usable`` needs, per column, the
records at the depths that column lives at (``Layout.needed_depths``), in token order. They
are packed two ways, giving the same bytes (a test holds them to it):

* the fast path (:meth:`Packer.packed_columns`): COMPRESSED and INDEXER handles from rows
  cached on the entries (``PrefixEntry.row``, one per entry, built on first use), from a
  full run's packed pieces (``PrefixEntry.run`` at the run's last entry, packed from its
  rows the second time a lookup takes the run: a run of 64 blocks is then three bytes, not
  64 rows to list, join and slice) and from a certified walk segment's pieces: one
  ``bytes.join`` and one strided numpy slice per column, no Python work per handle. An
  entry holding a disk copy is a placeholder row, patched with the copy its verdict serves
  (``contracts.served``, ``swa_cover``)::

      rows:   [ e0: c4 | idx ][ e1: c4 | idx ] ...   22-byte records per monotone column
      grid:   rows.reshape(n, mono columns)[needed depths, slot]  -> one column's records

* the general path (:meth:`Packer.resolve` then :meth:`Packer.snapshot`): the served record of
  each needed depth, one by one; taken where a path holds more than ``DISKY_PATCHED``
  disky entries.

SWA and TAIL columns need a few records each, packed from the records either way. The
shard-name table packed handles index is the tables' (``Tables.ordinal``).
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence

import numpy as np

from . import contracts
from .api import LookupRequest
from .funnel import FunnelResult
from .records import HANDLE_DTYPE, HandleColumn, ObjRecord, PackedRun, PrefixEntry, mem_at, register
from .segments import Segment, segment_blocks_for
from .states import Kind
from .tables import Tables, handle_shard

__all__ = ["DISKY_PATCHED", "Packer"]

# A lookup whose path holds more disk copies than this packs every column record by record
# (the general path); below it, packed rows and a patch per disky entry.
DISKY_PATCHED = 256
_BLOCK = operator.attrgetter("block")
_HANDLE_BYTES = np.dtype(f"V{HANDLE_DTYPE.itemsize}")
_HANDLE_STRUCT = struct.Struct("<QQiH")  # HANDLE_DTYPE, one record
_FEW = 32
_MEM = operator.attrgetter("mem")
_SHARD = operator.attrgetter("shard")
_OBJECT_ID = operator.attrgetter("object_id")
_GENERATION = operator.attrgetter("generation")


class Packer:
    """Packs the handle columns of one state view's matches; called under its lock."""

    def __init__(self, tables: Tables) -> None:
        self.t = tables
        self.layout = layout = tables.layout
        self.segment_blocks = segment_blocks_for(layout, tables.config.segment_blocks)
        # the packed runs' size (PrefixEntry.run), whether walk segments are on or not:
        # the segments' default, a multiple of the layout's period (runs start where it
        # repeats, so a run's pieces are the same for every lookup that takes it whole)
        self.run_blocks = segment_blocks_for(layout, None)
        self._mono_slot = {c: j for j, c in enumerate(layout.mono_columns)}
        self._row_struct = struct.Struct("<" + "QQiH" * len(layout.mono_columns))
        self._placeholder_row = bytes(self._row_struct.size)
        self._ordinal = tables.ordinal  # (bound once: called per record a row packs)

    def columns(
        self, req: LookupRequest, result: FunnelResult,
        records: dict[str, tuple[ObjRecord, ...]] | None,
    ) -> dict[str, HandleColumn] | None:
        """The match's packed handles (None: a match-only lookup). Only at entries holding a
        disk copy do per-record verdicts decide which copy serves each column; every other
        entry takes the packed fast path, whatever other entries hold."""
        if not req.handles:
            return None
        entries, usable, first = result.entries, result.usable_tokens, result.first_block
        disky = self.disky(entries, usable, first)
        if len(disky) <= DISKY_PATCHED:  # the same copies resolve gives, packed faster
            return self.packed_columns(entries, usable, result.runs, disky, req.alignment,
                                       first)
        if records is None:
            records = self.resolve(entries, usable, req.alignment, first)
        return {name: self.snapshot(recs) for name, recs in records.items()}

    def disky(self, entries: Sequence[PrefixEntry], usable: int, first: int = 0
              ) -> list[PrefixEntry]:
        """The entries in ``[0, usable)`` that hold a disk copy (``entry.disk`` is None
        wherever none is); ``entries[0]`` is at depth ``first``."""
        if not self.t.disk_records:
            return []
        return [e for e in entries[: usable // self.layout.hash_block - first]
                if e.disk is not None]

    def resolve(
        self, entries: Sequence[PrefixEntry], usable: int, align: int, first: int = 0
    ) -> dict[str, tuple[ObjRecord, ...]]:
        """The records a reader resuming at ``usable`` needs, per column, in token order: the
        copies the funnel accepted (``contracts.served``; SWA: the one covering the window,
        aligned to ``align``).

        Fast path: an entry the funnel accepted that holds no disk copy has a READY memory
        record in each needed column, so no verdict is recomputed there; only entries with a
        disk copy get one."""
        if usable == 0 or not entries:
            return {}
        disky = self.disky(entries, usable, first)
        out: dict[str, tuple[ObjRecord, ...]] = {}
        for column in self.layout.columns:
            c = column.index
            recs = self._column_records(entries, c, disky, usable, align, first)
            if recs:
                out[column.name] = recs
        return out

    def snapshot(self, recs: tuple[ObjRecord, ...]) -> HandleColumn:
        """Packed handles of ``recs`` (one column), taken under the lock: the general path,
        one attribute read per field per record (``map``: C speed)."""
        t = self.t
        column = self.layout.columns[recs[0].column]
        shards = map(handle_shard, recs) if t.disk_records else map(_SHARD, recs)
        ordinals = tuple(map(self._ordinal, shards))
        ids, gens, blocks = map(_OBJECT_ID, recs), map(_GENERATION, recs), map(_BLOCK, recs)
        if len(recs) <= _FEW:  # an SWA window, a tail: struct beats numpy's fixed cost
            packed = b"".join(map(_HANDLE_STRUCT.pack, ids, gens, blocks, ordinals))
            return HandleColumn(
                column.index, column.name, column.kind, column.nbytes, column.abi_fingerprint,
                packed, t.shard_names, t.strides(column.index),
            )
        return HandleColumn.pack(
            column.index, column.name, column.kind, column.nbytes, column.abi_fingerprint,
            tuple(ids), tuple(gens), ordinals, tuple(blocks), t.shard_names,
            t.strides(column.index),
        )

    def packed_columns(
        self, entries: Sequence[PrefixEntry], usable: int,
        runs: Sequence[Segment | None] = (), disky: Sequence[PrefixEntry] = (),
        align: int = 1, first: int = 0,
    ) -> dict[str, HandleColumn]:
        """The lookup fast path (no disk copy anywhere): the funnel accepted ``entries``, so
        each holds a READY memory record in every column living there. COMPRESSED and
        INDEXER handles come from the entries' cached rows (one ``join`` and a strided numpy
        slice per column, no Python work per handle), and a certified run's from its walk
        segment, packed once; SWA and TAIL need a few records each. The ``disky`` entries
        (holding a disk copy) are packed as placeholders, then patched with the copy each
        column's verdict serves there."""
        if usable == 0 or not entries:
            return {}
        t, lay = self.t, self.layout
        end = first + len(entries)  # (entries[0] at depth first: a range of a split chain)
        pieces = self._mono_pieces(entries, usable, runs, first)
        out: dict[str, HandleColumn] = {}
        for column in lay.columns:
            c = column.index
            slot = self._mono_slot.get(c)
            if slot is not None:
                records = b"".join(map(operator.itemgetter(slot), pieces))
                if disky:
                    records = self._patched(records, disky, c,
                                            lay.needed_depths(c, usable, first, end),
                                            usable, align)
                if records:
                    out[column.name] = HandleColumn(
                        c, column.name, column.kind, column.nbytes, column.abi_fingerprint,
                        records, t.shard_names, t.strides(c),
                    )
                continue
            recs = self._column_records(entries, c, disky, usable, align, first)
            if recs:
                out[column.name] = self.snapshot(recs)
        return out

    def _column_records(self, entries: Sequence[PrefixEntry], c: int,
                        disky: Sequence[PrefixEntry], usable: int, align: int, first: int = 0
                        ) -> tuple[ObjRecord, ...]:
        """Column ``c``'s records at the depths a reader resuming at ``usable`` needs: the
        memory record of each entry the funnel accepted, and at a disky entry the copy its
        verdict serves. ``entries[0]`` is at depth ``first``."""
        depths = self.layout.needed_depths(c, usable, first, first + len(entries))
        at = entries[depths.start - first : depths.stop - first : depths.step]  # a range
        found: list[ObjRecord | None] = list(map(operator.itemgetter(c), map(_MEM, at)))
        for e in disky:
            if e.depth in depths:
                found[(e.depth - depths.start) // depths.step] = self.readable_record(
                    e, c, usable, align)
        return tuple(r for r in found if r is not None)

    def _patched(self, records: bytes, disky: Sequence[PrefixEntry], c: int, depths: range,
                 usable: int, align: int) -> bytes:
        """``records`` (column ``c``'s packed handles at ``depths``) with the copy that
        serves each disky entry's depth written over its placeholder."""
        out = bytearray(records)
        size = _HANDLE_STRUCT.size
        for e in disky:
            if e.depth not in depths:
                continue
            rec = self.readable_record(e, c, usable, align)
            assert rec is not None, "the funnel accepted an entry no copy of a column serves"
            j = (e.depth - depths.start) // depths.step * size
            _HANDLE_STRUCT.pack_into(out, j, rec.object_id, rec.generation, rec.block,
                                     self._ordinal(handle_shard(rec)))
        return bytes(out)

    def _mono_pieces(self, entries: Sequence[PrefixEntry], usable: int,
                     runs: Sequence[Segment | None], first: int = 0
                     ) -> list[tuple[bytes, ...]]:
        """The monotone columns' packed records for ``[0, usable)`` in pieces, in depth order,
        each piece one bytes per column: a certified run's as its segment keeps them, the
        blocks between packed from rows. ``entries[0]`` is at depth ``first`` (runs: only
        from depth 0)."""
        size = self.segment_blocks
        n = min(usable // self.layout.hash_block, first + len(entries))
        pieces: list[tuple[bytes, ...]] = []
        done = first
        for j in range(min(len(runs), n // size) if size else 0):
            seg = runs[j]
            if seg is not None:
                if done < j * size:
                    pieces.append(self._grid_piece(entries, usable, done, j * size))
                pieces.append(seg.cols or self._segment_cols(seg))
                done = (j + 1) * size
        if done < n:
            self._run_pieces(entries, usable, done, n, first, pieces)
        return pieces

    def _run_pieces(self, entries: Sequence[PrefixEntry], usable: int, lo: int, hi: int,
                    first: int, out: list[tuple[bytes, ...]]) -> None:
        """Append the monotone columns' records at depths ``[lo, hi)`` to ``out``: each full
        run inside as its packed pieces (packed now from its rows if a lookup took it
        before: its last entry has a row), the rest from rows in as few pieces as runs
        allow. ``entries[0]`` is at depth ``first``."""
        size = self.run_blocks
        start = lo  # the first depth not yet appended
        for r in range(-(-lo // size) * size, hi - size + 1, size):
            end = entries[r + size - 1 - first]
            cols = end.run.cols if end.run is not None else None  # (None: dropped)
            if cols is None:
                if end.row is None:  # not taken since it changed: rows first
                    continue
                cols = self._pack_run(entries[r - first : r + size - first], r)
            if start < r:
                out.append(self._grid_piece(entries, usable, start, r, first))
            out.append(cols)
            start = r + size
        if start < hi:
            out.append(self._grid_piece(entries, usable, start, hi, first))

    def _pack_run(self, run: Sequence[PrefixEntry], lo: int) -> tuple[bytes, ...]:
        """Pack the full run ``run`` (depths ``[lo, lo + size)``) from its rows, keep it at its
        last entry, and let its entries' rows go (the run holds their bytes now; a change
        drops the run, and the next lookups build rows, then the run, again)."""
        size = len(run)
        cols = self._grid_piece(run, (lo + size) * self.layout.hash_block, lo, lo + size, lo)
        packed = PackedRun(cols)
        register(packed, run)
        run[-1].run = packed
        for e in run:
            e.row = None
        return cols

    def _grid_piece(self, entries: Sequence[PrefixEntry], usable: int, lo: int, hi: int,
                    first: int = 0) -> tuple[bytes, ...]:
        """Each monotone column's records at depths ``[lo, hi)`` (``entries[0]`` at depth
        ``first``)."""
        lay = self.layout
        # a comprehension: 3.11's specialised slot load beats operator.attrgetter here
        if lo > first or hi - first < len(entries):
            entries = entries[lo - first:hi - first]
        joined = b"".join([e.row or self._build_row(e) for e in entries])
        # opaque 22-byte records: a strided copy of those is a memcpy per record, ~4x faster
        # than copying HANDLE_DTYPE's fields one by one
        grid = np.frombuffer(joined, _HANDLE_BYTES).reshape(hi - lo, len(lay.mono_columns))
        out = []
        for slot, c in enumerate(lay.mono_columns):
            depths = lay.needed_depths(c, usable, lo, hi)
            out.append(grid[depths.start - lo : depths.stop - lo : depths.step, slot].tobytes())
        return tuple(out)

    def _segment_cols(self, seg: Segment) -> tuple[bytes, ...]:
        """A certified run's records per monotone column, packed on first use. The same for
        every usable length past the run, wherever it starts: runs start at multiples of the
        layout's period, so the run seen as depths ``[0, size)`` selects the same rows."""
        size = len(seg.entries)
        seg.cols = cols = self._grid_piece(seg.entries, size * self.layout.hash_block, 0, size)
        return cols

    def _build_row(self, e: PrefixEntry) -> bytes:
        if e.disk is not None:  # a placeholder: _patched writes the copy served there
            return self._placeholder_row
        values: list[int] = []
        for c in self.layout.mono_columns:
            rec = mem_at(e, c)
            if not self.layout.lives_at(c, e.depth):
                values += (0, 0, 0, 0)  # never sliced: needed depths are where c lives
            else:
                assert rec is not None, "the funnel accepted an entry missing a monotone record"
                values += (rec.object_id, rec.generation, rec.block, self._ordinal(rec.shard))
        e.row = row = self._row_struct.pack(*values)
        return row

    def readable_record(self, e: PrefixEntry, col: int, usable: int, align: int
                        ) -> ObjRecord | None:
        """The record a reader resuming at ``usable`` reads for ``col`` at ``e``: the copy
        that serves it (``contracts.served``: a KV and its indexers at one version); for SWA,
        the one whose range covers what the window needs, aligned (the funnel accepted the
        block with that one)."""
        column = self.layout.columns[col]
        if column.kind is Kind.SWA:
            start, end = self.layout.block_range(col, e.depth)
            need_lo = max(start, usable - column.group.window)
            return contracts.swa_cover(e, col, need_lo, end, self.layout, align,
                                       self.t.align_of)
        return contracts.served(e, col, self.layout)[0]
