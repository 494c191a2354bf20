"""Regression: a prefix whose KV was already there (re-confirmed after a restart, or written
by another worker) but whose indexer was not: ``write_prefix`` refused the indexer ("its
compressed KV was not written in this call") and left it ALLOCATED for good, so every later
reader of that prefix downgraded NOT_WRITTEN. The indexer of the same bytes now syncs to the
KV there; one of other bytes still does not (layer 3 would pair an indexer with a KV it was
not computed from)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hkv_service.core.api import LookupRequest
from hkv_service.core.states import Kind, State
from workers.inprocess import InProcessSystem

BLOCKS = 4


@pytest.fixture
def system(inprocess: Callable[..., InProcessSystem]) -> InProcessSystem:
    return inprocess(shards=1)


def _split(system: InProcessSystem, w: Any, seed: int = 0) -> tuple[list[bytes], dict, dict,
                                                                      dict]:
    plane = system.dataplane()
    hashes = w.prompt(BLOCKS, seed=seed)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=seed)
    kinds = {s: plane.layout.columns[plane.layout.by_name[s[1]]].kind for s in blocks}
    indexers = {s: a for s, a in blocks.items() if kinds[s] is Kind.INDEXER}
    rest = {s: a for s, a in blocks.items() if kinds[s] is not Kind.INDEXER}
    return hashes, rest, tails, indexers


def test_an_indexer_syncs_to_the_kv_of_the_same_bytes_already_there(system: InProcessSystem,
                                                                    w: Any) -> None:
    plane = system.dataplane()
    hashes, rest, tails, indexers = _split(system, w)
    assert plane.write_prefix(hashes, rest, tails).ok  # the KV, no indexer
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == 0
    again = plane.write_prefix(hashes, {**rest, **indexers}, tails)  # the same bytes, whole
    assert again.ok, again.failed
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens > 0
    for slot in indexers:
        rec = system.meta.state.objects[again.handles[slot].object_id]
        assert rec.state is State.INDEXER_SYNCED


def test_an_indexer_of_other_bytes_is_not_synced_to_the_kv_there(system: InProcessSystem,
                                                                 w: Any) -> None:
    """The KV there holds bytes A; this writer computed KV bytes B (a nondeterministic
    kernel, say) and the indexer of B. Its B stays unwritten (the slot is taken), and the
    indexer of B must not be paired with A."""
    plane = system.dataplane()
    hashes, rest, tails, _ = _split(system, w, seed=0)
    assert plane.write_prefix(hashes, rest, tails).ok  # KV bytes A
    _, rest_b, _, indexers_b = _split(system, w, seed=1)
    again = plane.write_prefix(hashes, {**rest_b, **indexers_b}, tails)
    assert set(again.failed) == set(indexers_b)
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == 0
