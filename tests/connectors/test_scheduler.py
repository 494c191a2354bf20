"""The connector through vLLM's real Scheduler (hybrid coordinator on) over a real in-process
hkv (real shards, real LMDB tiers), no model weights.

Engine A computes a prompt and its blocks go to hkv; B (vLLM's own prefix cache dropped, as a
fresh engine) asks for the same prompt: vLLM must compute exactly ``prompt - usable`` tokens,
where ``usable`` is what hkv's funnel certifies (asked independently, match-only), and every
block B loaded must hold A's bytes. Each fault is real: an SWA object evicted, a shard killed,
objects offloaded to disk and a load held in flight, a c4 KV rewritten under its indexer, the
metadata service restarted between the lease and the read. vLLM geometries have no TAIL
object (vLLM keeps a compressor's state as a sliding-window group), so hkv's tail-partial
fault has no vLLM counterpart; its sliding-window one is the compressor state's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm_harness import (
    Harness,
    full_specs,
    harnesses,
    prompt,
    reference_specs,
    write_tiny_config,
)

from hkv_service.core.api import AllocRequest, LookupRequest
from hkv_service.core.hashing import hash_blocks
from hkv_service.core.ids import ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.states import Event, Reason
from workers.ports import Commit
from workers.tags import BlockTag

N = 400  # prompt tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make(model: Path, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    with harnesses(model, tmp_path, "sched") as build:
        yield build


def _keys(h: Harness) -> Any:
    from hkv_service.core.hashing import ExtraKeys
    return ExtraKeys(h.geo.spec.model_id)


def certified(h: Harness, tokens: list[int]) -> tuple[int, tuple[Reason, ...]]:
    """What hkv's funnel certifies for ``tokens`` now (match-only), and why not more."""
    lcm = h.geo.lcm
    limit = (len(tokens) - 1) // lcm * lcm
    hs = hash_blocks(tokens[:limit], h.geo.hash_block_size, _keys(h))
    m = h.system.meta.lookup(LookupRequest(hs, limit, h.geo.reader_abi(), handles=False))
    return m.usable_tokens, tuple(d.reason for d in m.downgrades)


def handles(h: Harness, tokens: list[int]) -> tuple[list[Any], Any]:
    lcm = h.geo.lcm
    limit = (len(tokens) - 1) // lcm * lcm
    hs = hash_blocks(tokens[:limit], h.geo.hash_block_size, _keys(h))
    return hs, h.system.meta.lookup(LookupRequest(hs, limit, h.geo.reader_abi()))


def run_a(h: Harness, tokens: list[int]) -> None:
    h.add("A", tokens)
    h.run()
    h.forget_local()


def test_hma_stays_on_with_two_groups(make: Callable[..., Harness]) -> None:
    h = make()
    assert not h.cfg.scheduler_config.disable_hybrid_kv_cache_manager
    assert type(h.sched.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    assert [g.kind.value for g in h.geo.spec.groups] == ["SWA", "COMPRESSED"]
    assert h.geo.spec.groups[0].window == 128


# 2: hkv's view split in metadata partitions; split: each chain too, at fixed depth ranges
@pytest.mark.parametrize(("partitions", "split"), [(1, False), (2, False), (2, True)])
def test_blocks_round_trip_and_b_computes_only_the_suffix(make: Callable[..., Harness],
                                                          partitions: int, split: bool) -> None:
    h = make(partitions=partitions, split=split)
    if split:
        assert h.system.meta.range_blocks and 384 // h.geo.spec.hash_block_size > \
            h.system.meta.range_blocks  # the prompt's chain spans ranges
    tokens = prompt(N, seed=1)
    run_a(h, tokens)
    # A's blocks are in hkv, byte for byte what its forward wrote
    hs, m = handles(h, tokens)
    assert m.usable_tokens == 384
    got = h.system.dataplane().read(m, hs)
    assert isinstance(got, dict)
    lay = Layout(h.geo.spec)
    for g in h.geo.groups:
        depths = lay.needed_depths(lay.by_name[g.name], 384)
        for depth, arr in zip(depths, got[g.name], strict=True):
            k = h.geo.block_of(g, depth)
            want = torch.cat([h.expected(tokens, g.vllm_group, k, li).reshape(-1)
                              .view(torch.uint8) for li in range(len(g.layers))])
            assert np.array_equal(np.asarray(arr).view(np.uint8), want.numpy())
    # B: only the suffix is computed, and what it loaded is A's bytes
    h.add("B", tokens)
    b_load = None
    for _ in range(200):  # the load runs off the step: its bytes count once reported
        out = h.step()
        if "B" in h.recved and b_load is None:
            b_load = h.loads("B")[0]
            for c in b_load.copies:
                g = next(g for g in h.geo.groups if g.name == c.column)
                k = h.sched.kv_cache_manager.get_block_ids("B")[g.vllm_group].index(c.block_id)
                for li, layer in enumerate(g.layers):
                    assert torch.equal(h.caches[layer][c.block_id],
                                       h.expected(tokens, g.vllm_group, k, li))
        if not h.sched.has_requests():
            break
        if not out.total_num_scheduled_tokens:
            time.sleep(0.01)
    assert out is not None and b_load is not None
    assert h.scheduled("B") == N - 384
    assert len(b_load.copies) == 24 + 8  # full attention [0, 384), SWA blocks meeting [256, 384)
    assert h.connector.scheduler.stats.total["probe_tokens"] == 384  # type: ignore[union-attr]
    assert h.worker.worker.stats.total["load_ok"] == 1  # type: ignore[union-attr]


def _evict_swa_block(h: Harness, tokens: list[int], depth: int) -> None:
    _, m = handles(h, tokens)
    lay = Layout(h.geo.spec)
    col = next(g.name for g in h.geo.groups if g.kind.value == "SWA")
    depths = list(lay.needed_depths(lay.by_name[col], m.usable_tokens))
    h.system.meta.evict(m.handles[col][depths.index(depth)].object_id)
    if m.lease_id is not None:
        h.system.meta.release_lease(m.lease_id)


def _kill_shard(h: Harness, tokens: list[int]) -> None:
    h.system.crash_shard("shard-0")  # dead, and the service knows (as after its heartbeats)
    h.system.meta.mark_owner_lost(ShardId("shard-0"))


def _offload(h: Harness, tokens: list[int]) -> list[Any]:
    """Every object of the prompt's match to its shard's disk tier, memory copies dropped."""
    hs, m = handles(h, tokens)
    if m.lease_id is not None:
        h.system.meta.release_lease(m.lease_id)
    hands = [hd for col in m.handles.values() for hd in col]
    res = h.system.dataplane().offload(hands, None, evict_memory=True)
    assert all(r.ok for r in res), res
    return hs


def _disk_in_flight(h: Harness, tokens: list[int]) -> None:
    hs = _offload(h, tokens)
    _, m = handles(h, tokens)
    assert m.needs_load
    started = h.system.dataplane().start_load(m, hs, hold_s=3.0)
    assert not hasattr(started, "reason")
    deadline = time.monotonic() + 2.0  # until the shard has begun the loads
    while Reason.DISK_INFLIGHT not in certified(h, tokens)[1]:
        assert time.monotonic() < deadline, "the held load never showed in flight"
        time.sleep(0.01)


FAULTS = {
    "swa_window_incomplete": (lambda h, t: _evict_swa_block(h, t, 20),
                              (Reason.SWA_WINDOW_INCOMPLETE,)),
    # a lost owner's objects are dropped from the view: the funnel finds them missing
    "owner_lost": (_kill_shard, (Reason.OWNER_LOST, Reason.MISSING_COMPONENT)),
    "disk_in_flight": (_disk_in_flight, (Reason.DISK_INFLIGHT,)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fault_vllm_computes_prompt_minus_usable(make: Callable[..., Harness],
                                                      fault: str) -> None:
    h = make()
    tokens = prompt(N, seed=2)
    run_a(h, tokens)
    inject, expect = FAULTS[fault]
    inject(h, tokens)
    usable, reasons = certified(h, tokens)
    assert set(expect) & set(reasons) and usable < 384
    h.add("B", tokens)
    h.run()
    assert h.scheduled("B") == N - usable


def test_disk_copies_are_loaded_and_counted_as_disk_hits(make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=3)
    run_a(h, tokens)
    _offload(h, tokens)
    assert certified(h, tokens)[0] == 384
    h.add("B", tokens)
    h.run()
    assert h.scheduled("B") == N - 384
    job = h.loads("B")[0]
    assert job.match is not None and job.match.needs_load
    assert h.worker.worker.stats.total["load_ok"] == 1  # type: ignore[union-attr]


def _restart(h: Harness) -> None:
    h.system.restart_service()


def _crash(h: Harness) -> None:
    h.system.crash_shard("shard-0")
    h.system.crash_shard("shard-1")


@pytest.mark.parametrize("fault", ["service_restart", "shards_crashed"])
def test_stale_handle_at_load_time_becomes_a_recompute(make: Callable[..., Harness],
                                                       fault: str) -> None:
    """The lease is taken at alloc; before the worker reads, the handles go stale: the read
    fails, vLLM gets a failed receive and recomputes the whole prompt (never old bytes)."""
    h = make()
    tokens = prompt(N, seed=4)
    run_a(h, tokens)
    h.add("B", tokens)
    h.step()  # B's probe asked (it runs off the step)
    assert h.connector.scheduler._lane.drain(30.0)  # type: ignore[union-attr]
    out = h.sched.schedule()  # B: the probe's answer + leased lookup; the load waits
    (_restart if fault == "service_restart" else _crash)(h)
    h.outputs.append(out)
    _worker_step(h, out)
    h.run()
    assert h.scheduled("B") == N  # every token recomputed: the cap after a failed load is 0
    assert h.worker.worker.stats.total["load_failed"] == 1  # type: ignore[union-attr]


def _worker_step(h: Harness, out: Any) -> None:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    w = h.worker
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)  # type: ignore[arg-type]
    w.wait_for_save()
    res = w.get_transfer_results(out.finished_req_ids)
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    kco = KVConnectorOutput(finished_sending=res.finished_sending,
                            finished_recving=res.finished_recving,
                            failed_recving=res.failed_recving, invalid_block_ids=errors)
    ids = list(out.num_scheduled_tokens)
    h.sched.update_from_output(out, ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids], kv_connector_output=kco))


def fault_before_lease(h: Harness, fault: Callable[[], None]) -> None:
    """``fault`` (what another engine's eviction does) lands between a request's probe and
    its allocation, once the probe's lease lapsed (released, and older than allocation lends:
    allocation then takes a lease of its own, which sees the fault). Once."""
    side = h.connector.scheduler
    assert side is not None
    real = side.allocated
    pending = [fault]

    def allocated(request: Any, block_ids: Any, num_external: int) -> None:
        probe = side._probes.get(request.request_id)
        if pending and num_external > 0 and probe is not None and probe.ask is not None:
            m = probe.ask.match
            if m is not None and m.lease_id is not None:
                h.system.meta.release_lease(m.lease_id)
            probe.ask.started -= side.lease_ttl_s
            pending.pop()()
        real(request, block_ids, num_external)

    side.allocated = allocated  # type: ignore[method-assign]


def test_shorter_leased_answer_becomes_load_errors_then_the_certified_prefix(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=5)
    run_a(h, tokens)
    side = h.connector.scheduler
    assert side is not None
    fault_before_lease(h, lambda: _evict_swa_block(h, tokens, 20))
    h.add("B", tokens)
    h.run()
    assert side.stats.total["alloc_shortfall"] == 1
    assert h.worker.worker.stats.total["load_failed"] == 1  # the first load: failed_recving
    assert h.scheduled("B") == N - 320  # the retry took what hkv still certified: [0, 320)


def test_one_full_attention_group_reports_failed_blocks_and_keeps_the_rest(
        make: Callable[..., Harness]) -> None:
    h = make(full_specs())
    assert h.geo.block_errors
    tokens = prompt(N, seed=6)
    run_a(h, tokens)
    side = h.connector.scheduler
    assert side is not None

    def evict_block_10() -> None:
        _, m = handles(h, tokens)
        if m.lease_id is not None:
            h.system.meta.release_lease(m.lease_id)
        h.system.meta.evict(m.handles["g0"][10].object_id)

    fault_before_lease(h, evict_block_10)
    h.add("B", tokens)
    h.run()
    assert h.scheduled("B") == N - 160  # blocks [0, 10) loaded, the rest reported and computed


def test_reference_spec_mirror_reuses_and_refuses_a_stale_indexer(
        make: Callable[..., Harness]) -> None:
    h = make(reference_specs(), block_size=64)
    kinds = {g.name: (g.kind.value, g.block_size, g.ratio, g.window, g.indexes)
             for g in h.geo.spec.groups}
    assert sorted(kinds.values(), key=str) == sorted([
        ("COMPRESSED", 64, 4, 0, None), ("INDEXER", 64, 4, 0, "g0"),
        ("COMPRESSED", 128, 128, 0, None), ("SWA", 64, 1, 128, None)], key=str)
    assert h.geo.lcm == 128
    n = 600
    tokens = prompt(n, seed=7)
    run_a(h, tokens)
    assert certified(h, tokens)[0] == 512
    # the c4 KV of block 5 (tokens [320, 384)) is rewritten with other bytes, and its
    # indexer written but never synced to the new KV version: the indexer is stale
    hs, m = handles(h, tokens)
    if m.lease_id is not None:
        h.system.meta.release_lease(m.lease_id)
    c4 = next(g for g in h.geo.groups if g.name == "g0")
    idx = next(g for g in h.geo.groups if g.name == "g1")
    depth = h.geo.depth_of(c4, 5)
    h.system.meta.evict(m.handles["g0"][5].object_id)  # its indexer goes with it
    plane = h.system.dataplane()
    assert plane.write_prefix(hs, {(depth, "g0"): np.full(c4.block_bytes, 3, np.uint8)}).ok
    (a,) = h.system.meta.allocate(hs, [AllocRequest(depth, "g1")])
    res = plane.shards[a.handle.shard].submit(
        "write_blocks", [a.handle], [np.full(idx.block_bytes, 5, np.uint8)],
        [BlockTag(hs[depth], hs[depth - 1], depth)], [Commit((Event.WRITE_DONE,))]
    ).result(10.0)
    assert res[0].ok
    usable, reasons = certified(h, tokens)
    assert Reason.INDEXER_STALE in reasons and usable == 256
    h.add("B", tokens)
    h.run()
    assert h.scheduled("B") == n - usable
