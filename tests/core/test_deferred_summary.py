"""A re-confirm leaves each entry's summary to the first walk that reaches it (``contracts.defer``).

Reports arrive in any order, an entry's columns in other batches: summarising per report was
a third of a re-confirm's cost. What is pinned down here:

* a confirmed entry is pending (no gate, no packed row, no memos) until a walk reaches it,
  and then answers exactly what the view before the restart answered, by the per-block walk
  and by certified runs (segments) alike, at every resume point and alignment;
* a confirm into an entry a lookup walked drops what was computed through it (memos,
  segments, packed rows): the next lookup sees the confirmed object;
* a walk that cannot summarise (no layout or no way to tell alignments) stops at a pending
  entry: fail closed, never a stale summary.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from hkv_service.core import contracts, segments
from hkv_service.core.api import LookupRequest, Match, ObjectReport
from hkv_service.core.contracts import F_PENDING
from hkv_service.core.ids import BlockHash, PackedHashes, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes
from tests.helpers import reports_of

S0 = ShardId("s0")
BLOCKS = 130  # two whole 64-block runs (segments) and a per-block rest


def _old(prompts: Sequence[Sequence[BlockHash]]) -> CacheState:
    old = CacheState(default_spec())
    old.register_owner(S0, pools_for(old.layout, 1024))
    for hs in prompts:
        commit_prefix(old, hs)
    return old


def _restarted(old: CacheState, reports: Sequence[ObjectReport], batch: int = 7) -> CacheState:
    new = CacheState(default_spec())
    inc = new.register_owner(S0, pools_for(new.layout, 1024))
    for i in range(0, len(reports), batch):
        new.confirm(S0, reports[i : i + batch], inc)
    return new


def _answer(m: Match) -> tuple[object, ...]:
    cols = {name: [(h.block, h.generation) for h in hs] for name, hs in m.handles.items()}
    return m.usable_tokens, m.matched_tokens, m.downgrades, cols


def _prompts() -> list[list[BlockHash]]:
    spec = default_spec()
    return [list(prompt_hashes(spec, BLOCKS, seed=s)) for s in (1, 2)]


def test_confirmed_entries_wait_for_a_walk_and_then_answer_as_before() -> None:
    prompts = _prompts()
    old = _old(prompts)
    reports = reports_of(old)
    random.Random(7).shuffle(reports)
    new = _restarted(old, reports)
    assert len(new.index) == len(old.index)
    for e in new.index.values():  # nothing summarised yet, nothing computed through it
        assert (e.flags, e.gate, e.row, e.memos) == (F_PENDING, 0, None, None)
    lay = new.layout
    for hs in prompts:
        for resume in (lay.lcm, 5 * lay.lcm, 64 * lay.hash_block, BLOCKS * lay.hash_block):
            for align in (1, 64):
                for _ in range(3):  # blockwise, then a run walked twice: certified segments
                    req = LookupRequest(hs, resume_tokens=resume, alignment=align)
                    got, want = new.lookup(req), old.lookup(req)
                    assert _answer(got) == _answer(want)
                    assert got.usable_tokens == resume
    walked = [new.index[h] for hs in prompts for h in hs]
    for e in walked:  # each summarised once, by the walk, as summarise would now
        flags, gate = e.flags, e.gate
        contracts.summarise(e, lay, new._tables.align_of)
        assert (flags, gate) == (e.flags, e.gate) and not flags & F_PENDING


def test_a_confirm_into_a_walked_entry_drops_its_memos_and_segments() -> None:
    """The restarted view first lacks the tail at the end: lookups answer one LCM block short
    (memoised, and the runs certified). The tail's report arrives: the next lookup is whole."""
    prompts = _prompts()[:1]
    hs = prompts[0]
    old = _old(prompts)
    lay = old.layout
    reports = reports_of(old)
    last = len(hs) - 1
    tail_at_end = [r for r in reports if r.depth == last and r.column == "c4.tail"]
    assert len(tail_at_end) == 1
    new = _restarted(old, [r for r in reports if r not in tail_at_end])
    req = LookupRequest(hs)
    short = [new.lookup(req) for _ in range(3)]
    assert {m.usable_tokens for m in short} == {(len(hs) * lay.hash_block - 1) // lay.lcm * lay.lcm}
    assert new.counters.events["lookup_memo_hit"] >= 1  # the answer was memoised
    assert new.index[hs[0]].memos  # and the runs certified through the entries
    new.confirm(S0, tail_at_end, new.owners[S0].incarnation)
    assert _answer(new.lookup(req)) == _answer(old.lookup(req))
    assert new.lookup(req).usable_tokens == len(hs) * lay.hash_block


@pytest.mark.parametrize("by_runs", [False, True], ids=["blockwise", "segments"])
def test_a_walk_that_cannot_summarise_stops_at_a_pending_entry(by_runs: bool) -> None:
    prompts = _prompts()[:1]
    hs = prompts[0]
    old = _old(prompts)
    new = _restarted(old, reports_of(old))
    data = PackedHashes.of(hs).data
    size = 64 if by_runs else 1
    entries, _ = segments.walk(new.index, data, len(hs), 1, size)  # no layout: no summary
    assert entries == []
    entries, _ = segments.walk(new.index, data, len(hs), 1, size, new.layout)  # no alignments
    assert entries == []
    assert new.index[hs[0]].flags == F_PENDING  # left as it was
    entries, _ = segments.walk(new.index, data, len(hs), 1, size, new.layout, new._tables.align_of)
    assert [e.block_hash for e in entries] == hs
