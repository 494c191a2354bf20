"""Recovery contracts: per kind, what must hold for an object to be read, what is validated,
and what the fallback is. The funnel reads these; nothing relies on call order.

A column's verdict at an entry is READY (readable now), LOAD (readable after a disk load) or a
:class:`Reason` it is not usable. :func:`summarise` folds an entry's verdicts into the integer
``flags`` the funnel's hot walk tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .layout import Layout
from .records import ObjRecord, PrefixEntry, drop_memos, mem_at
from .states import Kind, Reason, State

__all__ = [
    "CONTRACTS",
    "F_LOAD_MONO",
    "F_LOAD_SWA",
    "F_LOAD_TAIL",
    "F_MONO",
    "F_PENDING",
    "F_SWA",
    "F_TAIL",
    "LOAD",
    "READY",
    "READY_STATES",
    "RecoveryContract",
    "Verdict",
    "column_verdict",
    "defer",
    "served",
    "settled",
    "summarise",
    "swa_cover",
]

READY = "READY"
LOAD = "LOAD"
Verdict = str | Reason  # READY, LOAD or the Reason it is unusable

F_MONO = 1  # every COMPRESSED/INDEXER column at this entry is READY or LOAD
F_TAIL = 2  # every column needed at the resume point (TAIL, STATE) is READY or LOAD here
F_SWA = 4  # every SWA column at this entry is READY or LOAD (range checked by the funnel)
F_LOAD_MONO = 8
F_LOAD_TAIL = 16
F_LOAD_SWA = 32
# Records changed since the last summary, which is left to the first walk that reaches the
# entry (:func:`defer`): set alone, with gate 0, so the entry passes no gate until then.
F_PENDING = 64

_NOT_YET = {State.ALLOCATED: Reason.NOT_WRITTEN, State.WRITING: Reason.NOT_WRITTEN}
_DISK_VERDICT: dict[State, Verdict] = {
    State.ON_DISK_READY: READY,
    State.ON_DISK: LOAD,
    State.ON_DISK_INFLIGHT: Reason.DISK_INFLIGHT,
    State.OFFLOADING: Reason.DISK_INFLIGHT,
    State.LOST: Reason.OWNER_LOST,
    State.CORRUPT: Reason.CORRUPT,
}


@dataclass(frozen=True, slots=True)
class RecoveryContract:
    kind: Kind
    readable_when: str
    validated: str
    fallback: str
    ready_states: frozenset[State]  # the one home of what "ready" is, per kind

    @property
    def ready_state(self) -> State:
        """The state an object of this kind is read in (each kind has one): what a writer's
        commit reaches and what an owner vouches for it in after a restart."""
        (state,) = self.ready_states
        return state


CONTRACTS: dict[Kind, RecoveryContract] = {
    Kind.COMPRESSED: RecoveryContract(
        Kind.COMPRESSED,
        "COMPRESSED_READY (or its disk copy ON_DISK_READY)",
        "ABI fingerprint of the reader; generation at read",
        "recompute from the block start",
        frozenset({State.COMPRESSED_READY}),
    ),
    Kind.TAIL: RecoveryContract(
        Kind.TAIL,
        "TAIL_COMPLETE holding every raw token its resume point needs",
        "length == tokens required at the boundary; TAIL_PARTIAL never read",
        "resume at the previous boundary whose tail is complete",
        frozenset({State.TAIL_COMPLETE}),
    ),
    Kind.SWA: RecoveryContract(
        Kind.SWA,
        "SWA_VALID(lo, hi) with lo <= max(block start, p-W) and hi >= block end",
        "only blocks intersecting [p-W, p) are checked",
        "shorter p whose window is whole",
        frozenset({State.SWA_VALID}),
    ),
    Kind.INDEXER: RecoveryContract(
        Kind.INDEXER,
        "INDEXER_SYNCED at the version of the KV copy served beside it (never 0)",
        "synced version == the served KV's version: KV and indexer copies chosen together",
        "recompute the block (KV and index)",
        frozenset({State.INDEXER_SYNCED}),
    ),
    Kind.STATE: RecoveryContract(
        Kind.STATE,
        "STATE_READY at exactly the resume point, for every recurrent group",
        "the entry it lives at is the boundary; the ABI names the state's parts, dtypes, "
        "layers and recurrence",
        "resume at the previous boundary where every recurrent group has its state",
        frozenset({State.STATE_READY}),
    ),
    Kind.DISK: RecoveryContract(
        Kind.DISK,
        "ON_DISK_READY (loaded and checksum-verified); ON_DISK needs a load first",
        "xxh3-128 of raw bytes + length on every load",
        "recompute; corrupt copies quarantined",
        frozenset({State.ON_DISK_READY}),
    ),
}


Served = tuple[ObjRecord | None, Verdict]  # the copy that serves a column, and its verdict
# Read per column of every summary: module globals, not class attributes (an enum member
# read through its class costs ~0.1 us in Python 3.11, EnumType.__getattr__)
READY_STATES = {k: c.ready_states for k, c in CONTRACTS.items()}
_INDEXER, _COMPRESSED = Kind.INDEXER, Kind.COMPRESSED


def column_verdict(entry: PrefixEntry, column: int, layout: Layout) -> Verdict:
    return served(entry, column, layout)[1]


Pairs = dict[int, tuple[Served, dict[int, Served]]]  # KV column -> its copies chosen together


def served(entry: PrefixEntry, column: int, layout: Layout, pairs: Pairs | None = None
           ) -> Served:
    """The copy that serves ``column`` at ``entry`` (memory or disk) and its verdict. Layer 3
    holds on the copies served: a COMPRESSED KV and the indexers of it are chosen together, a
    pair of copies whose versions agree (never 0), so an indexer is never served beside a KV
    of another version, and a disk KV and disk indexer synced to each other serve together
    when the memory KV was rewritten. SWA blocks are chosen per resume point
    (:func:`swa_cover`); this gives the best copy regardless of range. ``pairs``: the KV
    copies chosen with their indexers at this entry, kept across calls for its columns (a
    summary asks for the KV and each indexer: the choice is made once)."""
    col = layout.columns[column]
    kind = col.kind
    if kind is _INDEXER:
        assert col.indexes is not None, "INDEXER column without the column it indexes"
        got = _pair(entry, col.indexes, layout, pairs)[1].get(column)
        if got is not None:
            return got
        # copies synced to another version than every KV copy here, or none at all
        return None, Reason.INDEXER_STALE if _candidates(entry, column) else \
            _unusable(entry, column)
    if kind is _COMPRESSED and layout.indexers_of[column]:
        return _pair(entry, column, layout, pairs)[0]
    cands = _candidates(entry, column)
    return cands[0] if cands else (None, _unusable(entry, column))


def _candidates(entry: PrefixEntry, column: int) -> list[tuple[ObjRecord, Verdict]]:
    """Usable copies at ``entry``/``column``, best first: memory, loaded disk, disk at rest."""
    out: list[tuple[ObjRecord, Verdict]] = []
    mem = mem_at(entry, column)
    if mem is not None and mem.state in READY_STATES[mem.kind]:
        out.append((mem, READY))
    disk = entry.disk[column] if entry.disk else None
    if disk is not None:
        verdict = _DISK_VERDICT.get(disk.state, Reason.MISSING_COMPONENT)
        if verdict in (READY, LOAD):
            out.append((disk, verdict))
    return out


def _unusable(entry: PrefixEntry, column: int) -> Reason:
    """Why no copy at ``entry``/``column`` can serve: the memory object's reason first (what
    a writer can fix), else the disk copy's."""
    mem = mem_at(entry, column)
    if mem is not None:
        if mem.state is State.TAIL_PARTIAL:
            return Reason.TAIL_INCOMPLETE
        if mem.state in (State.INDEXER_WRITTEN, State.INDEXER_SYNCED):
            return Reason.INDEXER_STALE
        reason = _NOT_YET.get(mem.state)
        if reason is not None:
            return reason
    disk = entry.disk[column] if entry.disk else None
    verdict = _DISK_VERDICT.get(disk.state) if disk is not None else None
    return verdict if isinstance(verdict, Reason) else Reason.MISSING_COMPONENT


def _pair(entry: PrefixEntry, kv: int, layout: Layout, pairs: Pairs | None
          ) -> tuple[Served, dict[int, Served]]:
    if pairs is None:
        return _kv_and_indexers(entry, kv, layout)
    got = pairs.get(kv)
    if got is None:
        got = pairs[kv] = _kv_and_indexers(entry, kv, layout)
    return got


def _kv_and_indexers(entry: PrefixEntry, kv: int, layout: Layout
                     ) -> tuple[Served, dict[int, Served]]:
    """A KV copy and one copy of each indexer of it, all at one version (never 0): of such
    choices, the one with fewest loads, memory copies first. With none, the best KV copy
    alone (its indexers are stale)."""
    both = _both_in_memory(entry, kv, layout)
    return both if both is not None else _best_pair(entry, kv, layout)


def _best_pair(entry: PrefixEntry, kv: int, layout: Layout
               ) -> tuple[Served, dict[int, Served]]:
    """:func:`_kv_and_indexers` by the rule itself: every KV candidate, ranked."""
    kv_cands = _candidates(entry, kv)
    if not kv_cands:
        return (None, _unusable(entry, kv)), {}
    best: tuple[int, int, Served, dict[int, Served]] | None = None
    for rank, (rec, verdict) in enumerate(kv_cands):
        chosen: dict[int, Served] = {}
        loads = int(verdict == LOAD)
        for ix in layout.indexers_of[kv]:
            match = [c for c in _candidates(entry, ix) if rec.version and c[0].version ==
                     rec.version]
            if not match:
                break
            chosen[ix] = match[0]
            loads += match[0][1] == LOAD
        else:
            if best is None or (loads, rank) < best[:2]:
                best = (loads, rank, (rec, verdict), chosen)
    if best is None:
        return kv_cands[0], {}
    return best[2], best[3]


def _both_in_memory(entry: PrefixEntry, kv: int, layout: Layout
                    ) -> tuple[Served, dict[int, Served]] | None:
    """The choice :func:`_kv_and_indexers` makes when the memory KV and a memory copy of each
    of its indexers are READY at its version (the usual case, found without building the
    candidate lists): no loads, the first KV candidate, its indexers' first candidates, so
    nothing can rank before it. None otherwise (the general rule decides)."""
    rec = mem_at(entry, kv)
    if rec is None or not rec.version or rec.state not in READY_STATES[rec.kind]:
        return None
    chosen: dict[int, Served] = {}
    for ix in layout.indexers_of[kv]:
        m = mem_at(entry, ix)
        if m is None or m.version != rec.version or m.state not in READY_STATES[m.kind]:
            return None
        chosen[ix] = (m, READY)
    return (rec, READY), chosen


def swa_cover(entry: PrefixEntry, column: int, need_lo: int, need_hi: int, layout: Layout,
              align: int = 1, align_of: Callable[[ObjRecord], int] | None = None
              ) -> ObjRecord | None:
    """The record that serves tokens ``[need_lo, need_hi)`` of this SWA block, or None: the
    memory object when it is valid over them (and, placed, aligned to ``align``), else the
    disk copy (loaded, or at rest: placed by its load) when that is. The funnel accepts the
    block with it and the handles point at the same record, so a partly rewritten memory
    object never hides a whole disk copy, nor a misaligned copy an aligned one."""
    for rec, _ in _candidates(entry, column):
        if rec.lo <= need_lo and rec.hi >= need_hi and (
                align == 1 or rec.block < 0 or (align_of is not None and align_of(rec) >= align)):
            return rec  # fail closed: with no way to tell a placed copy's alignment, not it
    return None


_BITS = {
    Kind.COMPRESSED: (F_MONO, F_LOAD_MONO),
    Kind.INDEXER: (F_MONO, F_LOAD_MONO),
    Kind.TAIL: (F_TAIL, F_LOAD_TAIL),
    Kind.STATE: (F_TAIL, F_LOAD_TAIL),  # needed at the resume point only, as a tail is
    Kind.SWA: (F_SWA, F_LOAD_SWA),
}


def summarise(entry: PrefixEntry, layout: Layout, align_of: Callable[[ObjRecord], int]) -> None:
    """Recompute ``entry.flags`` and ``entry.gate`` from its columns' verdicts; ``align_of``
    gives a placed record's byte alignment (its pool knows it). The gate folds in only the
    monotone columns' served copies (needed by every reader past this block); a TAIL or SWA
    block is needed only at some resume points, so the funnel checks its served copy there,
    and a misaligned one never stops the walk. Drops the entry's packed handle row and
    lookup memos: every change to an entry's records passes through here (or through
    :func:`defer`, which drops them too and leaves the summary to the walk)."""
    entry.row = None
    if entry.memos:
        drop_memos(entry)
    if not _memory_only(entry, layout, align_of):
        _summarise_by_rule(entry, layout, align_of)


def _summarise_by_rule(entry: PrefixEntry, layout: Layout,
                       align_of: Callable[[ObjRecord], int]) -> None:
    """:func:`summarise`'s flags and gate from each column's :func:`served` verdict."""
    flags = F_MONO | F_TAIL | F_SWA
    align = 1 << 30
    pairs: Pairs = {}
    for col, kind in layout.kinds_attached[entry.depth % layout.period]:
        ok_bit, load_bit = _BITS[kind]
        rec, verdict = served(entry, col, layout, pairs)
        if verdict == LOAD:
            flags |= load_bit  # at rest on disk: its block (and alignment) is not chosen yet
        elif verdict != READY:
            flags &= ~ok_bit
        elif ok_bit == F_MONO:
            assert rec is not None and rec.block >= 0, "a READY column without a memory block"
            align = min(align, align_of(rec))
    entry.flags = flags
    entry.gate = align if flags & F_MONO else 0


def defer(entry: PrefixEntry) -> None:
    """``entry``'s records changed; summarise it when a walk reaches it (:func:`settled`),
    not now. A re-confirm in random order touches an entry once per column, each time in
    another batch: deferred, the entry is summarised once, and only if something reads it.
    Until then it passes no gate (a walk that cannot summarise stops there: fail closed), and
    what was computed through it (packed row, memos, walk segments) goes now, as
    :func:`summarise` drops it. A pending entry has none of them: only a walk that passed
    it builds them."""
    if entry.flags & F_PENDING:
        return
    entry.row = None
    if entry.memos:
        drop_memos(entry)
    entry.flags, entry.gate = F_PENDING, 0


def stops_walk(entry: PrefixEntry, need: int) -> bool:
    """Whether the funnel's walk, needing alignment ``need``, stops at ``entry`` whatever it
    is given: its gate is below ``need`` and it is not pending (:func:`settled` summarises
    only a pending entry). The walk itself tests the gate first and summarises after."""
    return entry.gate < need and not entry.flags & F_PENDING


def settled(entry: PrefixEntry, need: int, layout: Layout | None,
            align_of: Callable[[ObjRecord], int] | None) -> bool:
    """Whether a walk stopped at ``entry`` passes it once it is summarised: only a pending
    entry (:func:`defer`) is summarised here, and only by a walk given the layout and a
    way to tell alignments (else it stops there)."""
    if not entry.flags & F_PENDING or layout is None or align_of is None:
        return False
    summarise(entry, layout, align_of)
    return entry.gate >= need



# Per layout, per depth residue, per column living there: (column, its ready states, its bit
# in the flags, whether it is monotone (its alignment gates the walk), and for an INDEXER the
# KV column it indexes, else None): :func:`_memory_only`'s plan.
_Step = tuple[int, frozenset[State], int, bool, int | None]
_PLANS: dict[int, tuple[Layout, tuple[tuple[_Step, ...], ...]]] = {}


def _plan(layout: Layout) -> tuple[tuple[_Step, ...], ...]:
    got = _PLANS.get(id(layout))
    if got is not None and got[0] is layout:
        return got[1]
    plan = tuple(
        tuple((col, READY_STATES[kind], _BITS[kind][0], _BITS[kind][0] == F_MONO,
               layout.columns[col].indexes) for col, kind in attached)
        for attached in layout.kinds_attached)
    _PLANS[id(layout)] = (layout, plan)  # (the layout kept: its id is never another's)
    return plan


def _memory_only(entry: PrefixEntry, layout: Layout,
                 align_of: Callable[[ObjRecord], int]) -> bool:
    """Summarise ``entry`` at once where it has no disk copy: each column's verdict is then
    READY exactly when its memory copy is in a ready state, an INDEXER's only where the
    memory KV and every indexer of it pair (:func:`_both_in_memory`: with no disk copy there
    is no other candidate, and :func:`_best_pair` either pairs exactly these or serves the
    KV alone); no LOAD bit. False, changing nothing,
    where a disk copy is present: the general rule decides. (Most summaries end here: a
    write's, and a settle's after a re-confirm, ~91% of whose entries have no disk copy.)"""
    disk = entry.disk
    if disk is not None and any(disk):
        return False
    mem = entry.mem
    flags = F_MONO | F_TAIL | F_SWA
    align = 1 << 30
    for col, ready, bit, mono, kv in _plan(layout)[entry.depth % layout.period]:
        rec = mem[col]
        if rec is None or rec.state not in ready or (
                kv is not None and _both_in_memory(entry, kv, layout) is None):
            flags &= ~bit
        elif mono:
            a = align_of(rec)
            if a < align:
                align = a
    entry.flags = flags
    entry.gate = align if flags & F_MONO else 0
    return True
