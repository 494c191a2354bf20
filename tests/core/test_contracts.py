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
from hkv_service.core.records import ObjRecord, PrefixEntry, new_record
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
            entry.mem[col] = _rec(kind, col, entry, draw(st.sampled_from(MEM_STATES[kind])),
                                  draw(st.integers(0, 2)), block=col)
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
        entry.mem[col] = _rec(LAYOUT.columns[col].kind, col, entry, ready, 3, block=col)
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
        entry.mem[col] = _rec(LAYOUT.columns[col].kind, col, entry, ready, 0, block=col)
    assert contracts._both_in_memory(entry, KV, LAYOUT) is None
    assert contracts._kv_and_indexers(entry, KV, LAYOUT) == ((entry.mem[KV], contracts.READY), {})
