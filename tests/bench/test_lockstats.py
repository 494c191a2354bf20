"""The service bench's timed lock: re-entrant like RLock, and its figures add up."""

from __future__ import annotations

import threading
import time

from hkv_service.bench.lockstats import TimedLock
from hkv_service.core.state_view import CacheState
from hkv_service.specs import default_spec


def test_reentrant_and_only_the_outermost_acquisition_counts() -> None:
    lock = TimedLock()
    before = lock.stats()
    with lock, lock, lock:
        time.sleep(0.02)
    got = lock.stats().since(before)
    assert got["acquisitions"] == 1  # the block, not 3 nested ones (snapshots do not count)
    assert got["held_us_per_acquisition"] >= 0.02e6 / 2
    assert got["contended_fraction"] == 0.0


def test_a_waiting_thread_is_counted_as_contended_with_its_wait() -> None:
    lock = TimedLock()
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            time.sleep(0.05)
        done.set()

    before = lock.stats()
    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(5)
    with lock:
        assert done.is_set()  # we only got in after the holder left
    holder.join(5)
    got = lock.stats().since(before)
    assert got["contended_fraction"] > 0
    # the waiter waited for most of the holder's 50 ms; averaged over 4 acquisitions
    assert got["wait_us_per_acquisition"] * got["acquisitions"] >= 0.03e6
    assert 0 < got["held_fraction"] <= 1.0


def test_state_view_runs_on_a_given_lock() -> None:
    lock = TimedLock()
    state = CacheState(default_spec(), lock=lock)
    before = lock.stats()
    state.stats()
    assert lock.stats().since(before)["acquisitions"] == 1  # stats() (snapshots do not count)


def test_a_hold_spent_waiting_is_told_from_one_spent_working() -> None:
    """``thread_cpu``: each hold's thread CPU time beside its wall-clock time, so a long hold
    is known as work (CPU ~ wall) or as the holder waiting (a switch, a sleep: CPU ~ 0)."""
    lock = TimedLock(thread_cpu=True)
    with lock:
        time.sleep(0.03)  # held, not working
    assert lock.last_held_s() >= 0.03 and lock.last_held_cpu_s() < 0.01
    held, holder, cpu, _, _ = lock.take_max_held()
    assert holder == threading.get_ident() and held >= 0.03 and cpu < 0.01
    with lock:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.03:  # held, working
            pass
    assert lock.last_held_cpu_s() >= 0.03
    held, holder, cpu, _, _ = lock.take_max_held()
    assert held >= 0.03 and cpu >= 0.03
    assert TimedLock().last_held_cpu_s() == 0.0  # not asked for: not measured


def test_a_hold_spent_in_the_kernel_is_told_from_one_spent_in_python() -> None:
    """A hold's thread CPU time splits into user and system time, with the page faults taken
    under it: a long hold of little Python work is then known as the kernel's (memory being
    mapped in, the host backing a guest's pages) rather than the code's."""
    lock = TimedLock(thread_cpu=True)
    with lock:
        touched = bytearray(64 << 20)  # fresh pages, faulted in by zeroing them
    hold = lock.take_max_held()
    assert hold.minor_faults >= 1000, hold  # 16,384 pages of 4 KiB
    assert hold.cpu_s <= hold.held_s + 0.001
    assert 0.0 <= hold.sys_s <= hold.cpu_s + 0.01  # (as of the last tick: it may run ahead)
    del touched
    with lock:
        pass
    assert lock.take_max_held().minor_faults < 100  # nothing touched: (next to) none


def test_a_short_hold_s_cpu_time_is_not_rounded_to_nothing() -> None:
    """Regression: ``getrusage`` reads a running thread's CPU time as of its last tick, so
    the scale bench's 0.1 ms holds (an owner expired, marked lost, re-registered) read 0 ms
    (``thread_time`` brings it up to date)."""
    lock = TimedLock(thread_cpu=True)
    cpu = []
    for _ in range(20):
        with lock:  # (spun on the wall clock: reading thread_time would refresh the count)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.0003:
                pass
        cpu.append(lock.last_held_cpu_s())
    assert min(cpu) >= 0.0002, cpu  # (a switch inside one of 0.3 ms: rare, and it is fine)
