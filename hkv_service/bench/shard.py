"""Shard benchmark: block write/read throughput through the shard actor against a plain Ray
actor moving the same bytes as numpy, and a local tensor copy, measured in the same run.

Setup: one :class:`workers.shard.ShardActor` on a local Ray instance, with the metadata in a
:class:`workers.raylink.MetadataActor` (no gRPC: the data plane never calls the service on a
read or a plain write, so gRPC would only slow down the one-off allocation). The bench spec
has one SWA group per block size (64 KiB, 1 MiB, 4 MiB). Data-plane calls are batched, so
every call moves ``batch_bytes`` (64 MiB; 16 MiB with ``--quick``): N blocks of one size per
call (1,024 x 64 KiB, 64 x 1 MiB, 16 x 4 MiB), against the baseline moving the same N arrays
(the same total bytes) per call.

* ours: ``write_blocks(batch, arrays)`` (copy into the torch pool) and ``read_blocks(batch)``
  (readiness + generation re-check, then the pool views handed to Ray, which copies them into
  its object store), where ``batch = HandleBatch.of(handles)`` is built inside the timed call,
  as :class:`workers.dataplane.DataPlane` does. Handles allocated one after another sit in
  adjacent blocks, which a read moves as one span (one Ray buffer, where the baseline has N);
  ``read_scattered`` reads the 64 KiB blocks even ones first, then odd ones (no two adjacent
  in request order), so every block is its own buffer, as in the baseline. The headline
  ``read_vs_numpy_roundtrip`` is the lowest read ratio, the scattered one included.
* baseline ``numpy_actor``: an actor that stores numpy arrays on ``put`` and returns them on
  ``get``: Ray's zero-copy numpy path with no pool, no checks. ``read_vs_numpy_roundtrip``
  = our read GB/s over its ``get`` GB/s (target >= 0.8).
* baseline ``tensor_copy``: ``torch.Tensor.copy_`` of the same bytes in this process (the
  memory-bandwidth ceiling of one copy).
* ``call_overhead_us``: an empty batch through each actor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from hkv_service.core.api import AdmissionCap, AllocRequest, StateConfig
from hkv_service.core.ids import BlockHash
from hkv_service.core.spec import spec_from_dict
from workers.pool import HandleBatch

__all__ = ["run"]

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64KiB": 64 * KiB, "1MiB": MiB, "4MiB": 4 * MiB}
TOKENS = 64  # tokens per block of every bench group


def _spec() -> Any:
    groups = [{"name": f"b{label}", "kind": "SWA", "block_size": TOKENS, "window": TOKENS,
               "abi": {"dtype": "uint8", "head_shape": [size // TOKENS]}}
              for label, size in SIZES.items()]
    return spec_from_dict({"model_id": "hkv-bench-shard", "hash_block_size": TOKENS,
                           "groups": groups})


class _NumpyActor:
    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def put(self, arrays: list[np.ndarray]) -> int:
        self.arrays = [np.array(a, copy=True) for a in arrays]
        return len(self.arrays)

    def get(self, n: int) -> list[np.ndarray]:
        return self.arrays[:n]


def _best(fn: Callable[[], Any], reps: int) -> float:
    """Best of ``reps`` timed calls after one untimed warm-up call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _setup(batch_blocks: dict[str, int], tmp: str) -> tuple[Any, Any, dict[str, list[Any]]]:
    from workers.launcher import shard_actor_class
    from workers.raylink import ActorMetadata, MetadataActor
    from workers.shard import ShardConfig

    meta_actor = MetadataActor.remote(_spec(), StateConfig(AdmissionCap()))
    meta = ActorMetadata(meta_actor, timeout_s=60)
    cfg = ShardConfig("bench", meta, tmp, blocks_per_group=max(batch_blocks.values()),
                      disk_budget_bytes=64 * MiB, heartbeat_interval_s=5.0, device="auto")
    shard = shard_actor_class(0, 0).remote(cfg)
    ray.get(shard.ping.remote(), timeout=120)
    handles = {}
    for label, n in batch_blocks.items():
        hashes = [BlockHash(i.to_bytes(16, "big")) for i in range(1, n + 1)]
        allocs = meta.allocate(hashes, [AllocRequest(d, f"b{label}") for d in range(n)],
                               "bench")  # type: ignore[arg-type]
        handles[label] = [a.handle for a in allocs]
    return meta_actor, shard, handles


def _best_pair(fa: Callable[[], Any], fb: Callable[[], Any], reps: int) -> tuple[float, float]:
    """Best times of ``fa`` and ``fb``, interleaved (so drift on a busy host hits both)."""
    fa(), fb()
    ta = tb = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
    return ta, tb


def _measure_size(label: str, size: int, n: int, shard: Any, echo: Any,
                  handles: list[Any], reps: int) -> dict[str, float]:
    arrays = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8) for i in range(n)]
    total = size * n
    write, put = _best_pair(
        lambda: ray.get(shard.write_blocks.remote(HandleBatch.of(handles), arrays)),
        lambda: ray.get(echo.put.remote(arrays)), reps)
    read, get = _best_pair(lambda: ray.get(shard.read_blocks.remote(HandleBatch.of(handles))),
                           lambda: ray.get(echo.get.remote(n)), reps)
    out = ray.get(shard.read_blocks.remote(HandleBatch.of(handles)))
    assert all(np.array_equal(a, b) for a, b in zip(out, arrays, strict=True)), "bytes differ"
    extra: dict[str, float] = {}
    if size < MiB and n > 2:  # every other block first, then the rest: no two adjacent
        order = [*range(0, n, 2), *range(1, n, 2)]
        scattered = [handles[i] for i in order]
        read_s, get_s = _best_pair(
            lambda: ray.get(shard.read_blocks.remote(HandleBatch.of(scattered))),
            lambda: ray.get(echo.get.remote(n)), reps)
        out = ray.get(shard.read_blocks.remote(HandleBatch.of(scattered)))
        assert len(out.buffers) == n, "scattered blocks were coalesced"
        assert all(np.array_equal(out[j], arrays[i]) for j, i in enumerate(order)), "differ"
        extra = {"read_scattered_gbps": total / 1e9 / read_s,
                 "numpy_get_scattered_gbps": total / 1e9 / get_s}
    src = torch.from_numpy(np.concatenate(arrays))
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), reps)
    gb = total / 1e9
    return {"write_gbps": gb / write, "read_gbps": gb / read, "numpy_put_gbps": gb / put,
            "numpy_get_gbps": gb / get, "tensor_copy_gbps": gb / copy, **extra}


def run(quick: bool = False) -> dict[str, Any]:
    """Measure and return ``{"name", "quick", "figures", "baseline", "ratios"}``."""
    import tempfile

    batch_bytes, reps = (16 * MiB, 3) if quick else (64 * MiB, 7)
    batch_blocks = {label: max(1, batch_bytes // size) for label, size in SIZES.items()}
    started = not ray.is_initialized()
    if started:
        from workers.launcher import init_local_ray

        init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory(prefix="hkv-bench-shard-") as tmp:
            meta_actor, shard, handles = _setup(batch_blocks, tmp)
            echo_cls: Any = ray.remote(num_cpus=0)(_NumpyActor)
            echo = echo_cls.remote()
            per = {label: _measure_size(label, size, batch_blocks[label], shard, echo,
                                        handles[label], reps)
                   for label, size in SIZES.items()}
            overhead = {
                "shard_us": 1e6 * _best(lambda: ray.get(shard.read_blocks.remote([])), 50),
                "numpy_actor_us": 1e6 * _best(lambda: ray.get(echo.get.remote(0)), 50),
            }
            device = ray.get(shard.ping.remote())["device"]
            for actor in (shard, echo, meta_actor):
                ray.kill(actor, no_restart=True)
    finally:
        if started:
            ray.shutdown()
    return _report(quick, per, overhead, batch_bytes, device)


def r3(x: float) -> float:
    return round(x, 3)


def _report(quick: bool, per: dict[str, dict[str, float]], overhead: dict[str, float],
            batch_bytes: int, device: str) -> dict[str, Any]:
    figures: dict[str, Any] = {"batch_bytes": batch_bytes, "device": device,
                               "call_overhead_us": {"shard": r3(overhead["shard_us"])}}
    baseline: dict[str, Any] = {"call_overhead_us": {"numpy_actor": r3(overhead["numpy_actor_us"])}}
    ratios: dict[str, float] = {}
    for label, m in per.items():
        figures[label] = {"write_gbps": r3(m["write_gbps"]), "read_gbps": r3(m["read_gbps"])}
        baseline[label] = {"numpy_actor_put_gbps": r3(m["numpy_put_gbps"]),
                           "numpy_actor_get_gbps": r3(m["numpy_get_gbps"]),
                           "tensor_copy_gbps": r3(m["tensor_copy_gbps"])}
        ratios[f"read_vs_numpy_roundtrip_{label}"] = r3(m["read_gbps"] / m["numpy_get_gbps"])
        ratios[f"write_vs_numpy_roundtrip_{label}"] = r3(m["write_gbps"] / m["numpy_put_gbps"])
        if "read_scattered_gbps" in m:
            figures[label]["read_scattered_gbps"] = r3(m["read_scattered_gbps"])
            ratios[f"read_scattered_vs_numpy_roundtrip_{label}"] = r3(
                m["read_scattered_gbps"] / m["numpy_get_scattered_gbps"])
    ratios["read_vs_numpy_roundtrip"] = r3(min(v for k, v in ratios.items()
                                               if k.startswith("read_")))
    return {"name": "shard", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": ratios}
