"""The copies layer 3 serves: the shortcut for the usual case chooses what the rule chooses.

``contracts._kv_and_indexers`` first tries the memory KV with memory indexers at its version
(``_both_in_memory``: no candidate lists built) and only then ranks every choice
(``_best_pair``). The shortcut must never choose otherwise: checked here on every mix of
memory and disk copies, states and versions hypothesis finds, not only the ones the state
view's transitions happen to reach.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hkv_service.core import contracts
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.records import ObjRecord, PrefixEntry, new_record, set_mem
from hkv_service.core.states import Kind, State
from hkv_service.specs import default_spec

LAYOUT = Layout(default_spec())
KV = next(kv for kv, ixs in LAYOUT.indexers_of.items() if ixs)  # c4, indexed by idx
PAIRED = (KV, *LAYOUT.indexers_of[KV])
MEM_STATES = {
    Kind.COMPRESSED: [State.ALLOCATED, State.WRITING, State.COMPRESSED_READY, State.LOST],
    Kind.INDEXER: [State.ALLOCATED, State.INDEXER_WRITTEN, State.INDEXER_SYNCED, State.CORRUPT],
}
DISK_STATES = [State.OFFLOADING, State.ON_DISK, State.ON_DISK_INFLIGHT, State.ON_DISK_READY,
               State.CORRUPT]


@st.composite
def entries(draw: st.DrawFn) -> PrefixEntry:
    n = len(LAYOUT.columns)
    entry = PrefixEntry(BlockHash(bytes(16)), None, 0, [None] * n, [None] * n)
    assert entry.disk is not None
    for col in PAIRED:
        kind = LAYOUT.columns[col].kind
        if draw(st.booleans()):
            set_mem(entry, col, _rec(kind, col, entry, draw(st.sampled_from(MEM_STATES[kind])),
                                  draw(st.integers(0, 2)), block=col))
        if draw(st.booleans()):
            entry.disk[col] = _rec(Kind.DISK, col, entry, draw(st.sampled_from(DISK_STATES)),
                                   draw(st.integers(0, 2)), block=-1)
    return entry


def _rec(kind: Kind, col: int, entry: PrefixEntry, state: State, version: int, block: int
         ) -> ObjRecord:
    return new_record(kind, col, ObjectId(col + 1), entry, state, ShardId("s"), block, 0,
                      version=version, inner=LAYOUT.columns[col].kind)


@settings(max_examples=400, deadline=None)
@given(entries())
def test_the_shortcut_chooses_what_the_rule_chooses(entry: PrefixEntry) -> None:
    rule = contracts._best_pair(entry, KV, LAYOUT)
    both = contracts._both_in_memory(entry, KV, LAYOUT)
    if both is not None:
        assert both == rule
    assert contracts._kv_and_indexers(entry, KV, LAYOUT) == rule


def test_the_shortcut_is_taken_in_the_usual_case() -> None:
    """(Else the test above would pass with a shortcut that never answers.)"""
    n = len(LAYOUT.columns)
    entry = PrefixEntry(BlockHash(bytes(16)), None, 0, [None] * n)
    for col in PAIRED:
        ready = State.COMPRESSED_READY if col == KV else State.INDEXER_SYNCED
        set_mem(entry, col, _rec(LAYOUT.columns[col].kind, col, entry, ready, 3, block=col))
    both = contracts._both_in_memory(entry, KV, LAYOUT)
    assert both is not None and both == contracts._best_pair(entry, KV, LAYOUT)
    assert both[0] == (entry.mem[KV], contracts.READY)


def test_version_0_never_pairs_even_with_both_in_memory() -> None:
    """An unset version (0) is no version: a KV and indexer both at 0 are not a pair, and the
    KV is served alone (its indexer stale), by the shortcut as by the rule."""
    n = len(LAYOUT.columns)
    entry = PrefixEntry(BlockHash(bytes(16)), None, 0, [None] * n)
    for col in PAIRED:
        ready = State.COMPRESSED_READY if col == KV else State.INDEXER_SYNCED
        set_mem(entry, col, _rec(LAYOUT.columns[col].kind, col, entry, ready, 0, block=col))
    assert contracts._both_in_memory(entry, KV, LAYOUT) is None
    assert contracts._kv_and_indexers(entry, KV, LAYOUT) == ((entry.mem[KV], contracts.READY), {})


ALL_MEM_STATES = {
    Kind.COMPRESSED: MEM_STATES[Kind.COMPRESSED],
    Kind.INDEXER: MEM_STATES[Kind.INDEXER],
    Kind.SWA: [State.ALLOCATED, State.WRITING, State.SWA_VALID, State.LOST],
    Kind.TAIL: [State.ALLOCATED, State.TAIL_PARTIAL, State.TAIL_COMPLETE, State.CORRUPT],
}


@st.composite
def whole_entries(draw: st.DrawFn) -> PrefixEntry:
    """An entry at either depth residue with any mix of copies in every column living there;
    memory copies mostly READY at one version, so the summary's shortcut is often taken."""
    n = len(LAYOUT.columns)
    depth = draw(st.integers(0, 2 * LAYOUT.period - 1))
    entry = PrefixEntry(BlockHash(bytes(16)), None, depth, [None] * n, [None] * n)
    assert entry.disk is not None
    version = draw(st.integers(0, 2))
    for col in LAYOUT.attached[depth % LAYOUT.period]:
        kind = LAYOUT.columns[col].kind
        if draw(st.integers(0, 4)):  # mostly present
            ready = next(s for s in ALL_MEM_STATES[kind] if s in contracts.READY_STATES[kind])
            state = ready if draw(st.integers(0, 3)) else draw(
                st.sampled_from(ALL_MEM_STATES[kind]))
            v = version if draw(st.integers(0, 3)) else draw(st.integers(0, 2))
            set_mem(entry, col, _rec(kind, col, entry, state, v, block=draw(st.integers(0, 64))))
        if not draw(st.integers(0, 3)):
            state = draw(st.sampled_from(DISK_STATES))  # (a loaded copy has its block)
            block = draw(st.integers(0, 64)) if state is State.ON_DISK_READY else -1
            entry.disk[col] = _rec(Kind.DISK, col, entry, state, draw(st.integers(0, 2)),
                                   block=block)
    return entry


def _align(rec: ObjRecord) -> int:
    return (rec.block & -rec.block) or 1 << 20


@settings(max_examples=600, deadline=None)
@given(whole_entries())
def test_the_summary_shortcut_gives_what_the_rule_gives(entry: PrefixEntry) -> None:
    """``summarise`` answers at once where an entry has no disk copy (``_memory_only``): the
    same flags and gate as asking every column's verdict, on every mix hypothesis finds."""
    contracts._summarise_by_rule(entry, LAYOUT, _align)
    rule = (entry.flags, entry.gate)
    entry.flags = entry.gate = -1
    contracts.summarise(entry, LAYOUT, _align)
    assert (entry.flags, entry.gate) == rule


def test_the_summary_shortcut_is_taken_without_disk_copies() -> None:
    """(Else the test above would pass with a shortcut that never answers.) Whole entries and
    the half entries a re-confirm leaves (an owner holds some of an entry's columns, the
    others arrive from other owners): the shortcut answers both, and not with a disk copy."""
    for depth in range(LAYOUT.period):
        for keep in (lambda c: True, lambda c: c % 2 == 0):
            n = len(LAYOUT.columns)
            entry = PrefixEntry(BlockHash(bytes(16)), None, depth, [None] * n)
            for col in filter(keep, LAYOUT.attached[depth]):
                kind = LAYOUT.columns[col].kind
                ready = next(s for s in ALL_MEM_STATES[kind]
                             if s in contracts.READY_STATES[kind])
                set_mem(entry, col, _rec(kind, col, entry, ready, 3, block=8 * (col + 1)))
            assert contracts._memory_only(entry, LAYOUT, _align)
            flags, gate = entry.flags, entry.gate
            contracts._summarise_by_rule(entry, LAYOUT, _align)
            assert (flags, gate) == (entry.flags, entry.gate)
            entry.disk = [None] * n
            entry.disk[LAYOUT.attached[depth][-1]] = _rec(
                Kind.DISK, LAYOUT.attached[depth][-1], entry, State.ON_DISK, 3, block=-1)
            assert not contracts._memory_only(entry, LAYOUT, _align)
