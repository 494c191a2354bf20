"""The block walk asks each entry's ``child`` hint before the index (segments.walk_blocks):
a hint is only ever a linked child still in the index, and a walk through hints answers as
the index alone would: every case compares with the same walk with every hint cleared."""

from __future__ import annotations

import itertools

import pytest

from hkv_service.core.api import LookupRequest, Match, StateConfig
from hkv_service.core.errors import BadHash, MisplacedHash
from hkv_service.core.funnel import run_funnel
from hkv_service.core.ids import BlockHash, PackedHashes, ShardId
from hkv_service.core.records import NO_CHILD
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes, question


def _state(blocks: int = 512) -> CacheState:
    st = CacheState(default_spec(), StateConfig(memo_capacity=0, segment_blocks=0))
    st.register_owner(ShardId("s0"), pools_for(st.layout, blocks))
    return st


def _hints_sound(st: CacheState) -> int:
    """Every hint names a child of its entry that the index holds; how many hints there are."""
    n = 0
    for e in st.index.values():
        if e.child is not NO_CHILD:
            n += 1
            assert e.child.parent is e, "a hint names another entry's child"
            assert st.index.get(e.child.block_hash) is e.child, "a hint names an entry gone"
    return n


def _unhinted(st: CacheState, req: LookupRequest) -> tuple[int, int, tuple[object, ...]]:
    """What the walk answers with every hint cleared: the index alone (then restored)."""
    kept = [(e, e.child) for e in st.index.values()]
    for e, _ in kept:
        e.child = NO_CHILD
    try:
        limit = len(req.block_hashes) * st.layout.hash_block
        r = run_funnel(st.index, st.layout, req, limit)
        return r.usable_tokens, r.matched_tokens, r.downgrades
    finally:
        for e, c in kept:
            e.child = c


def _walked(st: CacheState, req: LookupRequest) -> tuple[int, int, tuple[object, ...]]:
    limit = len(req.block_hashes) * st.layout.hash_block
    r = run_funnel(st.index, st.layout, req, limit)
    return r.usable_tokens, r.matched_tokens, r.downgrades


def test_branches_walked_in_turn_answer_as_the_index_does() -> None:
    """A document and questions over it: each walk turns the hint at the branch to its own
    question, and every walk (packed or listed) answers as the index alone does."""
    st = _state()
    doc = prompt_hashes(st.spec, 24)
    asks = [question(doc, i, 4) for i in range(3)]
    for hs in asks:
        commit_prefix(st, hs)
    branch = st.index.get(doc[-1])
    assert branch is not None and branch.children == 3
    for _ in range(2):
        for hs in asks:
            for req in (LookupRequest(hs), LookupRequest(PackedHashes.of(hs))):
                got = _walked(st, req)
                assert got == _unhinted(st, req) and got[0] == len(hs) * 64
            assert branch.child is st.index.get(hs[len(doc)])  # turned to the last walked
    assert _hints_sound(st) > 0


def test_a_hint_never_names_an_entry_gone() -> None:
    """Prompts evicting each other from a small pool: every hint still names a linked child
    the index holds (an entry gone clears its parent's hint), and walks agree with the
    index alone. (Mutation-checked: gc_entry not clearing the hint fails here.)"""
    st = _state(blocks=20)
    prompts = [prompt_hashes(st.spec, 16, seed=s) for s in range(6)]
    shared = prompts[0][:6]
    prompts = [shared + p[6:] for p in prompts]  # one trunk, six branches
    for p in prompts:
        commit_prefix(st, p)
        for q in prompts:
            req = LookupRequest(q)
            assert _walked(st, req) == _unhinted(st, req)
        _hints_sound(st)
    gone = [p for p in prompts if st.index.get(p[-1]) is None]
    assert gone, "the pool was meant to evict some branch"


def test_a_hash_of_another_type_is_not_taken_from_a_hint() -> None:
    """A ``bytearray`` equal to a cached hash is no key of the index (unhashable): the walk
    stops there, and the lookup refuses it, hint or none."""
    st = _state()
    hs = prompt_hashes(st.spec, 8)
    commit_prefix(st, hs)
    st.lookup(LookupRequest(hs))  # the hints point down this chain
    odd: list[BlockHash] = [*hs[:3], bytearray(hs[3]), *hs[4:]]  # type: ignore[list-item]
    req = LookupRequest(odd)
    assert _walked(st, req) == _unhinted(st, req)
    assert _walked(st, req)[1] == 3 * 64
    with pytest.raises(BadHash, match="bytearray"):
        st.lookup(req)


def test_a_misplaced_hash_after_hinted_blocks_is_refused() -> None:
    """The hint of block 6 is not the hash given there (the hash of block 2 is): the index
    answers, and the depth it holds the hash at refuses it."""
    st = _state()
    hs = prompt_hashes(st.spec, 8)
    commit_prefix(st, hs)
    st.lookup(LookupRequest(hs))
    with pytest.raises(MisplacedHash, match=r"block 6 .* block 2"):
        st.lookup(LookupRequest([*hs[:6], hs[2], hs[7]]))


def test_a_lookup_walks_a_chain_by_its_hints() -> None:
    """A chain as it was written: every block after the first is its parent's hint (what
    makes the walk cheap), and the walk answers as the index alone does."""
    st = _state()
    hs = prompt_hashes(st.spec, 32)
    commit_prefix(st, hs)
    entries = [st.index.get(h) for h in hs]
    assert all(a is not None and a.child is b for a, b in itertools.pairwise(entries))
    for req in (LookupRequest(hs), LookupRequest(PackedHashes.of(hs))):
        m: Match = st.lookup(req)
        assert m.usable_tokens == 32 * 64 and _walked(st, req) == _unhinted(st, req)
