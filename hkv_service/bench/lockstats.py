"""A re-entrant lock that times itself: how long callers wait for it and how long it is held.

The service bench swaps it in for the state view's lock (``CacheState(lock=...)``) to show
whether that one lock bounds concurrent throughput: a lock held for a small fraction of the
wall time, with little wait per acquisition, is not the bottleneck. Only the outermost
acquisition of a thread is timed (the view's methods nest); every counter is updated while
the lock is held, so a snapshot taken under it is consistent. The scale bench also reads the
hold of one call (``last_held_s``: the calling thread's last outermost hold) and the longest
hold of a window and the thread that held it (``take_max_held``). With ``thread_cpu`` each
hold's thread CPU time is taken too (``thread_time`` and a ``getrusage`` of the thread at each
end, ~2 us): a hold is timed in wall-clock, so a thread switch inside it counts; its CPU time
tells work from waiting, and its system time and page faults tell the kernel's work (memory
mapped in: in a VM, the host backing the guest's pages) from the code's. (The system time is
as of the last tick: rough for a hold of a few ms; the faults are counted.)
"""

from __future__ import annotations

import resource
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Hold", "LockStats", "TimedLock"]

_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # (Linux; else thread_time only)


class Hold(NamedTuple):
    """One outermost hold: its wall-clock time, the thread, and (``thread_cpu``) that thread's
    CPU time in it, the system part of it, and the minor page faults it took."""

    held_s: float
    thread: int
    cpu_s: float = 0.0
    sys_s: float = 0.0
    minor_faults: int = 0


_NO_HOLD = Hold(0.0, 0)


def _thread_usage() -> tuple[float, float, int]:
    """(CPU, system time, minor faults) of the calling thread so far. The CPU time is
    ``thread_time``'s: ``getrusage`` reads a running thread's as of its last tick."""
    if _RUSAGE_THREAD is None:
        return time.thread_time(), 0.0, 0
    r = resource.getrusage(_RUSAGE_THREAD)
    return time.thread_time(), r.ru_stime, r.ru_minflt


@dataclass(frozen=True, slots=True)
class LockStats:
    at_s: float  # perf_counter when the snapshot was taken
    acquisitions: int  # outermost acquisitions
    contended: int  # of those, how many found the lock taken and had to wait
    wait_s: float  # total time contended acquisitions spent waiting
    held_s: float  # total time held (outermost acquire to release)

    def since(self, earlier: LockStats) -> dict[str, float]:
        """What happened between ``earlier`` and this snapshot, as figures."""
        acquired = max(1, self.acquisitions - earlier.acquisitions)
        wall = self.at_s - earlier.at_s
        return {
            "acquisitions": float(self.acquisitions - earlier.acquisitions),
            "held_fraction": (self.held_s - earlier.held_s) / wall if wall > 0 else 0.0,
            "held_us_per_acquisition": 1e6 * (self.held_s - earlier.held_s) / acquired,
            "wait_us_per_acquisition": 1e6 * (self.wait_s - earlier.wait_s) / acquired,
            # hold times include any thread switch while held: upper bounds
            "contended_fraction": (self.contended - earlier.contended) / acquired,
        }


class TimedLock:
    """Drop-in for ``threading.RLock`` used as a context manager."""

    def __init__(self, thread_cpu: bool = False) -> None:
        self._thread_cpu = thread_cpu
        self._lock = threading.Lock()
        self._owner: int | None = None  # only the owner sets it to its own id, so a stale read
        self._depth = 0  # by another thread never equals that thread's id
        self._since = 0.0
        self._acquisitions = self._contended = 0
        self._wait_s = self._held_s = 0.0
        self._max_held = _NO_HOLD  # the longest outermost hold since take_max_held
        self._last: dict[int, Hold] = {}  # thread id -> its last outermost hold
        self._usage_since = (0.0, 0.0, 0)

    def __enter__(self) -> TimedLock:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return self
        start = time.perf_counter()
        contended = not self._lock.acquire(blocking=False)
        if contended:
            self._lock.acquire()
        now = time.perf_counter()
        self._owner, self._depth, self._since = me, 1, now
        if self._thread_cpu:
            self._usage_since = _thread_usage()
        self._acquisitions += 1
        if contended:  # an uncontended acquire waits for nothing: only the timer would count
            self._contended += 1
            self._wait_s += now - start
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        held = time.perf_counter() - self._since
        me = threading.get_ident()
        if self._thread_cpu:
            (cpu, sys_s, faults), (cpu0, sys0, faults0) = _thread_usage(), self._usage_since
            hold = Hold(held, me, cpu - cpu0, sys_s - sys0, faults - faults0)
        else:
            hold = Hold(held, me)
        self._held_s += held
        if held > self._max_held.held_s:
            self._max_held = hold
        self._last[me] = hold
        self._owner = None
        self._lock.release()

    def last_held_s(self) -> float:
        """How long the calling thread's last outermost acquisition held the lock (0 if it
        never held it): the hold of the call it just made."""
        with self._lock:
            return self._last.get(threading.get_ident(), _NO_HOLD).held_s

    def last_held_cpu_s(self) -> float:
        """The thread CPU time of the calling thread's last outermost hold (0 without
        ``thread_cpu``)."""
        with self._lock:
            return self._last.get(threading.get_ident(), _NO_HOLD).cpu_s

    def take_max_held(self) -> Hold:
        """The longest outermost hold by any thread since the previous call (its ``thread``
        is a ``threading.get_ident``, 0 if none; its CPU figures 0 without ``thread_cpu``);
        then starts over."""
        with self._lock:
            out, self._max_held = self._max_held, _NO_HOLD
            return out

    def stats(self) -> LockStats:
        """A consistent snapshot; call it from a thread that does not hold this lock."""
        with self._lock:  # the bare lock: a snapshot is not an acquisition of the view's
            return LockStats(time.perf_counter(), self._acquisitions, self._contended,
                             self._wait_s, self._held_s)
