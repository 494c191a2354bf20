"""workers.copies: a transfer's copies split over the caller and helper threads give every
byte to its place, and the call returns (or raises) only once every part is done: a write
finishes its blocks and a read checks its seqlock right after it."""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import numpy as np
import pytest

from workers import copies
from workers.copies import MIN_PART_BYTES, Copier

MiB = 1 << 20


def _pairs(sizes: list[int], seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return [np.zeros(n, np.uint8) for n in sizes], srcs


@pytest.mark.parametrize("helpers", [0, 1, 3])
def test_every_byte_lands_in_its_place_whatever_the_cut(helpers: int) -> None:
    c = Copier(helpers)
    rnd = random.Random(helpers)
    shapes = [[4 * MiB], [MiB], [MiB + 1], [MIN_PART_BYTES * 2 - 1], [0, 3 * MiB, 0],
              [7] * 300, [MIN_PART_BYTES - 1, MIN_PART_BYTES + 1, 5],
              [rnd.randrange(1, 3 * MiB) for _ in range(9)]]
    for k, sizes in enumerate(shapes):
        dests, srcs = _pairs(sizes, k)
        c.copy(list(zip(dests, srcs, strict=True)))
        for d, s in zip(dests, srcs, strict=True):
            assert np.array_equal(d, s), (sizes, helpers)


def test_a_large_copy_is_cut_into_one_part_per_thread_no_smaller_than_the_floor() -> None:
    c = Copier(3)
    dests, srcs = _pairs([3 * MiB, MiB], 1)
    parts = c._split(list(zip(dests, srcs, strict=True)))
    assert len(parts) == 4
    assert [sum(d.size for d, _ in p) for p in parts] == [MiB] * 4
    small = _pairs([MIN_PART_BYTES * 2 - 1], 2)
    assert len(c._split(list(zip(*small, strict=True)))) == 1  # no part under the floor
    assert len(Copier(0)._split(list(zip(dests, srcs, strict=True)))) == 1


def test_a_size_mismatch_is_refused_as_numpy_refuses_it() -> None:
    """A source longer than its destination is never cut to fit (a write's bytes would be
    short): np.copyto's error, as before the split."""
    c = Copier(1)
    with pytest.raises(ValueError):
        c.copy([(np.zeros(2 * MiB, np.uint8), np.ones(3 * MiB, np.uint8))])


def test_an_error_is_raised_only_after_every_other_part_finished(monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The caller's part fails at once while a helper's part is still copying: copy() must
    not return before that copy is done, or a finish (readable) or a give-back (reusable)
    would follow while bytes still land in the block."""
    c = Copier(1)
    finished: list[float] = []
    real = np.copyto

    def copyto(dest: np.ndarray, src: np.ndarray) -> None:
        if threading.current_thread() is threading.main_thread():
            raise OSError("the caller's copy failed")
        time.sleep(0.3)  # a helper's copy still under way when the caller's fails
        real(dest, src)
        finished.append(time.monotonic())

    monkeypatch.setattr(copies.np, "copyto", copyto)
    dests, srcs = _pairs([4 * MiB], 3)
    with pytest.raises(OSError, match="caller's copy failed"):
        c.copy(list(zip(dests, srcs, strict=True)))
    raised = time.monotonic()
    assert finished and finished[0] <= raised


def test_a_helpers_error_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Copier(1)
    real = np.copyto

    def copyto(dest: np.ndarray, src: np.ndarray) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise MemoryError("a helper's copy failed")
        real(dest, src)

    monkeypatch.setattr(copies.np, "copyto", copyto)
    dests, srcs = _pairs([2 * MiB], 4)
    with pytest.raises(MemoryError):
        c.copy(list(zip(dests, srcs, strict=True)))
    monkeypatch.setattr(copies.np, "copyto", real)
    c.copy(list(zip(dests, srcs, strict=True)))  # the helper lives on
    assert np.array_equal(dests[0], srcs[0])


def test_helpers_follow_the_cores_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process bound to one core (vLLM's CPU worker) copies alone."""
    monkeypatch.setattr(copies, "_copier", None)
    monkeypatch.setattr(copies.os, "sched_getaffinity", lambda _pid: {0})
    assert copies.copier().helpers == 0
    monkeypatch.setattr(copies, "_copier", None)
    monkeypatch.setattr(copies.os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert copies.copier().helpers == copies.MAX_HELPERS


def test_a_forked_child_makes_its_own_helpers() -> None:
    c = copies.copier()
    dests, srcs = _pairs([4 * MiB], 5)
    c.copy(list(zip(dests, srcs, strict=True)))  # the parent's helpers started
    pid = os.fork()
    if pid == 0:  # the child: its parent's helper threads are not here
        code = 1
        try:
            mine = copies.copier()
            d2, s2 = _pairs([4 * MiB], 6)
            mine.copy(list(zip(d2, s2, strict=True)))
            code = 0 if mine is not c and np.array_equal(d2[0], s2[0]) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_no_view_of_the_bytes_is_kept_after_the_copy() -> None:
    """A dead shard's segment is unmapped only once no view of it is left: the helpers keep
    none of a copy's arrays once it returned."""
    c = Copier(3)
    dest = np.zeros(4 * MiB, np.uint8)
    src = np.ones(4 * MiB, np.uint8)
    held = sys.getrefcount(dest), sys.getrefcount(src)
    c.copy([(dest, src)])
    time.sleep(0.05)  # (a helper that kept a view would still hold it now)
    assert (sys.getrefcount(dest), sys.getrefcount(src)) == held
    assert (dest == 1).all()
