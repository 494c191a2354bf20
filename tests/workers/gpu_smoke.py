"""Stand-alone CUDA smoke check of workers/pool.py (needs only torch + numpy), for GPU hosts
without the rest of the stack: ``PYTHONPATH=. python tests/workers/gpu_smoke.py``."""

from __future__ import annotations

import time

import numpy as np
import torch

from workers.pool import BlockPool, PoolSet, StaleRead, StaleWrite


def main() -> None:
    pool = BlockPool("c", 4 << 20, 4, torch.device("cuda"))
    print("cuda", pool.tensor.is_cuda, "base_align", pool.config.base_align)
    data = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    pool.write(1, 0, data, object_id=3)
    assert np.array_equal(pool.read(1, 0, 3), data)
    pool.write(1, 1, data[::-1].copy(), object_id=4)
    try:
        pool.read(1, 0, 3)
        raise AssertionError("stale read served")
    except StaleRead:
        print("stale read refused")
    try:
        pool.write(1, 0, data, object_id=3)
        raise AssertionError("stale write accepted")
    except StaleWrite:
        print("stale write refused")
    assert np.array_equal(pool.read(1, 1, 4), data[::-1])
    ps = PoolSet({"a": 65536}, 64, "auto")
    ro = np.frombuffer(bytes(65536), np.uint8)  # read-only, as Ray hands arrays over
    for b in range(64):
        ps["a"].write(b, 0, np.full(65536, b, np.uint8), object_id=b)
    ps["a"].write(0, 1, ro, object_id=100)
    assert all(ps["a"].read(b, 0, b)[0] == b for b in range(1, 64))
    assert ps["a"].read(0, 1, 100).sum() == 0
    big = BlockPool("big", 4 << 20, 16, torch.device("cuda"))
    arrs = [np.random.default_rng(i).integers(0, 256, 4 << 20, dtype=np.uint8) for i in range(16)]
    for rep in range(2):
        t = time.perf_counter()
        for i, a in enumerate(arrs):
            big.write(i, rep, a, object_id=i)
        for i in range(16):
            big.wait(i)
        w = time.perf_counter() - t
        t = time.perf_counter()
        outs = [big.read(i, rep, i) for i in range(16)]
        r = time.perf_counter() - t
    gb = 16 * (4 << 20) / 1e9
    print(f"H2D write 4MiB {gb / w:.2f} GB/s, D2H read 4MiB {gb / r:.2f} GB/s")
    assert all(np.array_equal(o, a) for o, a in zip(outs, arrs, strict=True))
    print("ALL OK")


if __name__ == "__main__":
    main()
