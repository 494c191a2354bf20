"""A block never shows bytes its object did not write: every write is exactly its object's
size (kind, column, SWA range, tail length), refused otherwise with nothing made readable,
and a read returns exactly the object's bytes, through the real ShardActor and pool.

Regression (issue 15, item 1): a 16-byte write of a c4 block (2,048 B) was accepted and
committed COMPRESSED_READY over a block whose bytes 16.. were an evicted object's; reading it
returned all 2,048 bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hkv_service.core.api import AllocRequest, Params
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.states import Event, State
from workers.local import LocalMetadata
from workers.pool import BlockPool
from workers.ports import Commit, Outcome
from workers.shard import ShardActor, ShardConfig
from workers.tags import BlockTag

C4 = 2048  # bytes of one c4 block in the reference spec
TOKEN = 2 * 16 * 4  # bytes of one token of c4.tail and swa (head (2, 16), float32)


@pytest.fixture
def shard(meta: LocalMetadata, tmp_path: Path) -> Any:
    # one block per column: an evicted object's block is the very next one handed out
    cfg = ShardConfig("s0", meta, str(tmp_path), blocks_per_group=1,
                      disk_budget_bytes=8 << 20, heartbeat_interval_s=60.0, device="cpu")
    actor = ShardActor(cfg)
    yield actor
    actor.shutdown()


def _write(shard: ShardActor, meta: LocalMetadata, hashes: list[BlockHash], depth: int,
           column: str, data: Any, commit: Commit) -> Any:
    alloc = meta.allocate(hashes, [AllocRequest(depth, column)], ShardId("s0"))[0]
    tag = BlockTag(hashes[depth], hashes[depth - 1] if depth else None, depth)
    [res] = shard.write_blocks([alloc.handle], [data], [tag], [commit])
    return alloc.handle, res


def _bytes(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 16, C4 - 1, C4 + 1, 2 * C4])
def test_a_wrong_size_is_refused_and_never_readable(shard: ShardActor, meta: LocalMetadata,
                                                    w: Any, size: int) -> None:
    hashes = w.prompt(2)
    a, res = _write(shard, meta, hashes, 0, "c4", _bytes(C4, 1), Commit((Event.WRITE_DONE,)))
    assert res.ok
    meta.evict(a.object_id)  # its block (the pool's only one) goes back, bytes and all
    b, res = _write(shard, meta, w.prompt(2, seed=5), 0, "c4", _bytes(size, 2),
                    Commit((Event.WRITE_DONE,)))
    assert b.block == a.block
    assert res.outcome is Outcome.FAILED and f"exactly {C4} bytes" in res.detail
    assert meta.state.objects[b.object_id].state is State.ALLOCATED  # never committed
    [out] = shard.read_blocks([b])
    assert not getattr(out, "ok", True) and out.outcome is Outcome.STALE  # nothing to read


def test_read_after_evict_and_reuse_shows_no_byte_of_the_earlier_object(
        shard: ShardActor, meta: LocalMetadata, w: Any) -> None:
    """A tail shorter than its block: the read is exactly its bytes, and the block's rest holds
    zeros, never the previous occupant's bytes."""
    hashes = w.prompt(2)
    n = meta.state.layout.tail_tokens(meta.state.layout.by_name["c4.tail"], 1)
    full = meta.state.layout.columns[meta.state.layout.by_name["c4.tail"]].nbytes
    a, res = _write(shard, meta, hashes, 1, "c4.tail", _bytes(full, 3),
                    Commit((Event.TAIL_DONE,), (Params(tail_len=n),)))
    assert res.ok
    meta.evict(a.object_id)
    half = n // 2
    b, res = _write(shard, meta, w.prompt(2, seed=7), 1, "c4.tail", _bytes(half * TOKEN, 4),
                    Commit((Event.TAIL_APPEND,), (Params(tail_len=half),)))
    assert res.ok and b.block == a.block  # a partial tail, written as the half it is
    rest = shard.pools["c4.tail"]._host[b.block, half * TOKEN : full]  # type: ignore[index]
    assert not rest.any()  # zeroed: no byte of the earlier tail left in the block


def test_swa_range_and_tail_length_set_the_size(shard: ShardActor, meta: LocalMetadata,
                                                w: Any) -> None:
    hashes = w.prompt(2)
    rng = Commit((Event.WRITE_DONE,), (Params(lo=16, hi=64),))  # 48 valid tokens
    _, res = _write(shard, meta, hashes, 0, "swa", _bytes(64 * TOKEN, 5), rng)
    assert res.outcome is Outcome.FAILED and f"exactly {48 * TOKEN} bytes" in res.detail
    h, res = _write(shard, meta, hashes, 0, "swa", _bytes(48 * TOKEN, 5), rng)
    assert res.ok
    [out] = shard.read_blocks([h])
    assert out.nbytes == 48 * TOKEN  # exactly the object's bytes
    _, res = _write(shard, meta, hashes, 1, "c4.tail", _bytes(2 * TOKEN, 6),
                    Commit((Event.TAIL_DONE,), (Params(tail_len=4),)))
    assert res.outcome is Outcome.FAILED  # 2 tokens of bytes for a 4-token tail


def test_the_pool_refuses_empty_and_oversize_writes() -> None:
    pool = BlockPool("c4", C4, 2, torch.device("cpu"))
    for size in (0, C4 + 1):
        with pytest.raises(ValueError, match="cannot be a 'c4' object"):
            pool.write(0, 0, np.ones(size, np.uint8), 1)
    pool.write(1, 0, np.full(C4, 7, np.uint8), 1)
    pool.write(1, 1, np.full(10, 9, np.uint8), 2)  # reused by a 10-byte object
    out = pool.read(1, 1, 2)
    assert out.nbytes == 10 and (out == 9).all()
    assert not pool._host[1, 10:C4].any()  # type: ignore[index]
