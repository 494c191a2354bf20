"""Walk segments take certified runs of blocks whole, and never certify what changed: each case
certifies a prefix's runs, changes one thing (the hash still hits, the state behind it does
not hold), and checks that the next answer equals a block-by-block walk of the same state.
The memo is off throughout, so every answer here is a walk."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_lookup_memo import CHANGES, Ids, N, _fresh, _same, _state, refuses_same_bytes_malformed

from hkv_service.core import segments
from hkv_service.core.api import LookupRequest, Match, StateConfig
from hkv_service.core.errors import InvalidInput
from hkv_service.core.funnel import run_funnel
from hkv_service.core.ids import BlockHash, PackedHashes
from hkv_service.core.prefix_index import PrefixIndex
from hkv_service.core.records import PrefixEntry
from hkv_service.core.segments import Segment
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, prompt_hashes

SEG = 4  # N = 40 blocks: 10 runs


@pytest.fixture
def prefix() -> tuple[CacheState, list[BlockHash], Ids]:
    st = _state(memo_capacity=0, segment_blocks=SEG)
    hs = prompt_hashes(st.spec, N)
    return st, hs, commit_prefix(st, hs)


def _runs(st: CacheState, req: LookupRequest) -> list[Segment | None]:
    limit = len(req.block_hashes) * st.layout.hash_block
    return list(run_funnel(st.index, st.layout, req, limit, SEG).runs)


def _certified(st: CacheState, req: LookupRequest) -> Match:
    """Walk ``req`` until its runs are certified (the second whole walk does it)."""
    first = st.lookup(req)
    st.lookup(req)
    runs = _runs(st, req)
    assert runs and all(r is not None and r.live for r in runs), "runs certified by now"
    assert _same(st.lookup(req), first)
    return first


def test_certified_runs_answer_like_the_blockwise_walk(prefix) -> None:
    st, hs, _ = prefix
    req = LookupRequest(hs)
    m = _certified(st, req)
    assert m.usable_tokens == N * 64
    assert _same(m, _fresh(st, req))
    # packed and listed hashes, handles or not, shorter resumes: all the same as block by block
    for r in (LookupRequest(PackedHashes.of(hs)), LookupRequest(hs, handles=False),
              LookupRequest(hs, resume_tokens=17 * 64), LookupRequest(hs[:23])):
        assert _same(st.lookup(r), _fresh(st, r))


def test_a_run_walked_once_is_not_certified(prefix) -> None:
    st, hs, _ = prefix
    req = LookupRequest(hs)
    assert all(r is None for r in _runs(st, req))  # this walk only remembers the runs
    assert all(r is not None for r in _runs(st, req))  # the second certifies them


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("handles", [True, False], ids=["handles", "match_only"])
def test_any_change_in_a_run_uncertifies_it(prefix, change, handles: bool) -> None:
    st, hs, ids = prefix
    req = LookupRequest(hs, handles=handles)
    _certified(st, req)
    change(st, hs, ids)
    assert _same(st.lookup(req), _fresh(st, req))


def test_evicted_block_inside_a_run_stops_the_walk_there(prefix) -> None:
    """The hash of the run's last block still hits, its segment is gone with the change."""
    st, hs, ids = prefix
    req = LookupRequest(hs)
    _certified(st, req)
    st.evict(ids[(13, "c4")])  # run [12, 16)
    m = st.lookup(req)
    assert m.matched_tokens == 13 * 64 and _same(m, _fresh(st, req))
    runs = _runs(st, req)
    assert len(runs) == 3 and all(r is not None and r.live for r in runs)  # earlier runs stand


def test_alignment_above_a_runs_gate_walks_block_by_block(prefix) -> None:
    st, hs, _ = prefix
    _certified(st, LookupRequest(hs))
    for align in (4096, 1 << 20):
        req = LookupRequest(hs, alignment=align)
        assert _same(st.lookup(req), _fresh(st, req))
    assert st.lookup(LookupRequest(hs, alignment=1 << 20)).usable_tokens == 0


def test_another_prompt_through_the_runs_takes_them_whole(prefix) -> None:
    """A new question over a cached document: its shared blocks come from certified runs."""
    st, hs, _ = prefix
    _certified(st, LookupRequest(hs))
    other = hs[:30] + prompt_hashes(st.spec, 10, seed=5)[:10]  # not committed: a miss at 30
    req = LookupRequest(other)
    runs = _runs(st, req)
    assert len(runs) == 7 and all(r is not None for r in runs)
    m = st.lookup(req)
    assert m.matched_tokens == 30 * 64 and _same(m, _fresh(st, req))


def test_forged_hashes_before_a_runs_last_block_miss(prefix) -> None:
    """A request whose run ends on a certified hash but differs before it: the memcmp fails
    and the walk goes block by block (a miss at the first forged hash)."""
    st, hs, _ = prefix
    _certified(st, LookupRequest(hs))
    forged = [*hs[:5], BlockHash(b"\x01" * 16), *hs[6:]]
    m = st.lookup(LookupRequest(forged))
    assert m.matched_tokens == 5 * 64 and _same(m, _fresh(st, LookupRequest(forged)))


def test_malformed_hashes_are_refused_even_when_a_run_matches_their_bytes(prefix) -> None:
    st, hs, _ = prefix
    _certified(st, LookupRequest(hs))
    refuses_same_bytes_malformed(st, hs)


def test_a_dropped_segment_lets_go_of_its_entries(prefix) -> None:
    st, hs, ids = prefix
    _certified(st, LookupRequest(hs))
    end = st.index[hs[7]]
    seg = end.segment
    assert seg is not None and seg.live and len(seg.entries) == SEG
    st.evict(ids[(6, "c4")])
    assert not seg.live and seg.entries == () and seg.cols is None
    st.lookup(LookupRequest(hs))  # walked block by block: stops at 6, certifies nothing there
    assert end.segment is seg


def test_a_segment_is_recertified_after_its_run_is_whole_again(prefix) -> None:
    st, hs, ids = prefix
    req = LookupRequest(hs)
    _certified(st, req)
    st.evict(ids[(6, "c4")])
    commit_prefix(st, hs)  # the block is written again
    st.lookup(req)  # a dropped segment is rebuilt by the next whole walk
    runs = _runs(st, req)
    assert all(r is not None and r.live for r in runs)
    assert _same(st.lookup(req), _fresh(st, req))


@pytest.mark.parametrize("bad", [-2, 3, 5])
def test_segment_size_is_checked(bad: int) -> None:
    with pytest.raises(InvalidInput, match="segment_blocks"):
        CacheState(default_spec(), StateConfig(segment_blocks=bad))


def test_two_paths_to_one_entry_do_not_pile_segments_on_it() -> None:
    """Two runs ending at the same entry (orphans re-confirmed after a restart can do that):
    walks alternating between them certify each in turn, and the one replaced is dropped,
    not left live and registered on the shared entry forever."""
    end = PrefixEntry(BlockHash(b"E" * 16), None, 3, [], gate=1)
    index = PrefixIndex()
    index[end.block_hash] = end
    paths = []
    for tag in (b"a", b"b"):
        hashes = [BlockHash(tag * 15 + bytes([i])) for i in range(3)]
        for i, h in enumerate(hashes):
            index[h] = PrefixEntry(h, None, i, [], gate=1)
        paths.append(b"".join([*hashes, end.block_hash]))
    for _ in range(10):
        for data in paths:
            entries, _ = segments.walk(index, data, 4, 1, 4)
            assert len(entries) == 4
    assert end.memos is not None and sum(m.live for m in end.memos) <= 1
    assert len(end.memos) <= 4


def test_segments_of_another_size_are_not_taken(prefix) -> None:
    """Runs certified at one size are never taken by walks at another (a view whose config
    was swapped): the walk goes block by block there, and the answer is the same."""
    st, hs, _ = prefix
    _certified(st, LookupRequest(hs))
    st.config = replace(st.config, segment_blocks=2 * SEG)
    for _ in range(3):
        assert _same(st.lookup(LookupRequest(hs)), _fresh(st, LookupRequest(hs)))
