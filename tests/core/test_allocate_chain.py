"""Allocate refuses a badly chained prefix without creating any of its entries (regression:
the path was made depth by depth, so a conflict at depth 3 left depths 0-2 behind; found by
the live-server fuzz test, which saw the `entries` gauge grow on a rejected call)."""

from __future__ import annotations

import pytest

from hkv_service.core.api import AllocRequest
from hkv_service.core.errors import BadHash
from hkv_service.core.state_view import CacheState
from hkv_service.testing import prompt_hashes


def _index_shape(state: CacheState) -> list[tuple[bytes, int, bytes | None, int]]:
    return sorted((h, e.depth, e.parent.block_hash if e.parent else None, e.children)
                  for h, e in state.index.items())


@pytest.mark.parametrize("case", ["known_deeper", "repeated_in_call", "known_other_parent"])
def test_a_refused_allocate_creates_no_entry(state: CacheState, spec, case: str) -> None:
    known = prompt_hashes(spec, 2)
    state.allocate(known, [AllocRequest(1, "c4")])  # depths 0 and 1 are now entries
    fresh = prompt_hashes(spec, 4, seed=7)
    hashes = {
        # a hash the index holds at depth 1, named at depth 3
        "known_deeper": [*fresh[:3], known[1]],
        # one hash twice in the same call
        "repeated_in_call": [*fresh[:3], fresh[0]],
        # the right depth, but under a parent made by this call, not its own
        "known_other_parent": [fresh[0], known[1]],
    }[case]
    before = _index_shape(state)
    with pytest.raises(BadHash, match="hashes must be chained"):
        state.allocate(hashes, [AllocRequest(len(hashes) - 1, "c4")])
    assert _index_shape(state) == before
    assert state.stats()["gauges"]["entries"] == len(before)


def test_an_orphan_is_adopted_not_refused(state: CacheState, spec) -> None:
    """An entry known without its parent (as after a restart rebuild) joins the path."""
    hashes = prompt_hashes(spec, 2)
    state.allocate(hashes, [AllocRequest(1, "c4")])
    state.index[hashes[1]].parent = None  # make depth 1 an orphan
    state.index[hashes[0]].children -= 1
    state.allocate(hashes, [AllocRequest(1, "idx")])  # walks depth 1 again
    assert state.index[hashes[1]].parent is state.index[hashes[0]]
    assert state.index[hashes[0]].children == 1
