"""Small timing helpers shared by the benches: best-of-N and percentiles."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["best_of", "percentile", "samples"]


def best_of(fn: Callable[[], object], repeat: int, number: int) -> float:
    """Seconds per call: the best of ``repeat`` batches of ``number`` calls (least noise)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - start) / number)
    return best


def samples(fn: Callable[[], object], count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
