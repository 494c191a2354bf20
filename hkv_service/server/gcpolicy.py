"""The metadata service's garbage-collection policy: no full collection over the whole heap.

A state view of millions of records is millions of GC-tracked objects; CPython's automatic
full collection walks all of them (seconds at millions of objects: ``hkv bench scale``'s
``service_gc_vs_full_gc_*``), and every lookup waits for it (the GIL). The core creates no
reference cycles that become garbage (``tests/core/test_no_cycles.py`` churns it and finds
none): records, entries, memos and segments are freed by reference counting the moment the
view drops them.
So the service process:

* turns automatic collection off, and freezes what exists at start (``gc.freeze``: frozen
  objects are never scanned again);
* freezes what a confirm re-created as soon as it returns (:func:`freeze_confirmed`): the
  view's own long-lived records, never scanned;
* every :data:`COLLECT_EVERY_S` (0.25 s) at most collects once and freezes the survivors. A
  collection scans only what was allocated since the last one, so its pause is the
  allocation rate times the interval, not the state's size; the interval halves while
  pauses run over :data:`PAUSE_TARGET_S` (down to :data:`MIN_EVERY_S`) and grows back while
  they are well under it (:func:`next_wait`), and a burst of :data:`YOUNG_OBJECTS` new
  objects is collected at once (:func:`due`). (Scanning each new object once costs the same
  at any interval; what fixed intervals gave: ``benchmarks/README.md``, "Measured while
  deciding".) Cycles made by other libraries (gRPC, logging) that are
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["COLLECT_EVERY_S", "MIN_EVERY_S", "PAUSE_TARGET_S", "YOUNG_OBJECTS", "GcStats",
           "due", "freeze_confirmed", "install", "next_wait", "paused"]

COLLECT_EVERY_S = 0.25  # the longest interval: an idle service collects this often
MIN_EVERY_S = 0.01  # the shortest: a collection's fixed cost is ~0.1 ms with the heap frozen
PAUSE_TARGET_S = 0.02  # what the interval is steered to keep a collection under
POLL_S = 0.01  # how often the policy's thread looks at the count of new objects
YOUNG_OBJECTS = 10_000  # new objects that are collected at once (~10-20 ms of scanning)
log = logging.getLogger(__name__)
_ONE_AT_A_TIME = threading.Lock()  # the policy's collection, or a caller's walk (paused)
_running: threading.Event | None = None  # the installed policy's stop event (None: not installed)


@dataclass(slots=True)
class GcStats:
    collections: int = 0
    collected: int = 0
    longest_pause_s: float = 0.0
    # the collecting thread's CPU time in that longest pause: near it, the collection walked
    # that much; far under it, the thread waited (the host, or the GIL in a gc callback)
    longest_pause_cpu_s: float = 0.0


def install(stop: threading.Event, every_s: float = COLLECT_EVERY_S) -> GcStats:
    """Apply the policy to this process; a daemon thread collects until ``stop`` is set."""
    global _running
    stats = GcStats()
    gc.collect()
    gc.freeze()
    gc.disable()
    _running = stop
    threading.Thread(target=_collect_loop, args=(stop, every_s, stats), daemon=True,
                     name="hkv-gc").start()
    return stats


def _collect_loop(stop: threading.Event, every_s: float, stats: GcStats,
                  clock: Callable[[], float] = time.monotonic) -> None:
    wait, last = every_s, clock()
    while not stop.wait(min(POLL_S, every_s)):
        if not due(clock() - last, wait, gc.get_count()[0]):
            continue
        wait = next_wait(wait, collect_young(stats), every_s)
        last = clock()


def due(elapsed: float, wait: float, young: int) -> bool:
    """Whether to collect now: the interval is over, or :data:`YOUNG_OBJECTS` new objects
    wait (a burst after an idle stretch, when the interval has grown: a re-confirm starting
    made its first interval's objects one long pause before the interval could shrink).
    ``young``
    is ``gc.get_count()[0]``, new tracked objects less those freed, frozen or not: it can
    read low while old objects die, so the interval still bounds the wait."""
    return elapsed >= wait or young >= YOUNG_OBJECTS


def next_wait(wait: float, pause: float, longest: float = COLLECT_EVERY_S) -> float:
    """The interval before the next collection, after one of ``pause`` seconds that came
    ``wait`` after the one before: half while over the target (the pause is the allocation
    rate times the interval), double while under a quarter of it, else the same; within
    [MIN_EVERY_S, longest]."""
    if pause > PAUSE_TARGET_S:
        return max(MIN_EVERY_S, wait / 2)
    if pause < PAUSE_TARGET_S / 4:
        return min(longest, wait * 2)
    return wait


def freeze_confirmed() -> None:
    """A confirm just re-created objects that live as long as the view: freeze them now,
    unscanned (the servicer's Confirm calls this, and ``hkv bench scale``'s re-confirm as it
    does): a collection would scan each of them once, for nothing. Whatever else is young is
    frozen with them, so a cycle already garbage then is kept; the service makes none
    (lookups, transitions, their refusals, confirms make no garbage cycle:
    ``tests/core/test_no_cycles.py``). Nothing
    unless the policy is installed and running; skipped while it collects or a caller walks
    the heap (``paused``): that collection freezes them anyway."""
    if _running is None or _running.is_set() or not _ONE_AT_A_TIME.acquire(blocking=False):
        return
    try:
        gc.freeze()
    finally:
        _ONE_AT_A_TIME.release()


@contextmanager
def paused() -> Iterator[None]:
    """No collection (nor freeze) by the policy while the caller walks the heap itself: a
    baseline full collection (``hkv bench scale``'s ``full_gc_ms``) that unfreezes the heap
    would otherwise find that the policy froze it again in the meantime, and time nothing."""
    with _ONE_AT_A_TIME:
        yield


def collect_young(stats: GcStats) -> float:
    """One bounded collection: everything older is frozen, so this walks only what was
    allocated since the last one; its survivors are frozen in turn. Returns its pause."""
    with _ONE_AT_A_TIME:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        found = gc.collect()
        gc.freeze()
        pause, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    stats.collections += 1
    stats.collected += found
    if pause > stats.longest_pause_s:
        stats.longest_pause_s, stats.longest_pause_cpu_s = pause, cpu
    if pause > 0.05:
        log.warning("gc: a collection took %.0f ms, %.0f ms of it on the CPU (%d objects "
                    "collected)", pause * 1e3, cpu * 1e3, found)
    return pause
