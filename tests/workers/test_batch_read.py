"""Batched block reads: handles as a HandleBatch, adjacent blocks moved as one span, small
spans packed, per-item STALE/FAILED results in a mixed batch (in-process, no Ray)."""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import workers.shard as shard_mod
from hkv_service.core.api import AllocRequest, Handle
from hkv_service.core.ids import ShardId
from hkv_service.core.states import Event
from workers.local import LocalMetadata
from workers.pool import HandleBatch
from workers.ports import Commit, ItemResult, Outcome, PackedRead
from workers.shard import ShardActor, ShardConfig
from workers.tags import BlockTag


@pytest.fixture
def shard(meta: LocalMetadata, tmp_path: Path) -> Any:
    # private pools: how spans travel through Ray (a shared pool's are all packed: below)
    cfg = ShardConfig("s0", meta, str(tmp_path), blocks_per_group=16,
                      disk_budget_bytes=8 << 20, heartbeat_interval_s=60.0, device="cpu",
                      shared_memory=False)
    actor = ShardActor(cfg)
    yield actor
    actor.shutdown()


def write_prefix(shard: ShardActor, meta: LocalMetadata, w: Any, n: int, columns: list[str],
                 seed: int = 0) -> tuple[list[Handle], list[np.ndarray]]:
    """Every block of ``columns`` along ``n`` hash blocks (c128 ends at odd ones), written
    and committed through one HandleBatch call."""
    hashes = w.prompt(n, seed=seed)
    reqs = [AllocRequest(d, c) for c in columns for d in range(n) if c != "c128" or d % 2]
    handles = [a.handle for a in meta.allocate(hashes, reqs, ShardId("s0"))]
    rng = np.random.default_rng(seed)
    arrays = [rng.integers(0, 256, h.nbytes, dtype=np.uint8) for h in handles]
    tags = [BlockTag(hashes[r.depth], hashes[r.depth - 1] if r.depth else None, r.depth)
            for r in reqs]
    results = shard.write_blocks(HandleBatch.of(handles), arrays, tags,
                                 [Commit((Event.WRITE_DONE,))] * len(handles))
    assert all(r.ok and r.handle is None for r in results), results
    assert all(r.version > 0 for r in results)  # compressed commits issue KV versions
    return handles, arrays


def test_handle_batch_pickles_and_rebuilds_handles(meta: LocalMetadata, shard: ShardActor,
                                                   w: Any) -> None:
    handles, _ = write_prefix(shard, meta, w, 4, ["c4", "c128"])
    batch = HandleBatch.of(handles)
    assert len(batch.columns) == 2 and len(batch) == 6
    back = pickle.loads(pickle.dumps(batch))
    assert list(back) == handles
    assert back[1:3].columns == batch.columns and list(back[1:3]) == handles[1:3]
    assert list(batch.take([5, 0])) == [handles[5], handles[0]]
    assert HandleBatch.of(batch) is batch
    assert len(HandleBatch.of([])) == 0


def check_bytes(out: PackedRead, handles: list[Handle], arrays: list[np.ndarray]) -> None:
    assert len(out) == len(handles)
    for got, want in zip(out, arrays, strict=True):
        assert isinstance(got, np.ndarray), got
        assert np.array_equal(got, want)


def test_adjacent_blocks_travel_as_one_span(meta: LocalMetadata, shard: ShardActor, w: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_mod, "PACK_BELOW", 0)  # views only: see the spans
    handles, arrays = write_prefix(shard, meta, w, 6, ["c4"])
    order = sorted(range(6), key=lambda i: handles[i].block)
    hs, data = [handles[i] for i in order], [arrays[i] for i in order]
    assert [h.block for h in hs] == list(range(hs[0].block, hs[0].block + 6))
    out = shard.read_blocks(HandleBatch.of(hs))
    assert len(out.buffers) == 1 and out.buffers[0].nbytes == 6 * 2048
    check_bytes(out, hs, data)
    scattered = [0, 2, 4, 1, 3, 5]
    out = shard.read_blocks([hs[i] for i in scattered])  # plain handle lists still work
    assert len(out.buffers) == 6
    check_bytes(out, [hs[i] for i in scattered], [data[i] for i in scattered])


def test_small_spans_are_packed_and_padded_columns_not_joined(
        meta: LocalMetadata, shard: ShardActor, w: Any) -> None:
    handles, arrays = write_prefix(shard, meta, w, 8, ["c4", "c128"])
    assert len(handles) == 12
    out = shard.read_blocks(HandleBatch.of(handles))
    assert len(out.buffers) == 1  # every span is under PACK_BELOW: one packed buffer
    check_bytes(out, handles, arrays)
    c128 = shard.pools["c128"]
    assert c128.stride == 256 and not c128.coalesces()  # 128 bytes of padding per block


def test_mixed_batch_reports_each_item(meta: LocalMetadata, shard: ShardActor, w: Any,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_mod, "PACK_BELOW", 0)
    handles, arrays = write_prefix(shard, meta, w, 5, ["c4"])
    handles, arrays = (list(x) for x in zip(*sorted(zip(handles, arrays, strict=True),
                                                    key=lambda p: p[0].block), strict=True))
    batch = list(handles)
    batch[2] = replace(handles[2], generation=handles[2].generation + 1)  # reused meanwhile
    batch.insert(4, replace(handles[0], group="nope"))  # type: ignore[arg-type]
    batch.append(replace(handles[0], block=10_000))
    out = shard.read_blocks(HandleBatch.of(batch))
    assert len(out) == 7
    stale, unknown, outside = out[2], out[4], out[6]
    assert isinstance(stale, ItemResult) and stale.outcome is Outcome.STALE
    assert "stale" in stale.detail
    assert isinstance(unknown, ItemResult) and unknown.outcome is Outcome.FAILED
    assert isinstance(outside, ItemResult) and outside.outcome is Outcome.FAILED
    check_bytes(PackedRead(out.buffers, [out.spans[i] for i in (0, 1, 3, 5)]),
                [handles[i] for i in (0, 1, 3, 4)], [arrays[i] for i in (0, 1, 3, 4)])
    assert len(out.buffers) == 2  # blocks 0-1 | 3-4 (the stale block 2 splits the run)
    assert shard.stats()["counts"]["stale_reads"] == 1


def test_write_batch_reports_stale_and_unknown_items(meta: LocalMetadata, shard: ShardActor,
                                                     w: Any) -> None:
    handles, arrays = write_prefix(shard, meta, w, 2, ["c4"])
    late = replace(handles[0], generation=handles[0].generation - 1)
    bad = replace(handles[1], group="nope")  # type: ignore[arg-type]
    res = shard.write_blocks(HandleBatch.of([late, bad]), arrays)
    assert [r.outcome for r in res] == [Outcome.STALE, Outcome.FAILED]
    with pytest.raises(ValueError):
        shard.write_blocks(HandleBatch.of(handles), arrays[:1])


def test_a_shared_pools_read_hands_ray_no_view_of_the_pool(meta: LocalMetadata,
                                                           tmp_path: Path, w: Any) -> None:
    """Claims over the control socket run beside Ray's calls, so an answer must not be a
    view a claim could write into before Ray copies it: every span is packed into the
    shard's reused buffer, under the lock. (Mutation-checked: returning the large spans as
    views fails here.)"""
    cfg = ShardConfig("s0", meta, str(tmp_path), blocks_per_group=64,
                      disk_budget_bytes=8 << 20, heartbeat_interval_s=60.0, device="cpu")
    shard = ShardActor(cfg)
    try:  # 40 adjacent c4 blocks: one span past PACK_BELOW, a view from a private pool
        handles, arrays = write_prefix(shard, meta, w, 40, ["c4"])
        assert 40 * handles[0].nbytes > shard_mod.PACK_BELOW
        out = shard.read_blocks(HandleBatch.of(handles))
        assert [bytes(out[i]) for i in range(len(handles))] == [bytes(a) for a in arrays]
        pools = [p.tensor.numpy() for p in shard.pools.pools.values()]
        assert not any(np.shares_memory(b, p) for b in out.buffers for p in pools)
    finally:
        shard.shutdown()
