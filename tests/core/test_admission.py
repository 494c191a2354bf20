from __future__ import annotations

import threading
import time

import pytest

from hkv_service.core.admission import AdmissionGate
from hkv_service.core.api import AdmissionCap
from hkv_service.core.errors import AdmissionRefused, InvalidInput


def test_cap_holds_under_threads() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=3, max_bytes=1000))
    refused = []

    def worker() -> None:
        for _ in range(50):
            try:
                t = gate.acquire(300, wait_s=0.01)
            except AdmissionRefused as err:
                refused.append(err.retry_after_s)
                continue
            s = gate.stats()
            assert s.in_transit_objects <= 3 and s.in_transit_bytes <= 1000
            time.sleep(0.0005)
            gate.release(t)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = gate.stats()
    assert s.peak_objects <= 3 and s.peak_bytes <= 1000
    assert s.in_transit_objects == 0 and s.in_transit_bytes == 0
    assert s.admitted + s.refused == 400 and len(refused) == s.refused


def test_burst_ten_times_cap_admits_exactly_cap() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=4, max_bytes=10**9))
    tickets, refused = [], 0
    for _ in range(40):
        try:
            tickets.append(gate.acquire(10))
        except AdmissionRefused as err:
            refused += 1
            assert "retry" in str(err) and err.retry_after_s > 0
    assert len(tickets) == 4 and refused == 36
    for t in tickets:
        gate.release(t)
    assert gate.stats().in_transit_objects == 0


def test_wait_honours_deadline_and_wakes_on_release() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=1, max_bytes=100))
    t = gate.acquire(10)
    start = time.monotonic()
    with pytest.raises(AdmissionRefused):
        gate.acquire(10, wait_s=0.05)
    assert time.monotonic() - start >= 0.05
    threading.Timer(0.02, gate.release, args=(t,)).start()
    gate.release(gate.acquire(10, wait_s=2.0))


def test_oversized_object_moves_alone() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=4, max_bytes=100))
    big = gate.acquire(500)
    with pytest.raises(AdmissionRefused):
        gate.acquire(1)
    gate.release(big)


# -- acquire_many: one ticket for a prefix of a batch ----------------------------------------


def test_acquire_many_cuts_where_the_cap_is_full() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=4, max_bytes=1000))
    held = gate.acquire(100)
    by_objects = gate.acquire_many([10] * 9)
    assert (by_objects.objects, by_objects.nbytes) == (3, 30)  # 4 objects in all
    gate.release(by_objects)
    by_bytes = gate.acquire_many([400, 400, 400])
    assert (by_bytes.objects, by_bytes.nbytes) == (2, 800)  # 100 + 800 <= 1000 < 1300
    gate.release(by_bytes)
    by_limit = gate.acquire_many([100, 100, 100], limit_bytes=250)
    assert by_limit.objects == 2
    gate.release(by_limit)
    gate.release(held)
    stats = gate.stats()
    assert (stats.in_transit_objects, stats.in_transit_bytes) == (0, 0)
    assert stats.admitted == 1 + 3 + 2 + 2 and stats.refused == 0  # cuts are not refusals
    assert stats.peak_objects == 4 and stats.peak_bytes == 900


def test_acquire_many_refuses_or_waits_only_for_its_first_object() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=1, max_bytes=1000))
    held = gate.acquire(10)
    with pytest.raises(AdmissionRefused):
        gate.acquire_many([10, 10])
    assert gate.stats().refused == 1

    threading.Timer(0.05, gate.release, args=(held,)).start()
    ticket = gate.acquire_many([10, 10], wait_s=5.0)  # waits for the release
    assert ticket.objects == 1
    gate.release(ticket)
    with pytest.raises(AssertionError):
        gate.release(ticket)  # one ticket, released once, whatever it covers


def test_acquire_many_admits_an_oversized_first_object_alone() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=8, max_bytes=100))
    ticket = gate.acquire_many([500, 1])
    assert (ticket.objects, ticket.nbytes) == (1, 500)
    gate.release(ticket)


@pytest.mark.parametrize("sizes", [[], [5, -1]])
def test_acquire_many_rejects_bad_batches(sizes: list[int]) -> None:
    gate = AdmissionGate(AdmissionCap())
    with pytest.raises(InvalidInput):
        gate.acquire_many(sizes)
    assert gate.stats().admitted == 0


def test_try_acquire_many_is_a_probe_not_a_refusal() -> None:
    gate = AdmissionGate(AdmissionCap(max_objects=2, max_bytes=1000))
    held = gate.acquire(10)
    ticket = gate.try_acquire_many([10, 10, 10])
    assert ticket is not None and ticket.objects == 1
    assert gate.try_acquire_many([10]) is None
    assert gate.stats().refused == 0
    gate.release(ticket)
    gate.release(held)
