"""Rebuilding the state view after a service restart: ``CacheState.confirm``.

The view is rebuilt only from what owners vouch for (DESIGN: "never from guesses: until an
object is re-confirmed it is not a hit"; RELIABILITY row 5). What is pinned down here:

* a report in a state that is not at rest (being written, in transit, loaded, terminal) is
  skipped: never counted, never a hit, the view unchanged;
* an SWA object's valid range comes back exactly as reported and never beyond its block;
* a malformed batch (unknown group, bad hash chain, a state of another kind, an SWA range
  outside its block) or one from an owner that is not registered or was declared lost is
  refused with the matching error and changes nothing: all or nothing;
* (property) after any subset of a prefix's objects is re-confirmed, a lookup hits exactly
  where every object a reader needs was re-confirmed, and its handles point at the
  re-confirmed blocks.

An :class:`ObjectReport` carries no ABI fingerprint: a column's ABI is fixed by the spec the
service runs with, so the reader's ABI is what is checked, on every lookup (tested below).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkv_service.core import tree
from hkv_service.core.allocator import SWA_LANE_BITS
from hkv_service.core.api import AllocRequest, LookupRequest, ObjectReport, Params
from hkv_service.core.errors import BadHash, HkvError, InvalidInput, UnknownGroup, UnknownOwner
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.records import PrefixEntry
from hkv_service.core.spec import CacheSpec, GroupKind
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, Reason, State
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes
from tests.helpers import reports_of

_reports = functools.partial(reports_of, ordered=True)  # (sorted: deterministic)
S0 = ShardId("s0")
_LAYOUT = Layout(default_spec())
COLUMNS = tuple(c.name for c in _LAYOUT.columns)  # c4, c128, swa, idx, c4.tail
KIND_OF = {c.name: c.kind for c in _LAYOUT.columns}

# At rest: the readable state of each memory kind, and a disk copy whose LMDB write committed.
READY_OF = {
    Kind.COMPRESSED: State.COMPRESSED_READY,
    Kind.TAIL: State.TAIL_COMPLETE,
    Kind.SWA: State.SWA_VALID,
    Kind.INDEXER: State.INDEXER_SYNCED,
    Kind.STATE: State.STATE_READY,
}
AT_REST = frozenset(READY_OF.values()) | {State.ON_DISK}
NOT_AT_REST = [s for s in State if s not in AT_REST]


# ---- builders -------------------------------------------------------------------------------


def _inc(st: CacheState, owner: ShardId = S0) -> int:
    """The incarnation ``owner``'s last registration returned (what a confirm must carry)."""
    return st.owners[owner].incarnation


def _old(spec: CacheSpec, prefixes: Sequence[Sequence[BlockHash]]) -> CacheState:
    """The view before the restart: every object of ``prefixes`` written to READY."""
    old = CacheState(spec)
    old.register_owner(S0, pools_for(old.layout, 64))
    for hs in prefixes:
        commit_prefix(old, hs)
    return old


def _fresh(spec: CacheSpec) -> CacheState:
    """The restarted service: the owner registered again, nothing confirmed yet."""
    new = CacheState(spec)
    new.register_owner(S0, pools_for(new.layout, 64))
    return new


def _view(st: CacheState) -> tuple[object, ...]:
    """Everything a confirm may change: records, entries, pools, owners, log and counters."""
    objects = sorted(
        (r.object_id, r.kind, r.state, r.shard, r.block, r.generation, r.version, r.lo, r.hi,
         r.entry.block_hash)
        for r in st.objects.values()
    )
    entries = sorted(
        (h, e.depth, e.parent.block_hash if e.parent else None, e.children, e.flags, e.gate)
        for h, e in st.index.items()
    )
    pools = {
        (s, c): (tuple(p.free), sorted(
            (b, g, r.object_id if r is not None else None) for b, g, r in p.books()))
        for s, o in st.owners.items() for c, p in o.pools.items()
    }
    owners = {s: (o.incarnation, o.alive) for s, o in st.owners.items()}
    return objects, entries, pools, owners, tuple(st.log), st.stats()


def _hit(st: CacheState, hs: Sequence[BlockHash], resume: int | None = None) -> int:
    return st.lookup(LookupRequest(hs, resume_tokens=resume)).usable_tokens


# ---- 1. only objects at rest come back --------------------------------------------------------


def test_the_state_lists_agree_with_the_recovery_contracts() -> None:
    """The parametrisation below covers every state the enum has, each exactly once."""
    from hkv_service.core.contracts import CONTRACTS

    readable = {s for k, c in CONTRACTS.items() if k is not Kind.DISK for s in c.ready_states}
    assert readable == set(READY_OF.values())
    assert set(NOT_AT_REST) | AT_REST == set(State) and not set(NOT_AT_REST) & AT_REST
    assert State.ON_DISK_READY in NOT_AT_REST  # a loaded copy's memory died with the old view


@pytest.mark.parametrize("column", COLUMNS)
@pytest.mark.parametrize("state", NOT_AT_REST, ids=str)
def test_a_report_not_at_rest_is_skipped(spec: CacheSpec, state: State, column: str) -> None:
    """Every report of ``column`` in a transient (or terminal) state: none is re-created, none
    is counted, nothing else changes, and the prefix is not a hit because of that column."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    others = [r for r in reports if r.column != column]
    transient = [replace(r, state=state) for r in reports if r.column == column]
    assert transient and others

    new = _fresh(spec)
    assert new.confirm(S0, others, _inc(new)) == len(others)
    before = _view(new)
    assert new.confirm(S0, transient, _inc(new)) == 0
    assert _view(new) == before
    m = new.lookup(LookupRequest(hs))
    assert m.usable_tokens == 0
    assert column in {d.group for d in m.downgrades}  # the skipped column is what is missing

    mixed = _fresh(spec)  # in one call with at-rest reports: only those are counted
    assert mixed.confirm(S0, transient + others, _inc(mixed)) == len(others)
    assert all(mixed.layout.columns[r.column].name != column for r in mixed.objects.values())
    assert _hit(mixed, hs) == 0
    # control: the skip left the slots and blocks untouched, the real reports still fit
    same_column = [r for r in reports if r.column == column]
    assert mixed.confirm(S0, same_column, _inc(mixed)) == len(transient)
    assert _hit(mixed, hs) == 256


@pytest.mark.parametrize("state", NOT_AT_REST, ids=str)
def test_a_transient_report_alone_leaves_an_empty_view_empty(spec: CacheSpec,
                                                             state: State) -> None:
    hs = prompt_hashes(spec, 4)
    reports = [replace(r, state=state) for r in _reports(_old(spec, [hs]))]
    new = _fresh(spec)
    before = _view(new)
    assert new.confirm(S0, reports, _inc(new)) == 0
    assert _view(new) == before
    assert len(new.objects) == 0 and not new.index
    m = new.lookup(LookupRequest(hs))
    assert m.usable_tokens == 0 and m.matched_tokens == 0


def test_disk_copies_come_back_at_rest_and_need_a_load(spec: CacheSpec) -> None:
    """ON_DISK reports re-create copies at rest: usable only after a load (handles with no
    block), never READY without the load's checksum pass; a report of the loaded copy
    (ON_DISK_READY) or of a load in flight is not re-created."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    for state in (State.ON_DISK_READY, State.ON_DISK_INFLIGHT, State.OFFLOADING):
        assert new.confirm(S0, [replace(r, state=state, block=-1) for r in reports], _inc(new)) == 0
    assert len(new.objects) == 0
    at_rest = [replace(r, state=State.ON_DISK, block=-1, generation=0) for r in reports]
    assert new.confirm(S0, at_rest, _inc(new)) == len(reports)
    assert {(r.kind, r.state) for r in new.objects.values()} == {(Kind.DISK, State.ON_DISK)}
    m = new.lookup(LookupRequest(hs))
    assert m.usable_tokens == 256 and m.needs_load
    assert all(h.block < 0 for hs_ in m.handles.values() for h in hs_)
    before = _view(new)
    assert new.confirm(S0, [replace(r, state=State.ON_DISK_READY) for r in at_rest], _inc(new)) == 0
    assert _view(new) == before


def test_every_recreated_object_is_logged_and_counted_in_order(spec: CacheSpec) -> None:
    """A Watch subscriber sees each re-created object once, in the order they were applied
    (parents before children), with the state it came back in; skipped reports are not seen.
    Memory objects and disk copies alike."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    seq = new.events_since(0)[-1].seq if new.events_since(0) else 0
    disk = [replace(r, state=State.ON_DISK, block=-1, generation=0) for r in reports[:3]]
    skipped = [replace(reports[3], state=State.WRITING)]
    ids = new.confirm_objects(S0, [*reversed(reports), *skipped, *disk], _inc(new))
    events = new.events_since(seq)
    made = {i for i in ids if i is not None}
    assert [e.object_id for e in events if e.object_id in made] == [e.object_id for e in events]
    assert sorted(e.object_id for e in events) == sorted(made)
    assert [e.seq for e in events] == list(range(seq + 1, seq + 1 + len(events)))
    by_id = {r.object_id: r for r in new.objects.values()}
    assert all((e.kind, e.state, e.column) == (by_id[e.object_id].kind, by_id[e.object_id].state,
                                              new.layout.columns[by_id[e.object_id].column].name)
               for e in events)
    depths = [by_id[e.object_id].entry.depth for e in events]
    assert depths == sorted(depths)  # applied (and so logged) parents first
    counted = sum(n for (_, st_), n in new.counters.transitions.items()
                  if st_ in (*READY_OF.values(), State.ON_DISK))
    assert counted == len(made) == len(reports) + len(disk)  # (the WRITING one skipped)


# ---- 2. SWA ranges never widen ---------------------------------------------------------------


def test_a_partial_swa_range_comes_back_exactly(spec: CacheSpec) -> None:
    """The SWA block at depth 2 holds tokens [160, 192) of [128, 192) only: before and after
    the restart, resuming at 256 (window [128, 256)) is refused and falls back to 128, while
    384 (window [256, 384)) does not need that block at all."""
    hs = prompt_hashes(spec, 6)
    old = CacheState(spec)
    old.register_owner(S0, pools_for(old.layout, 64))
    commit_prefix(old, hs, skip=frozenset({(2, "swa")}))
    (a,) = old.allocate(hs, [AllocRequest(2, "swa")])
    old.transition(a.handle.object_id, Event.WRITE_DONE, Params(lo=160, hi=192))
    positions = (128, 256, 384)
    before = {p: _hit(old, hs, p) for p in positions}
    assert before == {128: 128, 256: 128, 384: 384}

    new = _fresh(spec)
    reports = _reports(old)
    assert new.confirm(S0, reports, _inc(new)) == len(reports)
    swa = {r.entry.depth: (r.lo, r.hi) for r in new.objects.values() if r.kind is Kind.SWA}
    assert swa[2] == (160, 192)
    assert swa == {d: (d * 64, d * 64 + 64) for d in range(6)} | {2: (160, 192)}
    assert {p: _hit(new, hs, p) for p in positions} == before
    m = new.lookup(LookupRequest(hs, resume_tokens=256))
    assert Reason.SWA_WINDOW_INCOMPLETE in {d.reason for d in m.downgrades}


_BAD_SWA_RANGES = {  # for the SWA block at depth 2, tokens [128, 192)
    "a whole window in one block": (64, 192),
    "below its block": (0, 192),
    "past its block": (128, 256),
    "negative lo": (-64, 192),
    "lo > hi": (192, 128),
    "lo > hi inside the block": (170, 150),
}


@pytest.mark.parametrize("state", [State.SWA_VALID, State.ON_DISK], ids=str)
@pytest.mark.parametrize("lo_hi", _BAD_SWA_RANGES.values(), ids=_BAD_SWA_RANGES.keys())
def test_an_swa_range_beyond_its_block_is_refused(spec: CacheSpec, state: State,
                                                  lo_hi: tuple[int, int]) -> None:
    """Regression: confirm stored any (lo, hi) an owner reported, e.g. (-1000, 10**6), a range
    no transition could ever set (WRITE_DONE requires start <= lo <= hi <= end); the record
    then claimed tokens its block cannot hold, carried the claim into its disk copies, and
    every later rewrite of the block was refused as "would shrink the valid range"."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    bad = [replace(r, state=state, lo=lo_hi[0], hi=lo_hi[1])
           for r in reports if r.column == "swa" and r.depth == 2]
    new = _fresh(spec)
    before = _view(new)
    with pytest.raises(InvalidInput, match=r"SWA .*\[128, 192\)"):
        new.confirm(S0, reports + bad, _inc(new))
    assert _view(new) == before
    assert _hit(new, hs) == 0


@pytest.mark.parametrize("state", [State.TAIL_COMPLETE, State.ON_DISK], ids=str)
@pytest.mark.parametrize("delta", [-1, 1])
def test_a_complete_tail_of_another_length_is_refused(spec: CacheSpec, state: State,
                                                      delta: int) -> None:
    """Regression: confirm took a complete tail's length as reported, while TAIL_DONE demands
    exactly the raw tokens the boundary needs; a tail vouched for one token short would be
    read as whole."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    tail = next(r for r in reports if r.column == "c4.tail" and r.depth == 1)
    bad = replace(tail, state=state, hi=tail.hi + delta)
    new = _fresh(spec)
    before = _view(new)
    with pytest.raises(InvalidInput, match=rf"needs exactly {tail.hi}\b"):
        new.confirm(S0, [r for r in reports if r is not tail] + [bad], _inc(new))
    assert _view(new) == before
    assert _hit(new, hs) == 0
    assert new.confirm(S0, reports, _inc(new)) == len(reports)  # the right length is fine


def test_an_empty_or_whole_block_range_is_accepted(spec: CacheSpec) -> None:
    """The bounds are inclusive: [start, end) and an empty range inside the block are fine."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    edge = [replace(r, lo=r.hi, hi=r.hi) if r.column == "swa" and r.depth == 0 else r
            for r in reports]
    assert new.confirm(S0, edge, _inc(new)) == len(edge)
    assert _hit(new, hs, 128) == 0  # [64, 64) at depth 0 covers nothing a reader at 128 needs
    assert _hit(new, hs, 256) == 256  # the window at 256 starts at 128
    rec = next(r for r in new.objects.values() if r.kind is Kind.SWA and r.entry.depth == 0)
    (fresh,) = new.allocate(hs, [AllocRequest(0, "swa", replace=rec.object_id)])  # replaceable
    new.transition(fresh.handle.object_id, Event.WRITE_DONE, Params(lo=0, hi=64))
    assert _hit(new, hs, 128) == 128


# ---- 3. refused reports change nothing ---------------------------------------------------------

Build = Callable[[list[BlockHash], list[BlockHash], BlockHash], ObjectReport]

_REFUSED: dict[str, tuple[Build, type[HkvError]]] = {
    "unknown group": (
        lambda a, b, x: ObjectReport(x, None, 0, "c5", State.COMPRESSED_READY, block=63),
        UnknownGroup),
    "15-byte hash": (
        lambda a, b, x: ObjectReport(BlockHash(x[:15]), None, 0, "c4", State.COMPRESSED_READY,
                                     block=63),
        BadHash),
    "root with a parent": (
        lambda a, b, x: ObjectReport(x, a[0], 0, "c4", State.COMPRESSED_READY, block=63, version=1),
        InvalidInput),
    "child without a parent": (
        lambda a, b, x: ObjectReport(x, None, 1, "c4", State.COMPRESSED_READY, block=63, version=1),
        InvalidInput),
    "parent known at another depth": (
        lambda a, b, x: ObjectReport(x, a[0], 3, "c4", State.COMPRESSED_READY, block=63, version=1),
        BadHash),
    "hash known at another depth": (
        lambda a, b, x: ObjectReport(a[1], x, 2, "c4", State.COMPRESSED_READY, block=63, version=1),
        BadHash),
    "hash known with another parent": (
        lambda a, b, x: ObjectReport(a[2], b[1], 2, "c4", State.COMPRESSED_READY, block=63,
                                     version=1),
        BadHash),
    "a ready state of another kind": (
        lambda a, b, x: ObjectReport(x, None, 0, "swa", State.COMPRESSED_READY, block=63),
        InvalidInput),
    "an SWA range past its block": (
        lambda a, b, x: ObjectReport(x, None, 0, "swa", State.SWA_VALID, block=63, lo=0, hi=128),
        InvalidInput),
}


@pytest.mark.parametrize("where", ["batch", "index"])
@pytest.mark.parametrize("case", _REFUSED.values(), ids=_REFUSED.keys())
def test_a_malformed_report_refuses_the_whole_call(
    spec: CacheSpec, case: tuple[Build, type[HkvError]], where: str
) -> None:
    """One bad report among good ones: the right error, and nothing of the call applied. With
    ``where="index"`` the bad report contradicts entries confirmed by an earlier call.

    Regression (hash-chain cases): the chain was checked while applying, so the reports
    sorted before the bad one were already re-created when BadHash was raised."""
    build, error = case
    a, b, c = (prompt_hashes(spec, 4, seed=s) for s in (1, 2, 3))
    x = prompt_hashes(spec, 1, seed=9)[0]
    reports = _reports(_old(spec, [a, b, c]))
    of_c = [r for r in reports if r.block_hash in set(c)]
    earlier = [r for r in reports if r not in of_c]
    new = _fresh(spec)
    if where == "index":
        assert new.confirm(S0, earlier, _inc(new)) == len(earlier)
        call = [*of_c, build(a, b, x)]
    else:
        call = [*reports, build(a, b, x)]
    before = _view(new)
    with pytest.raises(error):
        new.confirm(S0, call, _inc(new))
    assert _view(new) == before
    assert _hit(new, c) == 0
    assert _hit(new, a) == (256 if where == "index" else 0)


@pytest.mark.parametrize("column", COLUMNS)
def test_every_ready_state_of_another_kind_is_refused(spec: CacheSpec, column: str) -> None:
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    mine = [r for r in reports if r.column == column]
    new = _fresh(spec)
    before = _view(new)
    for state in set(READY_OF.values()) - {READY_OF[KIND_OF[column]]}:
        with pytest.raises(InvalidInput, match=column):
            new.confirm(S0, [replace(r, state=state) for r in mine], _inc(new))
        assert _view(new) == before
    # the right state for the kind is fine
    assert new.confirm(S0, reports, _inc(new)) == len(reports)


def test_a_restarted_owner_is_never_a_hit_after_a_report_of_another_kinds_state(
    spec: CacheSpec,
) -> None:
    """Regression: an SWA object confirmed as COMPRESSED_READY has no LOSE transition, so
    when its owner restarted (memory gone) and registered again, marking its objects LOST
    raised IllegalTransition half way: the owner could not re-register, and the view kept
    serving hits on memory the owner no longer had (a silent error)."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    assert new.confirm(S0, reports, _inc(new)) == len(reports)
    x = prompt_hashes(spec, 1, seed=9)[0]
    with contextlib.suppress(InvalidInput):  # refused today; either way the owner comes back
        new.confirm(S0, [ObjectReport(x, None, 0, "swa", State.COMPRESSED_READY, block=63)],
                    _inc(new))
    new.register_owner(S0, pools_for(new.layout, 64))  # the owner restarted: memory is empty
    assert _hit(new, hs) == 0
    new.reap_all()  # (a lookup buries only what its walk reads)
    assert len(new.objects) == 0


def test_an_owner_that_is_not_registered_is_refused(spec: CacheSpec) -> None:
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    before = _view(new)
    with pytest.raises(UnknownOwner, match="not registered"):
        new.confirm(ShardId("s1"), reports, 1)
    assert _view(new) == before
    assert _hit(new, hs) == 0


def test_an_owner_declared_lost_must_register_again_before_confirming(spec: CacheSpec) -> None:
    """Regression: confirm took reports from an owner the view had marked lost (heartbeat
    timeout, a failed call), re-creating hits on memory it had just declared gone, on an owner
    nothing may allocate on and whose heartbeats are refused."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    assert new.confirm(S0, reports[:5], _inc(new)) == 5
    assert new.mark_owner_lost(S0) == 5
    before = _view(new)
    with pytest.raises(UnknownOwner, match="re-register"):
        new.confirm(S0, reports, _inc(new))
    assert _view(new) == before
    assert _hit(new, hs) == 0
    new.register_owner(S0, pools_for(new.layout, 64))  # back (empty): its reports count again
    assert new.confirm(S0, reports, _inc(new)) == len(reports)
    assert _hit(new, hs) == 256


def test_a_confirm_from_an_earlier_incarnation_is_refused(spec: CacheSpec) -> None:
    """Regression: confirm carried no incarnation, so one sent before its owner registered
    again (still in flight, or retried) landed afterwards and vouched for memory the owner had
    dropped on re-registering: hits on blocks nothing had written (a silent error)."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    stale = _inc(new)
    new.register_owner(S0, pools_for(new.layout, 64))  # the owner came back empty meanwhile
    before = _view(new)
    with pytest.raises(UnknownOwner, match=f"incarnation {stale} is not current"):
        new.confirm(S0, reports, stale)
    assert _view(new) == before
    assert _hit(new, hs) == 0
    assert new.confirm(S0, reports, _inc(new)) == len(reports)  # its current self may
    assert _hit(new, hs) == 256


def test_a_reader_of_another_abi_never_hits_confirmed_objects(spec: CacheSpec) -> None:
    """Re-confirmed objects carry their column's ABI (the spec's): a reader expecting another
    ABI for any group gets ABI_MISMATCH and nothing, the right one gets the hit."""
    hs = prompt_hashes(spec, 4)
    reports = _reports(_old(spec, [hs]))
    new = _fresh(spec)
    assert new.confirm(S0, reports, _inc(new)) == len(reports)
    right = {g.name: g.abi.fingerprint() for g in spec.groups}
    for name, fp in right.items():
        m = new.lookup(LookupRequest(hs, reader_abi=right | {name: fp ^ 1}))
        assert m.usable_tokens == 0
        assert [(d.reason, d.group) for d in m.downgrades] == [(Reason.ABI_MISMATCH, name)]
    m = new.lookup(LookupRequest(hs, reader_abi=right))
    assert m.usable_tokens == 256
    by_name = {c.name: c for c in new.layout.columns}
    for name, handles in m.handles.items():
        assert {h.abi_fingerprint for h in handles} == {by_name[name].group.abi.fingerprint()}


# ---- 4. property: re-confirmed objects are exactly what hits ---------------------------------

_N_BLOCKS = 6
_L = _LAYOUT.lcm


def _needed(layout: Layout, p: int) -> set[tuple[int, str]]:
    """(depth, column) of every object a reader resuming at ``p`` needs, written from the
    design's table (not from the layout's own helper): every COMPRESSED and INDEXER block in
    [0, p), the SWA blocks meeting [p - W, p), and the tails at p."""
    hb, out = layout.hash_block, set()
    for col in layout.columns:
        g = col.group
        if col.kind is Kind.TAIL:
            out.add((p // hb - 1, col.name))
            continue
        low = max(0, p - g.window) if g.kind is GroupKind.SWA else 0
        for end in range(g.block_size, p + 1, g.block_size):
            if end > low:
                out.add((end // hb - 1, col.name))
    return out


_PROPERTY_SETTINGS = settings(max_examples=60, deadline=None,
                              suppress_health_check=[HealthCheck.function_scoped_fixture])


@_PROPERTY_SETTINGS
@given(data=st.data())
def test_exactly_the_reconfirmed_objects_are_reused(spec: CacheSpec, data: st.DataObject) -> None:
    hs = prompt_hashes(spec, _N_BLOCKS)
    reports = _reports(_old(spec, [hs]))
    n = len(reports)
    keep = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="keep")
    order = data.draw(st.permutations(range(n)), label="order")
    chosen = [reports[i] for i in order if keep[i]]
    split = data.draw(st.integers(0, len(chosen)), label="split")  # two owner calls

    new = _fresh(spec)
    inc = _inc(new)
    assert new.confirm(S0, chosen[:split], inc) + new.confirm(S0, chosen[split:], inc) \
        == len(chosen)
    by_key = {(r.depth, r.column): r for r in chosen}
    assert {(r.entry.depth, new.layout.columns[r.column].name) for r in new.objects.values()} \
        == set(by_key)

    pool_of = {name: new.owners[S0].pools[c] for name, c in new.layout.by_name.items()}
    for (_, column), r in by_key.items():  # each re-confirmed object holds its reported block
        rec = pool_of[column].owner_of(r.block)
        assert rec is not None and rec.entry.block_hash == r.block_hash
        assert rec.generation == r.generation
    for column, pool in pool_of.items():  # and no other block is taken
        taken = {r.block for (_, c), r in by_key.items() if c == column}
        assert {b for b, _, o in pool.books() if o is not None} == taken

    safe = [p for p in range(0, _N_BLOCKS * 64 + 1, _L)
            if p == 0 or _needed(new.layout, p) <= set(by_key)]
    for p in range(_L, _N_BLOCKS * 64 + 1, _L):
        expected = max(q for q in safe if q <= p)
        m = new.lookup(LookupRequest(hs, resume_tokens=p))
        assert m.usable_tokens == expected, (p, sorted(set(_needed(new.layout, p)) - set(by_key)))
        got = {
            (new.objects[h.object_id].entry.depth, h.group, h.block, h.generation, h.shard)
            for handles in m.handles.values() for h in handles
        }
        want = {(d, c, by_key[d, c].block, by_key[d, c].generation, S0)
                for d, c in (_needed(new.layout, expected) if expected else ())}
        assert got == want


# ---- 5. resume points counted in any order ---------------------------------------------------


def _lanes_from_scratch(st: CacheState) -> dict[BlockHash, tuple[int, ...]]:
    """Per entry, per SWA column, the complete resume points at most a window below it (the
    SWA eviction policy's count: a block no resume point's window reaches goes first),
    counted from the view as it stands. A resume point is complete when every memory object
    its entry needs is in its kind's ready state, tail or no tail."""
    lay = st.layout
    hb = lay.hash_block
    reach = [-(-lay.columns[c].group.window // hb) for c in lay.swa_columns]
    ready = {Kind.COMPRESSED: State.COMPRESSED_READY, Kind.SWA: State.SWA_VALID,
             Kind.INDEXER: State.INDEXER_SYNCED, Kind.TAIL: State.TAIL_COMPLETE}
    out = {h: [0] * len(reach) for h, _ in st.index.items()}
    for _, point in st.index.items():
        if (point.depth + 1) * hb % lay.lcm:
            continue
        needed = [c for c in range(len(lay.columns)) if lay.lives_at(c, point.depth)]
        if not all((r := point.mem[c]) is not None and r.state is ready[r.kind]
                   for c in needed):
            continue
        e: PrefixEntry | None = point
        k = 0
        while e is not None:
            for lane, r in enumerate(reach):
                out[e.block_hash][lane] += k < r
            e, k = e.parent, k + 1
    return {h: tuple(v) for h, v in out.items()}


def _lanes(st: CacheState) -> dict[BlockHash, tuple[int, ...]]:
    n = len(st.layout.swa_columns)
    mask = (1 << SWA_LANE_BITS) - 1
    got = {}
    for h, e in st.index.items():
        lanes = tuple(e.swa_need >> (SWA_LANE_BITS * i) & mask for i in range(n))
        assert e.swa_need == sum(c << (SWA_LANE_BITS * i) for i, c in enumerate(lanes)), \
            f"a lane of the entry at depth {e.depth} went below zero (swa_need {e.swa_need})"
        got[h] = lanes
    return got


@pytest.mark.parametrize("adopt_slice", [tree.ADOPT_SLICE, 1])
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resume_points_are_counted_whatever_order_reports_come_in(
        spec: CacheSpec, adopt_slice: int, monkeypatch: pytest.MonkeyPatch,
        data: st.DataObject) -> None:
    """A tail confirmed before the blocks above it (random order, its entry an orphan until
    its parent's report arrives) is counted on every entry within a window above it, as an
    in-order rebuild counts it; and when it later stops being a resume point, exactly that
    is taken back (a count taken back from entries it was never added to went below zero
    and borrowed from the next SWA column's lane). With orphans adopted one a lock hold, the
    counts are those of the links made so far at every step, and the in-order rebuild's
    once the reaper has adopted the rest."""
    monkeypatch.setattr(tree, "ADOPT_SLICE", adopt_slice)
    hs = prompt_hashes(spec, 8)
    old = _old(spec, [hs])
    reports = _reports(old)
    order = data.draw(st.permutations(range(len(reports))), label="order")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(reports)), max_size=3), label="cuts"))
    new = _fresh(spec)
    evicted = False
    for lo, hi in zip([0, *cuts], [*cuts, len(reports)], strict=True):
        new.confirm(S0, [reports[i] for i in order[lo:hi]], _inc(new))
        complete = sorted((r for r in new.objects.values() if r.kind is not Kind.DISK
                           and (r.entry.depth + 1) % new.layout.period == 0),
                          key=lambda r: (r.entry.depth, r.column))
        evict: bool = data.draw(st.booleans(), label="break a resume point before the next call")
        if complete and evict:
            new.evict(data.draw(st.sampled_from(complete), label="object").object_id)
            evicted = True
        assert _lanes(new) == _lanes_from_scratch(new)
    new.reap_all()  # (the orphans left to adopt in the reaper's slices)
    assert not new._tables.tree.orphans or evicted
    if not evicted:
        assert _lanes(new) == _lanes(old)
    tails = [r for r in new.objects.values() if r.kind is Kind.TAIL]
    for rec in data.draw(st.permutations(tails), label="evicted"):
        new.evict(rec.object_id)
        assert _lanes(new) == _lanes_from_scratch(new)


def _chain_reports(spec: CacheSpec, n: int) -> tuple[list[BlockHash], list[ObjectReport]]:
    hs = prompt_hashes(spec, n)
    return hs, _reports(_old(spec, [hs]))


def test_an_orphan_is_adopted_when_its_parents_report_arrives(spec: CacheSpec) -> None:
    """Block 3 confirmed alone, then blocks 0-2 in another call that names nothing of block
    3: block 3's entry has its parent all the same (it was left parentless for good, and
    block 2's entry, counting no child, could be dropped from under it)."""
    hs, reports = _chain_reports(spec, 4)
    new = _fresh(spec)
    new.confirm(S0, [r for r in reports if r.depth == 3], _inc(new))
    orphan = new.index[hs[3]]
    assert orphan.parent is None and orphan.awaits == hs[2]
    new.confirm(S0, [r for r in reports if r.depth < 3], _inc(new))
    assert orphan.parent is new.index[hs[2]] and new.index[hs[2]].children == 1
    assert not new._tables.tree.orphans
    assert _hit(new, hs) == _hit(_old(spec, [hs]), hs)


def test_an_orphan_named_under_another_parent_later_is_refused(spec: CacheSpec) -> None:
    """Hashes are chained across calls too: block 3 reported under block 2's hash, then (its
    parent still missing) under another hash, is refused whole, changing nothing."""
    _, reports = _chain_reports(spec, 4)
    new = _fresh(spec)
    tail = [r for r in reports if r.depth == 3]
    new.confirm(S0, tail[:1], _inc(new))
    before = _view(new)
    other = replace(tail[1], parent_hash=BlockHash(b"\x07" * 16))
    with pytest.raises(BadHash, match="another parent"):
        new.confirm(S0, [other], _inc(new))
    assert _view(new) == before


def test_an_orphan_that_leaves_the_index_waits_no_more(spec: CacheSpec) -> None:
    hs, reports = _chain_reports(spec, 4)
    new = _fresh(spec)
    ids = new.confirm_objects(S0, [r for r in reports if r.depth == 3], _inc(new))
    for oid in ids:
        if oid is not None and new.objects.get(oid) is not None:  # (a KV takes its indexer)
            new.evict(oid)
    assert hs[3] not in new.index and not new._tables.tree.orphans
    new.confirm(S0, [r for r in reports if r.depth < 3], _inc(new))  # adopts nothing gone
    assert new.index[hs[2]].children == 0


def test_an_entry_made_at_another_depth_does_not_adopt_an_orphan(spec: CacheSpec) -> None:
    """Block 3 waits for block 2's hash; a later report puts that hash at depth 1 (the
    reports contradict each other): block 3 stays parentless rather than hang two blocks
    below it, and the walk never serves that hash out of place."""
    hs, reports = _chain_reports(spec, 4)
    new = _fresh(spec)
    new.confirm(S0, [r for r in reports if r.depth == 3], _inc(new))
    liar = replace(next(r for r in reports if r.depth == 1), block_hash=hs[2])
    new.confirm(S0, [liar], _inc(new))
    assert new.index[hs[3]].parent is None and new.index[hs[2]].children == 0
    assert _hit(new, hs) == 0


def test_a_write_through_an_orphan_under_another_parent_is_refused(spec: CacheSpec) -> None:
    """The adversary's order: block 3 confirmed alone (it waits for block 2's hash), then a
    writer allocates a chain whose block 3 has that hash under another block 2. Taken, the
    orphan hung under the writer's block 2 and, once the reported block 2 arrived, under that
    one too (two parents counting it, the first one's count never taken back). The orphan's
    parent is the one it first named, on every path: the write is refused, changing nothing."""
    hs, reports = _chain_reports(spec, 4)
    new = _fresh(spec)
    new.confirm(S0, [r for r in reports if r.depth == 3], _inc(new))
    other = prompt_hashes(spec, 3, seed=9)
    before = _view(new)
    with pytest.raises(BadHash, match="another parent"):
        new.allocate([*other, hs[3]], [AllocRequest(3, "c4")])
    assert _view(new) == before
    new.confirm(S0, [r for r in reports if r.depth < 3], _inc(new))
    assert new.index[hs[3]].parent is new.index[hs[2]] and new.index[hs[2]].children == 1


def _fan(spec: CacheSpec, n: int, seed: int = 3) -> list[list[BlockHash]]:
    """``n`` 4-block prompts sharing their first 2 blocks: block 1 (the hub) has ``n``
    children."""
    rng = np.random.default_rng(seed)
    hb = spec.hash_block_size
    shared = rng.integers(0, 50_000, 2 * hb)
    return [hash_blocks(np.concatenate([shared, rng.integers(0, 50_000, 2 * hb)]), hb,
                        ExtraKeys(spec.model_id)) for _ in range(n)]


def test_a_parent_of_many_orphans_adopts_them_a_slice_at_a_time(
        spec: CacheSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every child of the hub confirmed before the hub: the call that makes the hub adopts a
    slice as it returns, not all (a hub with hundreds of thousands of children held the lock
    for all of them); a write's call one more; the reaper's slices adopt the rest.
    Meanwhile every prompt hits as it did before the restart (the walk reads no parent
    link), the resume-point counts are those of the links made so far, and a write naming a
    waiting child under the hub adopts it at once."""
    monkeypatch.setattr(tree, "ADOPT_SLICE", 4)
    chains = _fan(spec, 11)
    old = _old(spec, chains)
    reports = _reports(old)
    new = _fresh(spec)
    new.confirm(S0, [r for r in reports if r.depth >= 2], _inc(new))
    hub_hash = chains[0][1]
    assert len([e for e in new.index.values() if e.awaits == hub_hash]) == 11
    new.confirm(S0, [r for r in reports if r.depth < 2], _inc(new))
    hub = new.index[hub_hash]
    assert hub.children == 4 and new._tables.tree.orphans.waits_for(hub_hash)
    assert _lanes(new) == _lanes_from_scratch(new)
    assert [_hit(new, hs) for hs in chains] == [_hit(old, hs) for hs in chains]
    waiting = [e for e in new.index.values() if e.awaits == hub_hash]
    assert len(waiting) == 7
    writer = next(hs for hs in chains if hs[2] == waiting[-1].block_hash)
    new.allocate(writer, [AllocRequest(3, "c4")])  # (exists: a write through the path)
    # the write adopts the child its path names at once, and a slice as it returns
    assert waiting[-1].parent is hub and waiting[-1].awaits is None and hub.children == 9
    assert new.reap() is False  # the last 2: nothing left
    assert hub.children == 11 and not new._tables.tree.orphans and not new._tables.tree.adopting
    assert all(new.index[hs[2]].parent is hub for hs in chains)
    assert _lanes(new) == _lanes(old) == _lanes_from_scratch(new)


def test_a_waiting_parent_that_left_the_index_adopts_nothing(
        spec: CacheSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry made with more orphans waiting than a slice, gone from the index before the
    reaper's slice (its records evicted): the reaper passes it by, and what it did not take
    waits for the next entry of its hash, as if it had never been made."""
    monkeypatch.setattr(tree, "ADOPT_SLICE", 1)
    chains = _fan(spec, 3)
    reports = _reports(_old(spec, chains))
    new = _fresh(spec)
    # children reported at the hub's depth + 2 (a liar): the hub adopts none of its slice
    liars = [replace(r, depth=3) for r in reports if r.depth == 2 and r.column == "c4"]
    new.confirm(S0, liars, _inc(new))
    hub_hash = chains[0][1]
    hub_reports = [r for r in reports if r.depth == 1]
    ids = new.confirm_objects(S0, hub_reports, _inc(new))
    hub = new.index[hub_hash]
    assert hub.children == 0 and new._tables.tree.adopting  # (both its slices were liars)
    for oid in ids:
        if oid is not None and new.objects.get(oid) is not None:
            new.evict(oid)
    assert hub_hash not in new.index
    assert len(liars) == 3 and new.reap() is False and not new._tables.tree.adopting
    # (one taken as the call returned, one by reap)
    assert new._tables.tree.orphans.waits_for(hub_hash)


def test_a_call_that_makes_many_hubs_adopts_one_slice(
        spec: CacheSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three hubs made in one confirm, each with 5 children confirmed before it: the call
    adopts one slice in all, not one per hub (256 hubs of a batch, each with a slice
    waiting, would have held the lock for 256 slices); the reaper adopts the rest."""
    monkeypatch.setattr(tree, "ADOPT_SLICE", 4)
    fans = [_fan(spec, 5, seed) for seed in (3, 4, 5)]
    reports = _reports(_old(spec, [hs for fan in fans for hs in fan]))
    new = _fresh(spec)
    new.confirm(S0, [r for r in reports if r.depth >= 2], _inc(new))
    new.confirm(S0, [r for r in reports if r.depth < 2], _inc(new))
    hubs = [new.index[fan[0][1]] for fan in fans]
    assert sum(h.children for h in hubs) == 4
    new.reap_all()
    assert [h.children for h in hubs] == [5, 5, 5] and not new._tables.tree.orphans
