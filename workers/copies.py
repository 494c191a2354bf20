"""The copies of a transfer's bytes, split over the calling thread and helper threads.

One thread copying block by block moves about half of what one large copy does: glibc's
``memcpy`` streams past the caches (non-temporal stores) only for copies of tens of MiB, so
a 1 MiB block is copied through the caches (measured 2026-12-07 on the 2-core Xeon host: one
64 MiB copy 10.4 GB/s; the same bytes as 64 copies of 1 MiB, 5.9 GB/s; split over the caller
and one helper thread, 9.8 GB/s; a single 1 MiB copy 86 us alone, 54 us split in two).
``numpy.copyto`` lets go of the GIL while it copies, so threads of one process copy at once.

Tried and reverted (2026-12-07): copies of up to 256 KiB that *keep* the GIL (one void
element: numpy lets go of it only from 500 elements). In process against vLLM's spinning
engine loop they cut a 1 MiB load from 2.6-15.7 ms to 1.6-2.8 ms (``hkv bench vllm
--quick``), but in ``hkv bench serve``, where vLLM's worker process is bound to one core with
the lanes beside the model, a load took 7.5-7.8 ms against 1.9-2.4 ms without (two full runs
each way): a thread preempted in the middle of a copy holding the GIL stalls every other one.

:meth:`Copier.copy` cuts the bytes of a list of ``(dest, source)`` pairs into at most one
part per usable core (each at least :data:`MIN_PART_BYTES`), copies the first part itself and
hands the others to helper threads. It returns, or raises, only once *every* part is done: a
write finishes its blocks (readable) and a read checks its seqlock after the call, so no copy
may still be running then (a late copy would land in a block given back or reused).

Helpers are made on first use, as many as the cores this process may run on minus one, at
most :data:`MAX_HELPERS`: a process bound to one core (vLLM's CPU worker binds its model
threads) copies alone, and never takes a core it was not given. A forked child makes its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Sequence

import numpy as np

__all__ = ["MAX_HELPERS", "MIN_PART_BYTES", "Copier", "copier"]

MIN_PART_BYTES = 1 << 20  # smaller parts cost more in handing over than they save
MAX_HELPERS = 3  # memory bandwidth saturates at a few threads per socket

Pair = tuple[np.ndarray, np.ndarray]  # (dest, source): uint8, one dimension, same length


class _Part:
    """A part handed to a helper: its copies, then ``done`` released (with ``error`` set if
    one raised)."""

    __slots__ = ("done", "error", "pairs")

    def __init__(self, pairs: list[Pair]) -> None:
        self.pairs = pairs
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()


class Copier:
    """Copies split over the caller and ``helpers`` threads (0: the caller alone)."""

    def __init__(self, helpers: int) -> None:
        self.helpers = max(0, helpers)
        self._jobs: queue.SimpleQueue[_Part] = queue.SimpleQueue()
        self._started = 0
        self._lock = threading.Lock()

    def copy(self, pairs: Sequence[Pair]) -> None:
        """``np.copyto(dest, source)`` for every pair; returns once every byte is copied.
        An error in any part is raised after every part has finished."""
        parts = self._split(pairs)
        if len(parts) == 1:
            _copy_all(parts[0])
            return
        self._start(len(parts) - 1)
        handed = [_Part(p) for p in parts[1:]]
        for part in handed:
            self._jobs.put(part)
        error: BaseException | None = None
        try:
            _copy_all(parts[0])
        except BaseException as exc:  # (the helpers' parts still run: wait for them first)
            error = exc
        for part in handed:
            part.done.acquire()
            error = error or part.error
        if error is not None:
            raise error

    def _split(self, pairs: Sequence[Pair]) -> list[list[Pair]]:
        """The pairs cut into at most ``helpers + 1`` parts of about equal bytes, each at
        least MIN_PART_BYTES (a pair cut where a part ends). Pairs that are not both one
        dimension of one size are copied as they are, by the caller (``np.copyto`` decides)."""
        if not self.helpers:
            return [list(pairs)]
        total = sum(d.size for d, _ in pairs)  # (a read of a few KiB stops here)
        ways = min(self.helpers + 1, total // MIN_PART_BYTES)
        if ways <= 1 or any(d.ndim != 1 or s.ndim != 1 or d.size != s.size for d, s in pairs):
            return [list(pairs)]
        share = -(-total // ways)
        parts: list[list[Pair]] = [[]]
        room = share
        for dest, src in pairs:
            at, n = 0, dest.size
            while at < n:
                if room == 0:
                    parts.append([])
                    room = share
                take = min(room, n - at)
                parts[-1].append((dest[at : at + take], src[at : at + take]))
                at += take
                room -= take
        return parts

    def _start(self, wanted: int) -> None:
        with self._lock:
            while self._started < min(wanted, self.helpers):
                threading.Thread(target=self._serve, name=f"hkv-copy-{self._started}",
                                 daemon=True).start()
                self._started += 1

    def _serve(self) -> None:
        while True:
            part = self._jobs.get()
            try:
                _copy_all(part.pairs)
            except BaseException as exc:  # handed back to the caller, which raises it
                part.error = exc
            finally:
                # no view of a segment outlives its copy here: a mapping let go of (a dead
                # shard's) is unmapped only once nothing refers to it
                part.pairs = []
                part.done.release()


def _copy_all(pairs: Sequence[Pair]) -> None:
    for dest, src in pairs:
        np.copyto(dest, src)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # (this thread's: what its helpers inherit)
    except (AttributeError, OSError):
        return os.cpu_count() or 1


_copier: Copier | None = None
_copier_lock = threading.Lock()


def copier() -> Copier:
    """This process's copier (made on first use: the cores it may use are known by then)."""
    global _copier
    c = _copier
    if c is None:
        with _copier_lock:
            if _copier is None:
                _copier = Copier(min(MAX_HELPERS, _usable_cores() - 1))
            c = _copier
    return c


def _forget() -> None:  # a forked child has none of its parent's helper threads
    global _copier, _copier_lock
    _copier, _copier_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget)
