"""The metadata service's garbage-collection policy: no full collection over the whole heap.

A state view of millions of records is millions of GC-tracked objects; CPython's automatic
full collection walks all of them (1.0-1.3 s at 1M objects, ~3.5-5 s at 4M, measured for
issue 19), and every lookup waits for it (the GIL). The core creates no reference cycles
that become garbage (``tests/core/test_no_cycles.py`` churns it and finds none): records,
entries, memos and segments are freed by reference counting the moment the view drops them.
So the service process:

* turns automatic collection off, and freezes what exists at start (``gc.freeze``: frozen
  objects are never scanned again);
* every :data:`COLLECT_EVERY_S` (0.25 s) collects once and freezes the survivors. A
  collection scans only what was allocated since the last one, so its pause is bounded by
  the allocation rate over that period, not by the state's size. (`hkv bench scale` at
  1M objects, 2026-12-02: at 1 s the longest collection was 114 ms, during the re-confirm
  that rebuilds the view; at 0.25 s, 38 ms. Scanning each new object once costs the same
  either way.) Cycles made by other libraries (gRPC, logging) that are
  garbage by then are collected; one that becomes garbage only after it was frozen stays
  (the price of never walking the heap; the core makes none).

Only processes that are the service (``hkv serve``, the ``--address`` service actor) install
it, and ``hkv bench scale``'s children, which measure the view as the service runs it: a test
that merely runs a state view in its own process keeps CPython's defaults.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["COLLECT_EVERY_S", "GcStats", "install", "paused"]

COLLECT_EVERY_S = 0.25
log = logging.getLogger(__name__)
_ONE_AT_A_TIME = threading.Lock()  # the policy's collection, or a caller's walk (paused)


@dataclass(slots=True)
class GcStats:
    collections: int = 0
    collected: int = 0
    longest_pause_s: float = 0.0


def install(stop: threading.Event, every_s: float = COLLECT_EVERY_S) -> GcStats:
    """Apply the policy to this process; a daemon thread collects until ``stop`` is set."""
    stats = GcStats()
    gc.collect()
    gc.freeze()
    gc.disable()
    threading.Thread(target=_collect_loop, args=(stop, every_s, stats), daemon=True,
                     name="hkv-gc").start()
    return stats


def _collect_loop(stop: threading.Event, every_s: float, stats: GcStats) -> None:
    while not stop.wait(every_s):
        collect_young(stats)


@contextmanager
def paused() -> Iterator[None]:
    """No collection (nor freeze) by the policy while the caller walks the heap itself: a
    baseline full collection (``hkv bench scale``'s ``full_gc_ms``) that unfreezes the heap
    would otherwise find that the policy froze it again in the meantime, and time nothing."""
    with _ONE_AT_A_TIME:
        yield


def collect_young(stats: GcStats) -> None:
    """One bounded collection: everything older is frozen, so this walks only what was
    allocated since the last one; its survivors are frozen in turn."""
    with _ONE_AT_A_TIME:
        t0 = time.perf_counter()
        found = gc.collect()
        gc.freeze()
        pause = time.perf_counter() - t0
    stats.collections += 1
    stats.collected += found
    stats.longest_pause_s = max(stats.longest_pause_s, pause)
    if pause > 0.05:
        log.warning("gc: a collection took %.0f ms (%d objects collected)", pause * 1e3, found)
