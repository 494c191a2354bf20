"""The CUDA path of the block pool and the shard (RELIABILITY row 25, "G": GPU only).

Skipped without CUDA. Checks that a write becomes readable only through its copy event, that
generations are re-checked around the device copy, and that D2H -> disk -> H2D is byte-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hkv_service.core.api import AllocRequest
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from workers.local import LocalMetadata
from workers.pool import BlockPool, StaleRead
from workers.ports import Commit
from workers.shard import ShardActor, ShardConfig
from workers.tags import BlockTag

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_pool_round_trip_readiness_and_stale() -> None:
    pool = BlockPool("c", 4 << 20, 4, torch.device("cuda"))
    assert pool.tensor.is_cuda and pool.config.base_align >= 256
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    pool.write(1, 0, data, object_id=3)
    assert np.array_equal(pool.read(1, 0, 3), data)  # waits for the side-stream event
    pool.write(1, 1, data[::-1].copy(), object_id=4)
    with pytest.raises(StaleRead):
        pool.read(1, 0, 3)
    assert np.array_equal(pool.read(1, 1, 4), data[::-1])


def test_cuda_shard_offload_load_round_trip(tmp_path: Path, w: Any) -> None:
    meta = LocalMetadata(CacheState(default_spec()))
    shard = ShardActor(ShardConfig("g0", meta, str(tmp_path), 8, 8 << 20,
                                   heartbeat_interval_s=60.0, device="cuda"))
    assert shard.pools.device.type == "cuda"
    hashes = w.prompt(1, seed=3)
    alloc = meta.allocate(hashes, [AllocRequest(0, "c4")], ShardId("g0"))[0]
    data = np.random.default_rng(1).integers(0, 256, 2048, dtype=np.uint8)
    [res] = shard.write_blocks([alloc.handle], [data], [BlockTag(hashes[0], None, 0)],
                               [Commit((Event.WRITE_DONE,))])
    assert res.ok
    [off] = shard.offload([alloc.handle], evict_memory=True)
    assert off.ok and off.handle is not None
    [ld] = shard.load([(off.handle, hashes[0])])
    assert ld.ok and ld.handle is not None
    assert meta.state.objects[off.handle.object_id].state is State.ON_DISK_READY
    out = shard.read_blocks([ld.handle])[0]
    assert isinstance(out, np.ndarray) and np.array_equal(out, data)
    shard.shutdown()


def test_cuda_pool_batched_read_check_and_take() -> None:
    """The batched read path: readiness + generation check for many blocks, one D2H copy per
    run of adjacent blocks, and a re-check after the copy that catches a reused block."""
    pool = BlockPool("c", 1 << 16, 8, torch.device("cuda"))
    data = [np.full(1 << 16, i, dtype=np.uint8) for i in range(8)]
    for i in range(8):
        pool.write(i, 0, data[i], object_id=i)
    blocks = np.arange(2, 6, dtype=np.int64)
    ok = pool.readable(blocks, np.zeros(4, np.int64), blocks.copy())
    assert ok.all()
    run = pool.take(2, 4)
    assert run.nbytes == 4 << 16 and all((run[k << 16 : (k + 1) << 16] == 2 + k).all()
                                         for k in range(4))
    pool.write(3, 1, data[0], object_id=99)  # reused after the copy: the re-check refuses it
    again = pool.readable(blocks, np.zeros(4, np.int64), blocks.copy())
    assert again.tolist() == [True, False, True, True]
