"""hkv's connector with recurrent (``MambaSpec``, align mode) groups on vLLM's real Scheduler and
a real in-process hkv, no model: Nemotron-H's specs (two Mamba2 groups, conv state bf16 then
SSM state **fp32**, and one attention group), which cannot run a prefill on this CPU
(``mamba_mixer2.py:880``). The stand-in forward (``vllm_harness.Harness``) writes each block a
function of the tokens up to its end, so a state's bytes name the boundary they belong to.

A serves a 1,333-token prompt (160-token blocks, 320-token chunks); B (vLLM's own cache
reset: a fresh engine as far as hits go) serves its first 1,000 tokens and a new suffix.
The real engine (Qwen3-Next) is ``test_qwen3next_hkv.py``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm_harness import (
    Harness,
    nemotron_h_specs,
    prompt,
    recurrent_config,
    transfer_config,
    write_tiny_config,
)

from hkv_service.connectors.errors import UnsupportedKVCache
from hkv_service.connectors.geometry import geometry_from
from hkv_service.connectors.lane import Task
from hkv_service.connectors.plan import state_items
from hkv_service.core.api import LookupRequest
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.spec import GroupKind, StatePart
from hkv_service.core.states import Kind
from workers.dataplane import Recompute

BS = 160
N = 1333
SHARED = 1000
STATE_BYTES = 3 * 384 * 2 + 8 * 32 * 64 * 4  # conv bf16 + SSM fp32, one Mamba2 layer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


_names = iter(range(1000))


@pytest.fixture
def make(model: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[Harness] = []

    def build(retention: int | None = None) -> Harness:
        name = f"rec-{next(_names)}"
        cfg = recurrent_config(model, BS, 320, retention, transfer_config(name))
        h = Harness(model, tmp_path / name, nemotron_h_specs(BS), name, cfg=cfg)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def serve_a(h: Harness) -> list[int]:
    tokens = prompt(N, seed=3)
    h.add("a", tokens)
    h.run()
    h.forget_local()
    return tokens


def states_held(h: Harness, tokens: list[int]) -> dict[str, list[int]]:
    """Per recurrent group, the boundaries hkv holds a ready state at."""
    spec = h.geo.spec
    hashes = hash_blocks(tokens, spec.hash_block_size, ExtraKeys(spec.model_id))
    out: dict[str, list[int]] = {}
    for g in h.geo.groups:
        if not g.recurrent:
            continue
        out[g.name] = [p for p in range(BS, len(tokens) + 1, BS)
                       if _has_state(h, hashes[: p // spec.hash_block_size], g.name, p)]
    return out


def _has_state(h: Harness, hashes: list[Any], column: str, p: int) -> bool:
    m = h.system.meta.lookup(LookupRequest(hashes, p))
    return m.usable_tokens == p and bool(m.handles.get(column))


# ---- the geometry ----------------------------------------------------------------------------


def test_mamba_groups_map_to_recurrent_groups_whose_abi_names_the_state(model: Path) -> None:
    kvc = _kv_cache_config(model)
    geo = geometry_from(kvc, "nemotron-h-tiny", "0.32")
    kinds = [g.kind for g in geo.spec.groups]
    assert kinds == [GroupKind.RECURRENT, GroupKind.RECURRENT, GroupKind.COMPRESSED]
    g0 = geo.spec.groups[0]
    assert g0.state == (StatePart((3, 384), "bfloat16"), StatePart((8, 32, 64), "float32"))
    assert g0.state_kind == "MAMBA2" and g0.layers == 1
    assert g0.bytes_per_block == STATE_BYTES == geo.groups[0].page_bytes  # no page padding
    assert geo.lcm == BS
    # the state's dtype is part of what a reader must match: a bf16 SSM state is another ABI
    bf16 = _with(kvc, 0, dtypes=(torch.bfloat16, torch.bfloat16))
    assert geometry_from(bf16, "nemotron-h-tiny", "0.32").reader_abi()["g0"] != \
        geo.reader_abi()["g0"]
    gdn = _with(kvc, 0, mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    assert geometry_from(gdn, "nemotron-h-tiny", "0.32").spec.groups[0].state_kind == "GDN_ATTN"


def _kv_cache_config(model: Path) -> KVCacheConfig:
    cfg = recurrent_config(model, BS, 320, 0, transfer_config("unused"))
    return get_kv_cache_configs(cfg, [nemotron_h_specs(BS)], [64 << 20])[0]


def _with(kvc: KVCacheConfig, index: int, **change: Any) -> KVCacheConfig:
    groups = list(kvc.kv_cache_groups)
    g = groups[index]
    groups[index] = KVCacheGroupSpec(g.layer_names,
                                     dataclasses.replace(g.kv_cache_spec, **change))
    return dataclasses.replace(kvc, kv_cache_groups=groups)


@pytest.mark.parametrize(("change", "phrase"), [
    ({"mamba_type": MambaAttentionBackendEnum.MAMBA1}, "recurrence MAMBA1 was never checked"),
    ({"mamba_type": MambaAttentionBackendEnum.SHORT_CONV}, "recurrence SHORT_CONV"),
    ({"mamba_cache_mode": "none"}, "'align' mode"),
    ({"mamba_cache_mode": "all"}, "'align' mode"),
    ({"num_speculative_blocks": 1}, "speculative state blocks"),
    ({"dtypes": (torch.bfloat16, torch.int32)}, "state dtype torch.int32"),
])
def test_a_recurrent_group_hkv_cannot_serve_is_refused_with_a_sentence(
        model: Path, change: dict[str, Any], phrase: str) -> None:
    kvc = _kv_cache_config(model)
    with pytest.raises(UnsupportedKVCache, match=phrase) as err:
        geometry_from(_with(kvc, 1, **change), "tiny", "0.32")
    assert err.value.group == 1 and err.value.spec_type == "MambaSpec"


def test_state_items_keep_only_resume_points_of_live_blocks(model: Path, make: Any) -> None:
    h = make(0)
    g0, g1 = (g.vllm_group for g in h.geo.groups if g.recurrent)
    attention = next(g.vllm_group for g in h.geo.groups if not g.recurrent)
    items, dropped = state_items(h.geo, [
        (g0, 11, 320),  # kept: depth 320 / 160 - 1
        (g1, 12, 320),  # kept
        (g0, 0, 640),  # the null block
        (g0, 13, 330),  # not a multiple of the block: no resume point of hkv's
        (g0, 14, 960),  # past what the step computes
        (g0, 16, 160),  # the state the request resumed from: not this step's forward
        (attention, 15, 320),  # not a recurrent group
    ], start=160, end=640, null_block=0)
    assert [(i.column, i.depth, i.block_id) for i in items] == [("g0", 1, 11), ("g1", 1, 12)]
    assert dropped == 5


# ---- saves: states only from the hand-offs ---------------------------------------------------


@pytest.mark.parametrize(("retention", "kept"), [
    (0, [1280]),  # vLLM's default keeps the last cacheable boundary only
    (None, list(range(BS, 1281, BS))),  # dense: every boundary (Mamba2 checkpoints in-chunk)
])
def test_hkv_saves_exactly_the_states_vllm_hands_off(make: Any, retention: int | None,
                                                     kept: list[int]) -> None:
    h = make(retention)
    tokens = serve_a(h)
    assert states_held(h, tokens) == {"g0": kept, "g1": kept}
    # and their bytes are the state at exactly that boundary (the stand-in's function of the
    # tokens before it), of every layer, without the page's padding
    spec = h.geo.spec
    p = kept[-1]
    hashes = hash_blocks(tokens[:p], spec.hash_block_size, ExtraKeys(spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hashes, p))
    got = h.system.dataplane().read(m, hashes)
    assert not isinstance(got, Recompute)
    for g in h.geo.groups:
        if g.recurrent:
            (blob,) = got[g.name]  # type: ignore[index]
            assert bytes(memoryview(blob).cast("B")) == _want(h, tokens, g, p)
    stats = h.connector._sched().stats.total
    assert stats["state_handoffs"] == 2 * len(kept) and not stats["state_handoffs_dropped"]


def test_states_are_staged_in_the_step_that_hands_them_off(make: Any) -> None:
    """hkv's writes run off the step, held back here behind a busy save lane while vLLM
    overwrites every page after each step (a state block is reused once handed off): the
    states hkv then holds are still each boundary's."""
    h = make(None)
    w = h.worker.worker
    held = threading.Event()

    def busy() -> None:
        assert held.wait(30.0)

    w._saves.submit(Task(busy, lambda why: None))
    tokens = prompt(N, seed=3)
    h.add("a", tokens)
    for _ in range(50):
        if not h.sched.has_requests():
            break
        h.step()
        for t in h.caches.values():
            t.view(torch.uint8).fill_(0x5A)
    assert not h.sched.has_requests()
    held.set()
    assert w.drain(30.0)
    kept = list(range(BS, 1281, BS))
    assert states_held(h, tokens) == {"g0": kept, "g1": kept}
    spec = h.geo.spec
    for p in kept:
        hashes = hash_blocks(tokens[:p], spec.hash_block_size, ExtraKeys(spec.model_id))
        got = h.system.dataplane().read(h.system.meta.lookup(LookupRequest(hashes, p)), hashes)
        assert not isinstance(got, Recompute)
        for g in h.geo.groups:
            if g.recurrent:
                (blob,) = got[g.name]  # type: ignore[index]
                assert bytes(memoryview(blob).cast("B")) == _want(h, tokens, g, p), (g.name, p)


def test_handoffs_of_a_request_gone_in_the_step_are_dropped(make: Any) -> None:
    """Finished or preempted in the step: its blocks may already be another request's."""
    h = make(None)
    side = h.connector._sched()
    tokens = prompt(N, seed=3)
    req = h.add("a", tokens)
    side.added(req)
    g0 = next(g.vllm_group for g in h.geo.groups if g.recurrent)
    _, saves = side.take_jobs({"a": 320}, lambda r: ([], [], []), {"a": [(g0, 5, 320)]},
                              gone={"a"})
    assert not saves
    _, saves = side.take_jobs({"a": 320}, lambda r: ([], [], []), {"a": [(g0, 5, 320)]})
    assert [(i.column, i.depth) for s in saves for i in s.items] == [("g0", 1)]
    assert side.stats.total["state_handoffs_dropped"] == 1


# ---- loads: the state into the block vLLM planned, at a boundary every group has -------------


def serve_b(h: Harness, tokens: list[int], req_id: str = "b") -> dict[str, Any]:
    reports: dict[str, Any] = {}
    side = h.connector._sched()
    finished = side.finished

    def keep(request: Any, block_ids: Any) -> Any:
        held, params = finished(request, block_ids)
        reports[request.request_id] = params
        return held, params

    side.finished = keep  # type: ignore[method-assign]
    b_tokens = tokens[:SHARED] + prompt(300, seed=4)
    h.add(req_id, b_tokens)
    h.run()
    side.finished = finished  # type: ignore[method-assign]
    jobs = h.loads(req_id)
    return {"tokens": b_tokens, "jobs": jobs, "report": (reports[req_id] or {}).get("hkv"),
            "computed_first": h.scheduled(req_id)}


def test_b_resumes_at_the_longest_boundary_every_group_has_with_the_state_loaded(
        make: Any) -> None:
    h = make(None)
    tokens = serve_a(h)
    got = serve_b(h, tokens)
    (job,) = got["jobs"]
    assert job.match is not None and job.tokens == 960  # 1000 shared: the boundary below
    assert got["computed_first"] == 320  # B computes from 960 on (one chunk)
    # vLLM handed off the two loaded state blocks again (at 960): hkv had them, not re-saved
    assert h.connector._sched().stats.total["state_handoffs_dropped"] == 2
    assert got["report"] == {"asked": 1280, "local": 0, "certified": 960, "loaded": 960,
                             "why": ""}
    for g in h.geo.groups:
        copies = [c for c in job.copies if c.column == g.name]
        if g.recurrent:  # one state, in the block vLLM planned: index 960 / 160 - 1
            (c,) = copies
            assert c.block_id != 0
            assert _block(h, g.layers[0], c.block_id) == _want(h, got["tokens"], g, 960)
        else:  # every attention block below the hit
            assert len(copies) == 960 // BS


def test_a_shorter_hit_for_want_of_a_state_is_reported_with_the_reason(make: Any) -> None:
    """vLLM's default retention kept only 1280: B shares 1,000 tokens, the attention blocks
    run to 960 but no recurrent group has a state there or below: B recomputes, and its
    output says why."""
    h = make(0)
    tokens = serve_a(h)
    got = serve_b(h, tokens)
    assert got["jobs"] == [] and got["computed_first"] == 320  # the first chunk of 1,300
    report = got["report"]
    assert report["certified"] == 0 and report["loaded"] == 0 and report["asked"] == 1280
    assert "NO_STATE_AT_BOUNDARY@960" in report["why"]
    stats = h.connector._sched().stats.total
    assert stats["requests_short_no_state"] == 1
    assert stats["downgrade.NO_STATE_AT_BOUNDARY"] >= 1


@pytest.mark.parametrize(("retention", "certified"), [
    (0, 0),  # vLLM's default: A's state at 1280 only
    (640, 640),  # one state every 640 tokens (and the last): 640 is the longest shared one
    (320, 960),  # one every chunk: B resumes at the last boundary it shares
])
def test_vllms_retention_interval_decides_how_far_b_resumes(make: Any, retention: int,
                                                            certified: int) -> None:
    """The knob hkv documents (``--prefix-cache-retention-interval``, with 320-token chunks):
    hkv serves every state vLLM kept, and says why it stopped short of 960."""
    h = make(retention)
    got = serve_b(h, serve_a(h))
    assert got["report"]["certified"] == certified
    assert sum(j.tokens for j in got["jobs"]) == certified
    if certified < 960:
        assert "NO_STATE_AT_BOUNDARY@960" in got["report"]["why"]


def test_a_hit_needs_the_attention_blocks_below_it_too(make: Any) -> None:
    """States at every boundary, but the attention block [480, 640) evicted: the longest
    boundary where every group has its data is 480."""
    h = make(None)
    tokens = serve_a(h)
    spec = h.geo.spec
    hashes = hash_blocks(tokens[:640], spec.hash_block_size, ExtraKeys(spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hashes, 640))
    attention = next(g.name for g in h.geo.groups if not g.recurrent)
    h.system.meta.evict(m.handles[attention][-1].object_id)  # the block ending at 640
    got = serve_b(h, tokens)
    assert got["report"]["certified"] == 480
    (job,) = got["jobs"]
    assert job.tokens == 480


def test_an_evicted_state_gives_a_shorter_certified_hit(make: Any) -> None:
    """Dense states; g1's state at 960 evicted between A and B: 960 is no resume point any
    more, 800 is (both groups have it), and B resumes there with 800's states."""
    h = make(None)
    tokens = serve_a(h)
    spec = h.geo.spec
    hashes = hash_blocks(tokens[:960], spec.hash_block_size, ExtraKeys(spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hashes, 960))
    (state,) = m.handles["g1"]
    assert state.kind is Kind.STATE
    h.system.meta.evict(state.object_id)
    got = serve_b(h, tokens)
    (job,) = got["jobs"]
    assert job.tokens == 800
    assert got["report"]["certified"] == 800
    assert "NO_STATE_AT_BOUNDARY@960:g1" in got["report"]["why"]
    states = 0
    for c in job.copies:
        g = next(x for x in h.geo.groups if x.name == c.column)
        if g.recurrent:  # 800's state, in the block vLLM planned for a hit at 800
            states += 1
            assert _block(h, g.layers[0], c.block_id) == _want(h, got["tokens"], g, 800)
    assert states == 2


def _block(h: Harness, layer: str, block_id: int) -> bytes:
    return bytes(h.caches[layer][block_id].contiguous().view(torch.uint8).reshape(-1).numpy())


def _want(h: Harness, tokens: list[int], g: Any, p: int) -> bytes:
    """The stand-in's state of ``g`` after exactly ``p`` tokens."""
    want = h.expected(tokens, g.vllm_group, p // BS - 1, 0)
    return bytes(want.contiguous().view(torch.uint8).reshape(-1).numpy())


def test_a_corrupt_disk_copy_of_a_state_is_a_recompute_never_its_bytes(make: Any) -> None:
    from vllm_e2e import flip_on_disk

    h = make(0)
    tokens = serve_a(h)
    spec = h.geo.spec
    hashes = hash_blocks(tokens[:1280], spec.hash_block_size, ExtraKeys(spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hashes, 1280))
    assert m.usable_tokens == 1280
    plane = h.system.dataplane()
    got = plane.read(m, hashes, release=False)
    handles = [x for col in m.handles.values() for x in col]
    assert all(r.ok for r in plane.offload(handles, None, evict_memory=True))
    (blob,) = got["g0"]  # type: ignore[index]
    head = bytes(memoryview(blob).cast("B")[:64])
    assert sum(flip_on_disk(h.system.shard_dir(s), head) for s in h.system.links) > 0
    b_tokens = tokens[:1290] + prompt(10, seed=5)
    h.add("b", b_tokens)
    h.run()
    (job,) = h.loads("b")
    assert job.tokens == 1280
    w = h.worker.worker
    assert w is not None and w.stats.total["load_failed"] == 1
    assert w.stats.total["load_failed.CORRUPT"] == 1
    assert not w.stats.total["loaded_tokens"]
    # the load failed as a whole (the read refused the record before any copy): vLLM
    # recomputed the prompt from the start
    assert sum(out.num_scheduled_tokens.get("b", 0) for out in h.outputs) >= 1300
    # the corrupt copy is gone; the state hkv holds at 1280 now is the recompute's, correct
    m = h.system.meta.lookup(LookupRequest(hashes, 1280))
    again = plane.read(m, hashes)
    assert not isinstance(again, Recompute)
    for g in h.geo.groups:
        if g.recurrent:
            assert bytes(memoryview(again[g.name][0]).cast("B")) == _want(h, tokens, g, 1280)


def test_a_load_with_no_block_planned_for_the_state_is_refused(make: Any) -> None:
    from hkv_service.connectors.plan import load_copies
    from hkv_service.core.layout import Layout

    h = make(None)
    tokens = serve_a(h)
    spec = h.geo.spec
    hashes = hash_blocks(tokens[:960], spec.hash_block_size, ExtraKeys(spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hashes, 960))
    rec = [g.vllm_group for g in h.geo.groups if g.recurrent]
    ids = [[0] * 6 if i in rec else list(range(1, 7)) for i in range(3)]
    ok = load_copies(h.geo, Layout(spec), m, 0, 960, [[0] * 5 + [99] if i in rec else x
                                                      for i, x in enumerate(ids)], 0)
    assert not isinstance(ok, str)
    assert sorted(c.block_id for c in ok if c.column != "g2") == [99, 99]
    why = load_copies(h.geo, Layout(spec), m, 0, 960, ids, 0)
    assert why == "g0: vLLM planned no block for the state at 960"

