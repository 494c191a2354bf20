"""The log throttle: one line per key per interval, the rest held back, counted and said in
the next line. Time is a stepped fake clock: nothing here waits or reads the wall clock."""

from __future__ import annotations

import math
import threading

import pytest

from hkv_service.core.errors import InvalidInput
from hkv_service.core.throttle import Pass, Throttle


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_line_per_interval_and_the_next_says_how_many_were_held_back() -> None:
    clock = Clock()
    throttle = Throttle(10.0, clock)
    assert throttle.note("undecodable") == Pass(0)
    assert [throttle.note("undecodable") for _ in range(5)] == [None] * 5
    clock.now += 9.999
    assert throttle.note("undecodable") is None
    assert throttle.held_back("undecodable") == 6
    clock.now += 0.001  # the interval is over: the next occurrence is logged, with the count
    assert throttle.note("undecodable") == Pass(6)
    assert throttle.held_back("undecodable") == 0
    assert throttle.note("undecodable") is None  # and a new interval starts at that line
    clock.now += 10.0
    assert throttle.note("undecodable") == Pass(1)


def test_keys_are_throttled_apart() -> None:
    throttle = Throttle(10.0, Clock())
    assert throttle.note("a") == Pass(0) and throttle.note("b") == Pass(0)
    assert throttle.note("a") is None
    assert (throttle.held_back("a"), throttle.held_back("b")) == (1, 0)


def test_a_zero_interval_logs_every_occurrence() -> None:
    throttle = Throttle(0.0, Clock())
    assert [throttle.note("k") for _ in range(3)] == [Pass(0)] * 3


@pytest.mark.parametrize("interval", [-1.0, math.nan])
def test_a_bad_interval_is_refused(interval: float) -> None:
    with pytest.raises(InvalidInput):
        Throttle(interval, Clock())


def test_threads_get_exactly_one_line_per_interval() -> None:
    """Many threads noting at once within one interval: one Pass among them, every other
    occurrence held back and counted, none lost."""
    throttle = Throttle(10.0, Clock())
    passes: list[Pass] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def worker() -> None:
        start.wait()
        for _ in range(500):
            got = throttle.note("k")
            if got is not None:
                with lock:
                    passes.append(got)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert passes == [Pass(0)]
    assert throttle.held_back("k") == 8 * 500 - 1
