from __future__ import annotations

import threading
import time

import pytest

from hkv_service.core.admission import AdmissionCap, AdmissionGate
from hkv_service.core.errors import AdmissionRefused


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
