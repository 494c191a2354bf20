"""The sixth cache object: a recurrent group's state (GatedDeltaNet / Mamba) as of exactly one
boundary (issue 37). A hit at p needs, for every recurrent group, its state at p: a state one
boundary off is a different object, and a resume point is a boundary where every group is
ready (layer 3 stays a fixed point over all groups)."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, ObjectReport, Params
from hkv_service.core.errors import BadSpecField, IllegalTransition
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.spec import CacheSpec, GroupKind, StatePart, spec_from_dict
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, Kind, Reason, State
from hkv_service.testing import pools_for, prompt_hashes

S0 = ShardId("s0")
ABI = {"dtype": "bfloat16", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "fa"}
GDN_PARTS = [{"shape": [3, 16], "dtype": "bfloat16"}, {"shape": [2, 8, 8], "dtype": "float32"}]


def _spec(state: list[dict[str, object]] | None = None, kind: str = "GDN",
          hash_block: int = 32) -> CacheSpec:
    """Full attention + two recurrent groups, all in 64-token blocks (Qwen3-Next's shape in
    vLLM: every group shares the block size), hash blocks of 32 tokens: resume points every
    other hash block."""
    rec = {"kind": "RECURRENT", "block_size": 64, "state_kind": kind, "layers": 3,
           "state": state or GDN_PARTS,
           "abi": {"dtype": "float32", "layout": "conv-then-ssm", "head_shape": [3],
                   "kernel_version": "gdn-1"}}
    return spec_from_dict({"model_id": "qwen3-next-tiny", "hash_block_size": hash_block,
                           "groups": [
        {"name": "full", "kind": "COMPRESSED", "block_size": 64, "ratio": 1, "abi": ABI},
        {**rec, "name": "gdn0"}, {**rec, "name": "gdn1"}]})


SPEC = _spec()
N = 8  # hash blocks: 256 tokens, resume points 64, 128, 192, 256 (depths 1, 3, 5, 7)


def _state(blocks: int = 64) -> CacheState:
    st = CacheState(SPEC)
    st.register_owner(S0, pools_for(st.layout, blocks))
    return st


def _write(st: CacheState, hs: list[BlockHash], slots: Iterable[tuple[int, str]]) -> dict[
        tuple[int, str], int]:
    slots = sorted(slots)
    allocs = st.allocate(hs, [AllocRequest(d, c) for d, c in slots])
    for a in allocs:
        st.transition(a.handle.object_id, Event.WRITE_DONE,
                      Params(version=7) if a.handle.kind is Kind.COMPRESSED else None)
    return {s: int(a.handle.object_id) for s, a in zip(slots, allocs, strict=True)}


def _kv(n: int = N) -> list[tuple[int, str]]:
    return [(d, "full") for d in range(1, n, 2)]


def _states(group: str, depths: Iterable[int]) -> list[tuple[int, str]]:
    return [(d, group) for d in depths]


def _lookup(st: CacheState, hs: list[BlockHash]) -> tuple[int, set[Reason]]:
    m = st.lookup(LookupRequest(hs))
    return m.usable_tokens, {d.reason for d in m.downgrades}


# ---- the spec and the layout -----------------------------------------------------------------


def test_a_recurrent_group_is_one_state_object_per_boundary() -> None:
    lay = Layout(SPEC)
    col = lay.columns[lay.by_name["gdn0"]]
    assert col.kind is Kind.STATE and col.group.kind is GroupKind.RECURRENT
    assert col.nbytes == 3 * (3 * 16 * 2 + 2 * 8 * 8 * 4)  # layers x (conv bf16 + ssm fp32)
    assert [d for d in range(N) if lay.lives_at(col.index, d)] == [1, 3, 5, 7]
    assert list(lay.needed_depths(col.index, 192)) == [5]  # only at the resume point itself
    assert lay.object_bytes(col.index, 5) == col.nbytes


def test_the_abi_names_the_state_parts_dtypes_layers_and_recurrence() -> None:
    fp = Layout(SPEC).columns[1].abi_fingerprint
    other_dtype = [GDN_PARTS[0], {"shape": [2, 8, 8], "dtype": "bfloat16"}]
    other_shape = [GDN_PARTS[0], {"shape": [2, 8, 16], "dtype": "float32"}]
    for spec in (_spec(other_dtype), _spec(other_shape), _spec(kind="MAMBA2")):
        assert Layout(spec).columns[1].abi_fingerprint != fp
    again = spec_from_dict(SPEC.to_dict())
    assert again == SPEC  # the spec file says it all, and round-trips
    assert again.groups[1].state == (StatePart((3, 16), "bfloat16"), StatePart((2, 8, 8),
                                                                             "float32"))


@pytest.mark.parametrize(("change", "phrase"), [
    ({"state": []}, "needs 'state'"),
    ({"state": [{"shape": [0], "dtype": "float32"}]}, "positive integers"),
    ({"state": [{"shape": [2], "dtype": "int4"}]}, "dtype"),
    ({"state_kind": ""}, "state_kind"),
    ({"layers": 0}, "layers"),
])
def test_a_malformed_recurrent_group_is_refused(change: dict[str, object], phrase: str) -> None:
    raw = SPEC.to_dict()
    raw["groups"][1].update(change)
    with pytest.raises(BadSpecField, match=phrase):
        spec_from_dict(raw)


def test_only_a_recurrent_group_takes_a_state() -> None:
    raw = SPEC.to_dict()
    raw["groups"][0]["state"] = GDN_PARTS
    with pytest.raises(BadSpecField, match="RECURRENT group only"):
        spec_from_dict(raw)


# ---- the funnel: every recurrent group's state at exactly p ----------------------------------


def test_a_hit_resumes_where_every_recurrent_group_has_its_state() -> None:
    """gdn0 kept states at 128 and 192, gdn1 at 64, 192 and 256: the hit is 192, the one
    boundary both have; 256 lacks gdn0's state and says so."""
    st = _state()
    hs = prompt_hashes(SPEC, N)
    _write(st, hs, _kv() + _states("gdn0", (3, 5)) + _states("gdn1", (1, 5, 7)))
    usable, reasons = _lookup(st, hs)
    assert usable == 192
    assert Reason.NO_STATE_AT_BOUNDARY in reasons


def test_a_state_one_boundary_off_is_never_used() -> None:
    """Each group has a state, at neighbouring boundaries: there is no resume point."""
    st = _state()
    hs = prompt_hashes(SPEC, N)
    _write(st, hs, _kv() + _states("gdn0", (5,)) + _states("gdn1", (3, 7)))
    usable, reasons = _lookup(st, hs)
    assert usable == 0 and reasons == {Reason.NO_STATE_AT_BOUNDARY}


def test_a_state_not_yet_written_is_not_ready() -> None:
    st = _state()
    hs = prompt_hashes(SPEC, N)
    _write(st, hs, _kv() + _states("gdn0", (7,)))
    (a,) = st.allocate(hs, [AllocRequest(7, "gdn1")])  # allocated, bytes not committed
    usable, reasons = _lookup(st, hs)
    assert usable == 0 and Reason.NOT_WRITTEN in reasons
    st.transition(a.handle.object_id, Event.WRITE_DONE)
    assert _lookup(st, hs)[0] == 256


def test_a_state_is_written_once() -> None:
    st = _state()
    hs = prompt_hashes(SPEC, N)
    ids = _write(st, hs, _states("gdn0", (1,)))
    with pytest.raises(IllegalTransition):
        st.transition(ids[(1, "gdn0")], Event.WRITE_DONE)


def test_a_state_on_disk_serves_after_a_load() -> None:
    st = _state()
    hs = prompt_hashes(SPEC, 4)
    ids = _write(st, hs, _kv(4) + _states("gdn0", (3,)) + _states("gdn1", (3,)))
    disk = st.begin_offload(ids[(3, "gdn1")], S0)
    st.transition(disk.object_id, Event.OFFLOAD_COMMITTED)
    st.evict(ids[(3, "gdn1")])
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 128 and m.needs_load
    assert [h.object_id for h in m.load] == [disk.object_id]
    st.begin_load(disk.object_id)
    st.transition(disk.object_id, Event.LOAD_VERIFIED)
    m = st.lookup(LookupRequest(hs))
    assert m.usable_tokens == 128 and not m.needs_load


def test_a_state_is_reconfirmed_after_a_restart() -> None:
    """(Hash blocks as large as the blocks, as vLLM's are: a re-confirm makes the entries its
    reports name, and here every depth holds objects.)"""
    spec = _spec(hash_block=64)
    old = CacheState(spec)
    old.register_owner(S0, pools_for(old.layout, 8))
    hs = prompt_hashes(spec, 2)
    ids = _write(old, hs, [(d, c) for d in (0, 1) for c in ("full", "gdn0", "gdn1")])
    reports = [ObjectReport(hs[d], hs[d - 1] if d else None, d, c, old.objects[o].state,
                            block=old.objects[o].block, generation=old.objects[o].generation,
                            version=old.objects[o].version) for (d, c), o in ids.items()]
    new = CacheState(spec)
    new.register_owner(S0, pools_for(new.layout, 8))
    assert new.confirm(S0, reports, new.owners[S0].incarnation) == len(reports)
    assert _lookup(new, hs)[0] == 128


# ---- eviction: interior checkpoints first ------------------------------------------------


def test_checkpoints_inside_a_chain_go_before_the_latest_and_the_junctions() -> None:
    """Two prompts share 128 tokens: the junction at 128 and each chain's latest state stay,
    the checkpoint at 64 inside the shared chain goes first."""
    st = CacheState(SPEC)
    st.register_owner(S0, pools_for(st.layout, 4))  # gdn0's pool: 4 states at most
    a = prompt_hashes(SPEC, 6, seed=1)
    ids: dict[tuple[int, str], int] = {}
    for d in (5, 3, 1):  # 192, 128, 64: the checkpoint inside the chain is the most recent
        ids.update(_write(st, a, _states("gdn0", (d,))))
    b = _rechain(a, 4, 6)  # shares 128 tokens, then its own
    ids_b = _write(st, b, _states("gdn0", (5,)))  # b's latest, at 192
    _write(st, prompt_hashes(SPEC, 2, seed=3), _states("gdn0", (1,)))  # pool full: one goes
    assert st.objects.get(ids[(1, "gdn0")]) is None  # inside a's chain
    for kept in (ids[(3, "gdn0")], ids[(5, "gdn0")], ids_b[(5, "gdn0")]):
        assert st.objects.get(kept) is not None
    assert st.stats()["events"]["state_evicted_inside_chain"] == 1  # type: ignore[index]


def _rechain(a: list[BlockHash], shared: int, n: int) -> list[BlockHash]:
    """A prompt whose first ``shared`` hash blocks are ``a``'s and the rest its own."""
    import numpy as np

    from hkv_service.core.hashing import ExtraKeys, hash_blocks

    tokens = np.random.default_rng(1).integers(0, 50_000, n * SPEC.hash_block_size)
    other = np.random.default_rng(9).integers(0, 50_000, n * SPEC.hash_block_size)
    tokens[shared * SPEC.hash_block_size:] = other[shared * SPEC.hash_block_size:]
    got = hash_blocks(tokens, SPEC.hash_block_size, ExtraKeys(SPEC.model_id))
    assert got[:shared] == a[:shared] and got[shared] != a[shared]
    return got


def test_the_diagram_and_contract_cover_the_new_kind() -> None:
    from hkv_service.core.contracts import CONTRACTS
    from hkv_service.core.transitions import TABLE

    assert CONTRACTS[Kind.STATE].ready_state is State.STATE_READY
    assert (State.ALLOCATED, Event.WRITE_DONE) in TABLE[Kind.STATE]
    assert (State.STATE_READY, Event.WRITE_DONE) not in TABLE[Kind.STATE]  # written once
