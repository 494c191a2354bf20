"""The lookup memo answers a repeated long lookup without walking, and never answers once
anything on its path changed: each case below makes a memo, changes one thing, and checks
that the next answer equals a fresh walk of the same state (memo off)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import replace

import pytest

from hkv_service.core import lookups
from hkv_service.core.api import AllocRequest, LookupRequest, Match, Params, StateConfig
from hkv_service.core.errors import BadHash, IllegalTransition, MisplacedHash
from hkv_service.core.ids import BlockHash, ObjectId, PackedHashes, ShardId
from hkv_service.core.records import _PRUNE_AT
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes, question

N = 40  # >= the memo's default minimum of 32 blocks
S0, S1 = ShardId("s0"), ShardId("s1")
Ids = dict[tuple[int, str], ObjectId]


def _state(**memo: int) -> CacheState:
    st = CacheState(default_spec(), StateConfig(**memo))
    st.register_owner(S0, pools_for(st.layout, 2 * N + 8))
    return st


def _fresh(st: CacheState, req: LookupRequest) -> Match:
    """``req`` walked afresh, block by block: the memo and walk segments off."""
    capacity, st.memo.capacity = st.memo.capacity, 0
    config = st.config
    st.config = replace(config, segment_blocks=0)
    try:
        return st.lookup(req)
    finally:
        st.memo.capacity = capacity
        st.config = config


def _same(a: Match, b: Match) -> bool:
    cols = {k: (c.records, c.strides, c.shard_names) for k, c in a.columns.items()}
    return (a.usable_tokens, a.matched_tokens, a.downgrades, cols) == (
        b.usable_tokens, b.matched_tokens, b.downgrades,
        {k: (c.records, c.strides, c.shard_names) for k, c in b.columns.items()})


def _memoised(st: CacheState, req: LookupRequest) -> Match:
    """Look ``req`` up until the memo answers (by the third time); returns that answer."""
    st.lookup(req)
    st.lookup(req)
    hits = st.memo.hits
    m = st.lookup(req)
    assert st.memo.hits == hits + 1, "the third lookup of a complete walk is a memo hit"
    return m


@pytest.fixture
def prefix() -> tuple[CacheState, list[BlockHash], Ids]:
    st = _state()
    hs = prompt_hashes(st.spec, N)
    return st, hs, commit_prefix(st, hs)


def test_repeated_lookup_is_answered_from_the_memo(prefix) -> None:
    st, hs, _ = prefix
    req = LookupRequest(hs)
    first = st.lookup(req)
    assert first.usable_tokens == N * 64 and len(st.memo) == 0  # seen once: no memo yet
    st.lookup(req)
    assert len(st.memo) == 1
    hits_before = st.counters.lookups["hit"]
    m = _memoised(st, req)
    assert st.counters.lookups["hit"] == hits_before + 3  # a memo hit still counts as a hit
    assert _same(m, first) and _same(m, _fresh(st, req))


def _evict_middle(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    st.evict(ids[(N // 2, "c4")])


def _tail_restarts(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    (a,) = st.allocate(hs, [AllocRequest(N - 1, "c4.tail")])
    st.evict(a.handle.object_id)
    (b,) = st.allocate(hs, [AllocRequest(N - 1, "c4.tail")])
    st.transition(b.handle.object_id, Event.TAIL_APPEND, Params(tail_len=1))


def _indexer_rewritten(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    """The indexer of depth 3 is written again and not synced yet: not usable."""
    st.evict(ids[(3, "idx")])
    (a,) = st.allocate(hs, [AllocRequest(3, "idx")])
    st.transition(a.handle.object_id, Event.WRITE_DONE)


def _finish_tail(st: CacheState, hs: list[BlockHash]) -> None:
    (a,) = st.allocate(hs, [AllocRequest(N - 1, "c4.tail")])
    need = st.layout.columns[a.handle.column].tail_tokens_at(N * st.layout.hash_block)
    st.transition(a.handle.object_id, Event.TAIL_DONE, Params(tail_len=need))


def _owner_lost(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    st.mark_owner_lost(S0)


def _offloaded_and_evicted(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    for col in ("c4", "idx"):  # the KV and its indexer: evicting one takes the other along
        h = st.begin_offload(ids[(5, col)], S0)
        st.transition(h.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(ids[(5, "c4")])  # served from disk now: the handles are the disk copies'


def _new_owner(st: CacheState, hs: list[BlockHash], ids: Ids) -> None:
    st.register_owner(S1, pools_for(st.layout, 8))  # the stride table grows


CHANGES = [_evict_middle, _tail_restarts, _indexer_rewritten, _owner_lost, _offloaded_and_evicted,
           _new_owner]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("handles", [True, False], ids=["handles", "match_only"])
def test_any_change_on_the_path_drops_the_memo(prefix, change, handles: bool) -> None:
    st, hs, ids = prefix
    req = LookupRequest(hs, handles=handles)
    before = _memoised(st, req)
    change(st, hs, ids)
    hits = st.memo.hits
    after = st.lookup(req)
    assert st.memo.hits == hits, "answered from a memo computed before the change"
    assert _same(after, _fresh(st, req))
    if change is not _new_owner:
        assert not _same(after, before) or not handles


def test_change_off_the_path_keeps_the_memo(prefix) -> None:
    st, hs, _ = prefix
    req = LookupRequest(hs)
    _memoised(st, req)
    other = prompt_hashes(st.spec, 4, seed=7)
    commit_prefix(st, other)  # another prompt: nothing on hs's path changes
    hits = st.memo.hits
    assert _same(st.lookup(req), _fresh(st, req)) and st.memo.hits == hits + 1


def test_same_last_hash_other_prefix_is_not_a_hit(prefix) -> None:
    """A memo keyed by (last hash, count) must still compare the whole prefix: a request
    whose early hash differs gets the walk's answer (a miss at that block)."""
    st, hs, _ = prefix
    _memoised(st, LookupRequest(hs))
    forged = [BlockHash(b"\x00" * 16), *hs[1:]]
    m = st.lookup(LookupRequest(forged))
    assert m.usable_tokens == 0 and _same(m, _fresh(st, LookupRequest(forged)))


def refuses_same_bytes_malformed(st: CacheState, hs: list[BlockHash]) -> None:
    """Hashes whose bytes join to ``hs``'s (15 + 17 bytes first) are refused, changing
    nothing, whatever was kept for ``hs`` (a memo, walk segments)."""
    joined = b"".join(hs)
    odd = [BlockHash(joined[:15]), BlockHash(joined[15:32]), *hs[2:]]
    stats = st.stats()
    with pytest.raises(BadHash, match="16 bytes"):
        st.lookup(LookupRequest(odd))
    assert st.stats() == stats


def test_malformed_hashes_are_refused_even_when_a_memo_matches_their_bytes(prefix) -> None:
    st, hs, _ = prefix
    _memoised(st, LookupRequest(hs))
    refuses_same_bytes_malformed(st, hs)


def test_packed_and_listed_hashes_get_the_same_answer(prefix) -> None:
    st, hs, _ = prefix
    packed = PackedHashes(b"".join(hs))
    assert packed == hs and len(packed) == N and packed[-1] == hs[-1]
    a = _memoised(st, LookupRequest(packed))
    assert _same(a, st.lookup(LookupRequest(hs)))
    assert st.memo.hits >= 2  # the listed request found the packed one's memo
    with pytest.raises(BadHash, match="multiple of 16"):
        PackedHashes(b"x" * 33)


def test_leased_lookup_from_the_memo_pins(prefix) -> None:
    st, hs, ids = prefix
    _memoised(st, LookupRequest(hs, lease_ttl_s=5))
    m = st.lookup(LookupRequest(hs, lease_ttl_s=5))
    assert m.lease_id is not None
    with pytest.raises(IllegalTransition, match="leased"):
        st.evict(ids[(1, "c4")])
    for lease in list(st.leases.leases):
        st.release_lease(lease)
    st.evict(ids[(1, "c4")])
    assert st.lookup(LookupRequest(hs, lease_ttl_s=5)).usable_tokens < N * 64


def test_resume_and_alignment_are_part_of_the_key(prefix) -> None:
    st, hs, _ = prefix
    full = _memoised(st, LookupRequest(hs))
    short = st.lookup(LookupRequest(hs, resume_tokens=16 * 64))
    assert short.usable_tokens == 16 * 64 < full.usable_tokens
    aligned = st.lookup(LookupRequest(hs, alignment=1 << 20))
    assert _same(aligned, _fresh(st, LookupRequest(hs, alignment=1 << 20)))


def test_table_and_entry_lists_stay_bounded() -> None:
    st = _state(memo_capacity=3, memo_max_bytes=1 << 30)
    chains = [prompt_hashes(st.spec, N, seed=s) for s in range(6)]
    for hs in chains:
        commit_prefix(st, hs)
        _memoised(st, LookupRequest(hs))
    assert len(st.memo) == 3  # least recently used went first
    hs = chains[-1]
    for _ in range(20):  # a hot prefix whose tail keeps changing: memos made and dropped
        _memoised(st, LookupRequest(hs))
        _tail_restarts(st, hs, {})
        _finish_tail(st, hs)
    root = st.index[hs[0]]
    assert root.memos is not None and len(root.memos) <= _PRUNE_AT
    small = _state(memo_max_bytes=1024)  # a 40-block match is bigger: never kept
    commit_prefix(small, chains[0])
    for _ in range(3):
        small.lookup(LookupRequest(chains[0]))
    assert len(small.memo) == 0 and small.memo.nbytes == 0


def test_short_lookups_are_not_memoised(prefix) -> None:
    st, hs, _ = prefix
    for _ in range(3):
        st.lookup(LookupRequest(hs[:8]))
    assert len(st.memo) == 0


def test_disk_copy_at_rest_is_served_the_same(prefix) -> None:
    """A memo taken while a column is served from a disk copy at rest, then the copy is
    loaded: the load is a change on the path, so the next answer is fresh."""
    st, hs, ids = prefix
    _offloaded_and_evicted(st, hs, ids)
    req = LookupRequest(hs)
    _memoised(st, req)
    disk = next(r for r in st.objects.values() if r.state is State.ON_DISK)
    st.begin_load(disk.object_id, S0)
    hits = st.memo.hits
    assert _same(st.lookup(req), _fresh(st, req)) and st.memo.hits == hits


@pytest.mark.parametrize("questions", [False, True], ids=["repeated", "questions"])
@pytest.mark.parametrize("segments", [0, 4], ids=["blockwise", "segments"])
def test_concurrent_churn_never_serves_a_stale_handle(questions: bool, segments: int) -> None:
    """Threads look a hot prefix up (leased, so each handle can be checked while pinned), or
    ask new questions over it, while another evicts and rewrites objects on its path: every
    handle a memo-answered or walked lookup returns (over certified runs too) is live under
    its lease, and the final answers are a fresh walk's."""
    st = _state(segment_blocks=segments)
    hs = prompt_hashes(st.spec, N)
    commit_prefix(st, hs)
    asked = ([LookupRequest(_asking(hs, seed), lease_ttl_s=5) for seed in range(5)]
             if questions else [LookupRequest(hs, lease_ttl_s=5)])
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            # 60 lookups, more (bounded) until the memo answered one: on a loaded host the
            # churn can invalidate it between every lookup of the first 60
            for i in range(600):
                if i >= 60 and st.memo.hits > 0:
                    break
                m = st.lookup(asked[i % len(asked)])
                for column in m.handles.values():
                    for h in column:
                        st.check_read(h, m.lease_id)
                if m.lease_id is not None:
                    st.release_lease(m.lease_id)
        except BaseException as exc:  # reported below, with the thread's traceback
            errors.append(exc)

    def churn() -> None:
        depth = 0
        while not stop.is_set():
            depth = (depth + 7) % N
            # leased right now, or already gone: the policy keeps it
            with contextlib.suppress(IllegalTransition, AttributeError, KeyError):
                st.evict(st.index[hs[depth]].mem[0].object_id)  # type: ignore[union-attr]
            commit_prefix(st, hs)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    mutator = threading.Thread(target=churn)
    mutator.start()
    for t in readers:
        t.start()
    for t in readers:
        t.join(120)
    stop.set()
    mutator.join(30)
    assert not errors, errors[0]
    assert st.memo.hits > 0  # the memo answered some of them
    for req in asked:
        final = st.lookup(replace(req, lease_ttl_s=0))
        assert _same(final, _fresh(st, replace(req, lease_ttl_s=0)))


# ---- a walk that stops at a miss answers what its prefix alone would -------------------------

def _asking(hs: list[BlockHash], seed: int, n: int = 6) -> list[BlockHash]:
    """A new question over the cached prefix ``hs``: blocks the cache never held after it."""
    return question(hs, seed, n)


def test_questions_over_a_cached_prefix_share_its_memo(prefix) -> None:
    st, hs, _ = prefix
    for seed in (1, 2):  # the first stop at the prefix is remembered, the second keeps it
        m = st.lookup(LookupRequest(_asking(hs, seed)))
        assert m.matched_tokens == N * 64 and m.memo is None
    assert len(st.memo) == 1
    for seed in (3, 4):  # new questions: walked to the miss, then answered from the memo
        hits = st.memo.hits
        req = LookupRequest(_asking(hs, seed))
        m = st.lookup(req)
        assert st.memo.hits == hits + 1 and m.memo is not None and not m.repeatable
        assert _same(m, _fresh(st, req))
    # the prefix on its own is the same key: its lookup is answered by that memo too
    direct = st.lookup(LookupRequest(hs))
    assert direct.memo is not None and direct.repeatable


def test_a_written_block_past_the_stop_lengthens_the_answer(prefix) -> None:
    """The prefix's memo stands (nothing on its path changed) but the request's next block
    now exists: the walk goes past the old stop, and the answer is the longer one."""
    st, hs, _ = prefix
    longer = _asking(hs, seed=9)
    for _ in range(3):
        st.lookup(LookupRequest(longer))
    commit_prefix(st, longer)
    m = st.lookup(LookupRequest(longer))
    assert m.matched_tokens == len(longer) * 64 and _same(m, _fresh(st, LookupRequest(longer)))


def test_a_stop_at_an_unready_block_is_not_the_prefixs_answer(prefix) -> None:
    """The walk stops where the block is there but not ready: the answer carries that
    reason, so the prefix's memo (which has no such downgrade) must not answer it."""
    st, hs, _ = prefix
    longer = _asking(hs, seed=11)
    st.allocate(longer, [AllocRequest(N, "c4")])  # allocated, never written
    for _ in range(2):
        st.lookup(LookupRequest(hs))  # the prefix's own memo
    for _ in range(3):
        m = st.lookup(LookupRequest(longer))
        assert m.memo is None and m.downgrades and _same(m, _fresh(st, LookupRequest(longer)))


def test_a_question_over_a_memoised_prefix_is_answered_without_a_walk(prefix, monkeypatch
                                                                      ) -> None:
    st, hs, _ = prefix
    for seed in (1, 2):
        st.lookup(LookupRequest(_asking(hs, seed)))
    walks: list[int] = []
    real = lookups.run_funnel
    monkeypatch.setattr(lookups, "run_funnel", lambda *a: walks.append(1) or real(*a))
    req = LookupRequest(_asking(hs, 3))
    m = st.lookup(req)
    assert not walks and m.memo is not None and not m.repeatable
    assert _same(m, _fresh(st, req)) and walks  # (the fresh one walked)


def test_a_malformed_hash_at_the_stop_is_refused(prefix) -> None:
    """The prefix's memo would answer, but the walk would refuse the malformed hash it stops
    at; so must the memo path, and change nothing."""
    st, hs, _ = prefix
    for seed in (1, 2):
        st.lookup(LookupRequest(_asking(hs, seed)))
    stats = st.stats()
    with pytest.raises(BadHash, match="16 bytes"):
        st.lookup(LookupRequest([*hs, BlockHash(b"x" * 15)]))
    assert st.stats() == stats


@pytest.mark.parametrize("open_end", [False, True])
def test_a_range_of_a_split_chain_is_memoised_and_dropped_like_a_chain(open_end: bool) -> None:
    """A range lookup (a chain split across partitions: blocks [R, 2R) asked alone) is
    answered from its own memo when repeated, never from a whole chain's nor another
    range's, and not once anything on its range changed."""
    r = N  # >= the memo's minimum
    st = CacheState(default_spec(), StateConfig(range_blocks=r))
    st.register_owner(S0, pools_for(st.layout, 2 * N + 8))
    hs = prompt_hashes(st.spec, 2 * r)
    ids = commit_prefix(st, hs[r:], first_block=r)
    req = LookupRequest(hs[r:], first_block=r, open_end=open_end)
    m = _memoised(st, req)
    assert _same(m, _fresh(st, req)) and m.usable_tokens == 2 * r * 64
    assert m.memo is not None and m.repeatable
    assert st.replay(m.memo)
    other = LookupRequest(hs[r:], first_block=r, open_end=not open_end)
    assert _same(st.lookup(other), _fresh(st, other))  # another key
    with pytest.raises(MisplacedHash):  # the same hashes said to start at block 0, up to
        st.lookup(LookupRequest(hs[r:], open_end=True,  # the same limit: refused, never
                                resume_tokens=2 * r * 64))  # the range's memo
    assert st.lookup(LookupRequest(hs[r:], first_block=r, open_end=open_end,
                                   resume_tokens=(r + 8) * 64)).usable_tokens == (r + 8) * 64
    st.transition(ids[(r + 3, "c4")], Event.EVICT)
    assert not m.memo.live and not st.replay(m.memo)  # its range changed: dropped
    after = st.lookup(req)
    assert _same(after, _fresh(st, req)) and after.usable_tokens < 2 * r * 64
