"""The hit path: a four-layer validation funnel that returns the longest safe prefix.

1. Whole-block alignment: usable length is a multiple of ``L`` (LCM of all block sizes).
2. Kernel ABI: a reader ABI that differs from a group's makes the group, hence the hit, unusable.
3. Intersection: every group must be ready *at the same position* p. Monotone columns
   (COMPRESSED, INDEXER) need all blocks in ``[0, p)``; TAILs are checked at p itself; SWA needs
   only blocks meeting ``[p-W, p)``. SWA readiness is not monotone in p, so candidates shrink
   from the longest until every group accepts one (a fixed point), never a union/minimum.
4. Byte alignment of every handle, on the copy served: the monotone columns' folded into each
   entry's ``gate``, a TAIL's and an SWA block's checked at the resume point that needs it.

::

    hashes:  [0,H) [H,2H) ... [(n-1)H, nH)     <- walk while entry.flags has F_MONO and align ok
    cands:        p = k*L  for k = floor(nH/L) .. 1      (layer 1)
    at p:    tail(p) complete?   SWA blocks meeting [p-W, p) valid?     (layer 3)

The walk is one integer test per block, the block's entry found through its parent's child
hint (one comparison) or else one dict lookup: per-block readiness of all groups is
pre-folded into ``PrefixEntry.flags`` by the state view. Runs of blocks it walked before are
taken whole, one dict lookup and one memcmp per run (core/segments.py). Failing a layer
downgrades with a :class:`Reason`; the funnel never raises for an unusable hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import segments
from .contracts import F_MONO, F_TAIL, LOAD, READY, column_verdict, served, swa_cover
from .errors import BadHash, InvalidInput, PositionBeyondHashes, UnknownGroup
from .ids import BlockHash, GroupName, PackedHashes, check_hash_lengths
from .layout import AT_BOUNDARY, Layout
from .prefix_index import PrefixIndex
from .records import ObjRecord, PrefixEntry
from .segments import Segment
from .states import Kind, Reason, State

__all__ = [
    "Downgrade", "FunnelResult", "LookupRequest", "check_hash_lengths", "run_funnel",
    "validate_request",
]


@dataclass(frozen=True, slots=True)
class LookupRequest:
    block_hashes: Sequence[BlockHash]
    resume_tokens: int | None = None  # position to resume at; default: every hashed token
    reader_abi: Mapping[str, int] | None = None  # group -> ABI fingerprint the reader expects
    alignment: int = 1  # bytes every handle's address and length must be a multiple of
    lease_ttl_s: float = 0.0  # > 0: pin the matched objects for this long (atomic with lookup)
    handles: bool = True  # False: usable tokens and downgrades only (a router's question)
    # A range of a chain split across metadata partitions (core/partitions.py): the hashes
    # are those of blocks [first_block, first_block + len), and this view answers for them
    # alone, the blocks before taken as accepted (their own partitions answer for them).
    first_block: int = 0
    # The chain goes on past these hashes in other partitions: a resume point past them may
    # be asked (this range's part of it answered: every block monotone-ready, the SWA blocks
    # meeting its window).
    open_end: bool = False


@dataclass(frozen=True, slots=True)
class Downgrade:
    reason: Reason
    group: GroupName | None
    position: int  # token position the reason applies at


@dataclass(frozen=True, slots=True)
class FunnelResult:
    usable_tokens: int
    matched_tokens: int  # tokens the walk got through before any layer-3 shrinking
    entries: Sequence[PrefixEntry]  # entries [0, usable/H); valid under the caller's lock
    downgrades: tuple[Downgrade, ...]
    walked: Sequence[PrefixEntry] = ()  # every entry the walk accepted (the result's inputs)
    # per whole run of segment_blocks walked: the segment that certified it, else None
    runs: Sequence[Segment | None] = ()
    first_block: int = 0  # the depth of entries[0] (a range's lookup: the request's)


def validate_request(req: LookupRequest, layout: Layout, *, hash_lengths: bool = True) -> int:
    """Raise InvalidInput for malformed requests; return the token limit. A caller that runs
    the funnel may pass ``hash_lengths=False`` and call :func:`check_hash_lengths` on the
    hashes the walk did not find (every key of the index is 16 bytes, so a found hash is)."""
    hashes = req.block_hashes
    if not hashes:
        raise BadHash("no block hashes given; a lookup needs at least one")
    if hash_lengths:
        check_hash_lengths(hashes)
    first = req.first_block
    if first < 0:
        raise InvalidInput(f"first_block must be >= 0, got {first}")
    start, hashed = first * layout.hash_block, (first + len(hashes)) * layout.hash_block
    limit = hashed if req.resume_tokens is None else req.resume_tokens
    if limit < start or (limit > hashed and not req.open_end):
        cover = f"tokens [{start}, {hashed}) the" if first else f"{hashed} tokens the"
        raise PositionBeyondHashes(
            f"resume position {limit} is outside the {cover} {len(hashes)} hashes cover")
    if req.lease_ttl_s > 0 and not req.handles:
        raise InvalidInput("a lease pins the handles a lookup returns: ask for handles or "
                           "drop the lease")
    if req.alignment < 1 or req.alignment & (req.alignment - 1):
        raise InvalidInput(f"alignment must be a power of two >= 1, got {req.alignment}")
    for name in req.reader_abi or {}:
        if name not in layout.by_name or layout.columns[layout.by_name[name]].kind is Kind.TAIL:
            raise UnknownGroup(f"reader ABI names group {name!r}, which the cache spec lacks")
    return limit


def _abi_downgrades(req: LookupRequest, layout: Layout) -> tuple[Downgrade, ...]:
    out = []
    for name, fp in (req.reader_abi or {}).items():
        col = layout.columns[layout.by_name[name]]
        if col.group.abi.fingerprint() != fp:
            out.append(Downgrade(Reason.ABI_MISMATCH, col.name, 0))
    return tuple(out)


AlignOf = Callable[[ObjRecord], int]  # a placed record's byte alignment (from its pool)


def run_funnel(
    index: PrefixIndex, layout: Layout, req: LookupRequest, limit: int,
    segment_blocks: int = 0, align_of: AlignOf | None = None,
) -> FunnelResult:
    """The funnel over ``index``. It changes no state (it summarises a pending entry it
    reaches, ``contracts.defer``: derived, not state); with ``segment_blocks`` > 0 the walk
    goes by certified runs of that many blocks where it can (core/segments.py) and certifies
    the runs it walked whole twice. ``align_of`` is needed for alignments above 1."""
    abi = _abi_downgrades(req, layout)
    if abi:
        return FunnelResult(0, 0, (), abi)
    hb, first, hashes = layout.hash_block, req.first_block, req.block_hashes
    max_entries = min(limit // hb, first + len(hashes)) - first  # of this request's hashes
    need = req.alignment
    # (segments are certified from depth 0: a range's walk from another depth goes by block)
    data = (_packed(hashes) if segment_blocks > 0 and max_entries >= segment_blocks
            and not first else None)
    runs: list[Segment | None] = []
    if data is not None:
        entries, runs = segments.walk(index, data, max_entries, need, segment_blocks,
                                      layout, align_of)
    else:
        entries = []
        segments.walk_blocks(index, itertools.islice(hashes, max_entries), need, entries,
                             layout, align_of, first, exact=isinstance(hashes, PackedHashes))
    n = len(entries)
    downgrades: list[Downgrade] = []
    if n < max_entries:
        _stop_reason(index.get(hashes[n]), first + n, layout, need, downgrades)
    # how far the monotone columns reach: past the hashes only if every one was accepted and
    # the chain goes on in other partitions
    reach = limit if req.open_end and n == len(hashes) else (first + n) * hb
    usable = _shrink(entries, first, min(reach, limit), layout, downgrades, need, align_of)
    if usable < min(reach, limit) // hb * hb and not downgrades:
        downgrades.append(Downgrade(Reason.PARTIAL_BLOCK, None, usable))
    used = max(0, usable // hb - first)  # (the walked list itself when all are used)
    return FunnelResult(
        usable, (first + n) * hb, entries if used == n else entries[:used],
        tuple(downgrades), entries, runs, first,
    )


def _packed(hashes: Sequence[BlockHash]) -> bytes | None:
    """The hashes as one bytes object, or None if one is malformed (the per-block walk then
    stops there and the length check names it)."""
    try:
        return PackedHashes.of(hashes).data
    except BadHash:
        return None


def _stop_reason(
    e: PrefixEntry | None, depth: int, layout: Layout, align: int, out: list[Downgrade]
) -> None:
    if e is None:
        return  # a plain miss: the cache never held this block
    if e.flags & F_MONO:
        out.append(Downgrade(Reason.MISALIGNED, None, depth * layout.hash_block))
        return
    for col in layout.attached[depth % layout.period]:
        column = layout.columns[col]
        if column.kind in (Kind.COMPRESSED, Kind.INDEXER):
            verdict = column_verdict(e, col, layout)
            if verdict not in (READY, LOAD):
                out.append(Downgrade(Reason(verdict), column.name, depth * layout.hash_block))
                return


def _shrink(entries: list[PrefixEntry], first: int, reach: int, layout: Layout,
            out: list[Downgrade], align: int, align_of: AlignOf | None) -> int:
    """Largest L-aligned p <= ``reach`` at which tails and SWA windows are ready (and their
    served copies aligned). ``entries[i]`` is at depth ``first + i``; only those are asked
    (a range's lookup: the other depths are other partitions'), so p = first*H, needing none
    of them, is always accepted."""
    hb, lcm = layout.hash_block, layout.lcm
    seen: set[Reason] = set()
    for k in range(reach // lcm, first * hb // lcm, -1):
        p = k * lcm
        reason: tuple[Reason, GroupName | None] | None = None
        i = p // hb - 1 - first
        if i < len(entries):  # the tail at p is this request's to check
            e = entries[i]
            if not e.flags & F_TAIL:
                reason = _tail_reason(e, layout)
            elif align > 1:
                reason = _tail_misaligned(e, layout, align, align_of)
        if reason is None:
            reason = _swa_reason(entries, p, layout, align, align_of, first)
        if reason is None:
            return p
        if reason[0] not in seen:
            seen.add(reason[0])
            out.append(Downgrade(reason[0], reason[1], p))
    return first * hb


# What an object needed at the resume point says when there is none there at all
_MISSING_AT_BOUNDARY = {Kind.TAIL: Reason.TAIL_INCOMPLETE, Kind.STATE: Reason.NO_STATE_AT_BOUNDARY}


def _tail_reason(e: PrefixEntry, layout: Layout) -> tuple[Reason, GroupName | None]:
    """Why the resume point at ``e`` lacks a tail or a recurrent state (F_TAIL is clear)."""
    for col in layout.attached[e.depth % layout.period]:
        kind = layout.columns[col].kind
        if kind in AT_BOUNDARY:
            verdict = column_verdict(e, col, layout)
            if verdict not in (READY, LOAD):
                missing = verdict is Reason.MISSING_COMPONENT
                return Reason(_MISSING_AT_BOUNDARY[kind] if missing else verdict), \
                    layout.columns[col].name
    raise AssertionError("F_TAIL clear but every tail and state at the boundary is ready")


def _tail_misaligned(e: PrefixEntry, layout: Layout, align: int, align_of: AlignOf | None
                     ) -> tuple[Reason, GroupName | None] | None:
    for col in layout.attached[e.depth % layout.period]:
        if layout.columns[col].kind in AT_BOUNDARY:
            rec = served(e, col, layout)[0]
            if rec is not None and rec.block >= 0 and _aligned(rec, align, align_of) < align:
                return Reason.MISALIGNED, layout.columns[col].name
    return None


def _aligned(rec: ObjRecord, align: int, align_of: AlignOf | None) -> int:
    if align_of is None:
        raise ValueError("an alignment above 1 needs align_of")
    return align_of(rec)


def _swa_reason(
    entries: list[PrefixEntry], p: int, layout: Layout, align: int = 1,
    align_of: AlignOf | None = None, first_block: int = 0,
) -> tuple[Reason, GroupName | None] | None:
    hb = layout.hash_block
    end_depth = first_block + len(entries)  # (a range's lookup asks its own blocks only)
    for col in layout.swa_columns:
        column = layout.columns[col]
        lo_needed = max(0, p - column.group.window)
        first = max(lo_needed // hb, first_block)  # first entry whose tokens meet [p-W, p)
        for depth in range(first, min(p // hb, end_depth)):
            if not layout.lives_at(col, depth):
                continue
            start, end = layout.block_range(col, depth)
            if end <= lo_needed:
                continue
            need_lo = max(start, lo_needed)
            e = entries[depth - first_block]
            if swa_cover(e, col, need_lo, end, layout, align, align_of) is None:
                return _swa_miss(e, col, need_lo, end, layout), column.name
    return None


def _swa_miss(e: PrefixEntry, col: int, need_lo: int, need_hi: int, layout: Layout) -> Reason:
    """Why no copy serves an SWA block: a copy that covers the need but is misaligned, a copy
    still in flight, else the window is incomplete."""
    if swa_cover(e, col, need_lo, need_hi, layout) is not None:
        return Reason.MISALIGNED
    disk = e.disk[col] if e.disk else None
    if disk is not None and disk.state in _IN_FLIGHT and disk.lo <= need_lo and \
            disk.hi >= need_hi:
        return Reason.DISK_INFLIGHT
    return Reason.SWA_WINDOW_INCOMPLETE


_IN_FLIGHT = frozenset({State.OFFLOADING, State.ON_DISK_INFLIGHT})
