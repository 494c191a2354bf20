"""workers/pool.py: generations, the stale contract, readiness, alignment."""

from __future__ import annotations

import numpy as np
import pytest

from workers.pool import ALIGN, BlockPool, PoolSet, StaleRead, StaleWrite, pick_device


def make_pool(nbytes: int = 1000, blocks: int = 4) -> BlockPool:
    return BlockPool("c", nbytes, blocks, pick_device("cpu"))


def test_stride_and_config_are_aligned() -> None:
    pool = make_pool(1000)
    assert pool.stride == 1024 and pool.stride % ALIGN == 0
    cfg = pool.config
    assert cfg.num_blocks == 4 and cfg.stride == 1024
    assert cfg.base_align & (cfg.base_align - 1) == 0
    assert pool.base_address % cfg.base_align == 0


def test_write_read_round_trip_and_copy_semantics() -> None:
    pool = make_pool()
    data = np.arange(1000, dtype=np.uint16).astype(np.uint8)
    pool.write(2, 0, data, object_id=7)
    out = pool.read(2, 0, 7)
    assert np.array_equal(out, data)
    pool.write(2, 0, data, object_id=7)  # retried write: harmless
    assert np.array_equal(pool.read(2, 0), data)


def test_stale_generation_and_occupant() -> None:
    pool = make_pool()
    pool.write(0, 0, b"a" * 10, object_id=1)
    pool.write(0, 1, b"b" * 10, object_id=2)  # block freed and reused
    with pytest.raises(StaleRead):
        pool.read(0, 0, 1)
    with pytest.raises(StaleRead):
        pool.read(0, 1, 1)  # right generation, wrong object
    with pytest.raises(StaleWrite):
        pool.write(0, 0, b"late", object_id=1)  # a late writer never clobbers the reuse
    with pytest.raises(StaleWrite):
        pool.write(0, 1, b"other", object_id=3)
    assert bytes(pool.read(0, 1, 2)[:10]) == b"b" * 10


def test_empty_and_forgotten_blocks_are_never_readable() -> None:
    pool = make_pool()
    with pytest.raises(StaleRead):
        pool.read(1, 0)
    pool.write(1, 0, b"x", object_id=5)
    pool.forget(1, 5)
    with pytest.raises(StaleRead):
        pool.read(1, 0)
    pool.write(1, 0, b"y", object_id=6)  # the block's next writer may claim it
    assert pool.read(1, 0, 6)[0] == ord("y")


def test_oversize_write_is_refused() -> None:
    with pytest.raises(ValueError):
        make_pool(16).write(0, 0, b"x" * 17)


def test_pool_set_builds_one_pool_per_column() -> None:
    ps = PoolSet({"a": 100, "b.tail": 3000}, 8, "cpu")
    assert set(ps.configs()) == {"a", "b.tail"}
    assert ps["b.tail"].stride == 3072
    assert ps.nbytes() == 8 * (256 + 3072)
