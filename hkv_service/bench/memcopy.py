"""The plain memory copy a transfer is measured against, in the same run: one ``numpy``
copy of the same bytes between two buffers of this process that are already touched (one
pass over the source and one over the destination, one thread, no page faults), as hkv's own
copies are. ``hkv bench shard`` times it interleaved with the transfers; ``hkv bench vllm``
can take :func:`memcpy_gbps` per size and :func:`ratio_per_size`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["best_of", "memcpy_gbps", "plain_copy", "ratio_per_size"]


def best_of(fn: Callable[[], Any], reps: int) -> float:
    """Best of ``reps`` timed calls after one untimed warm-up call, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def plain_copy(nbytes: int) -> Callable[[], None]:
    """A call that copies ``nbytes`` bytes once (its buffers made and touched here)."""
    src = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)

    def copy() -> None:
        np.copyto(dst, src)
    return copy


def memcpy_gbps(nbytes: int, reps: int = 7) -> float:
    """GB/s of one plain copy of ``nbytes`` bytes (best of ``reps``)."""
    return nbytes / 1e9 / best_of(plain_copy(nbytes), reps)


def ratio_per_size(gbps: Mapping[str, float], copy_gbps: Mapping[str, float]) -> dict[str, float]:
    """``{size label: transfer GB/s over the plain copy's GB/s of that size}``."""
    return {label: round(v / copy_gbps[label], 3) for label, v in gbps.items()}
