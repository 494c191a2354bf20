"""A slow disk under the tier (reliability row 11): deadlines, the in-transit cap, no lost acks.

Latency is injected one level below the tier, in a wrapper of its LMDB store: every write
transaction sleeps (or blocks on an event) before its work, holding LMDB's single writer
lock the way a slow commit does, and every read snapshot sleeps once open, like a page-in
from a slow device. The tier's own code, LMDB and the data on disk are all real.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import lmdb
import numpy as np
import pytest

from hkv_service.core.api import AdmissionCap
from hkv_service.core.errors import AdmissionRefused
from storage import DiskKey, DiskTier
from storage.lmdb_store import DiskStore

T = TypeVar("T")


class SlowStore:
    """``DiskStore`` with latency: ``write_s`` inside each write transaction (after ``hold``
    is set, if one is given), ``read_s`` inside each read snapshot."""

    def __init__(self, inner: DiskStore, write_s: float, read_s: float,
                 hold: threading.Event | None = None) -> None:
        self._inner, self.write_s, self.read_s, self.hold = inner, write_s, read_s, hold
        self.writes = 0

    def write(self, fn: Callable[[lmdb.Transaction], T], need_bytes: int = 0) -> T:
        def slow(txn: lmdb.Transaction) -> T:
            if self.hold is not None:
                self.hold.wait()
            time.sleep(self.write_s)
            return fn(txn)

        result = self._inner.write(slow, need_bytes)
        self.writes += 1
        return result

    @contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        with self._inner.read() as txn:
            time.sleep(self.read_s)
            yield txn

    def __getattr__(self, name: str) -> Any:  # map_size, close, dbs ...
        return getattr(self._inner, name)


class SlowTier(DiskTier):
    """A real ``DiskTier`` whose store is wrapped in :class:`SlowStore` once it is open."""

    def __init__(self, path: Path, cap: AdmissionCap, write_s: float = 0.0, read_s: float = 0.0,
                 hold: threading.Event | None = None) -> None:
        super().__init__(path, 64 << 20, cap)
        self.slow = SlowStore(self._store, write_s, read_s, hold)
        self._store = self.slow  # type: ignore[assignment]


@pytest.fixture
def slow_tiers(tmp_path: Path) -> Iterator[Callable[..., SlowTier]]:
    opened: list[SlowTier] = []

    def make(cap: AdmissionCap, **kw: Any) -> SlowTier:
        tier = SlowTier(tmp_path / "disk", cap, **kw)
        opened.append(tier)
        return tier

    yield make
    for tier in opened:
        if tier.slow.hold is not None:
            tier.slow.hold.set()  # never leave a writer blocked behind a failed test
        tier.close()


def _wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_waiting_transfers_are_refused_at_their_deadline_not_hung(
    slow_tiers: Callable[..., SlowTier], h: Any
) -> None:
    hold = threading.Event()
    hold.set()
    tier = slow_tiers(AdmissionCap(max_objects=2), read_s=0.02, hold=hold)
    tier.put(h.make_key(0), b"at rest")  # something to read later
    hold.clear()  # from here on the disk stalls every write until released
    stuck = [threading.Thread(target=tier.put, args=(h.make_key(i), h.kv_bytes(4096, i)))
             for i in (1, 2)]
    for t in stuck:
        t.start()
    _wait_until(lambda: tier.gate.stats().in_transit_objects == 2)  # the cap is full

    wait_s = 0.3
    calls: list[Callable[[], object]] = [
        lambda: tier.put(h.make_key(3), b"late", wait_s=wait_s),
        lambda: tier.put_many([(h.make_key(4), b"x"), (h.make_key(5), b"y")], wait_s=wait_s),
        lambda: tier.get(h.make_key(0), wait_s=wait_s),
        lambda: tier.get_many([h.make_key(0)] * 3, wait_s=wait_s),
        lambda: tier.get_into(h.make_key(0), bytearray(16), wait_s=wait_s),
    ]
    for call in calls:
        start = time.monotonic()
        with pytest.raises(AdmissionRefused) as err:
            call()
        elapsed = time.monotonic() - start
        assert wait_s <= elapsed < wait_s + 2.0  # the deadline, not the stalled disk
        assert err.value.retry_after_s > 0
    assert tier.gate.stats().in_transit_objects == 2  # refusals took and kept nothing

    hold.set()  # the disk recovers: the stalled puts complete and are acknowledged
    for t in stuck:
        t.join(timeout=10)
        assert not t.is_alive()
    for i in (1, 2):
        assert tier.get(h.make_key(i)) == h.kv_bytes(4096, i)
    assert not any(tier.contains(h.make_key(i)) for i in (3, 4, 5))  # refused: never stored
    adm = tier.gate.stats()
    assert (adm.in_transit_objects, adm.in_transit_bytes, adm.refused) == (0, 0, len(calls))


def test_cap_holds_and_no_ack_is_lost_under_many_slow_transfers(
    slow_tiers: Callable[..., SlowTier], h: Any, tmp_path: Path
) -> None:
    cap = AdmissionCap(max_objects=4, max_bytes=1 << 30)
    tier = slow_tiers(cap, write_s=0.01, read_s=0.01)
    size = 16 << 10
    acked: dict[DiskKey, bytes] = {}
    refused_puts: list[DiskKey] = []
    refused_gets: list[DiskKey] = []
    errors: list[BaseException] = []
    observed = {"objects": 0, "bytes": 0}
    stop = threading.Event()

    def watch() -> None:  # an outside view of the gauge, apart from the gate's own peak
        while not stop.is_set():
            now = tier.gate.stats()
            observed["objects"] = max(observed["objects"], now.in_transit_objects)
            observed["bytes"] = max(observed["bytes"], now.in_transit_bytes)
            time.sleep(0.0005)

    def attempt(call: Any, refused: list[Any], key: Any, *args: Any, wait_s: float
                ) -> tuple[bool, Any]:
        """(done, ``call(key, *args, wait_s=wait_s)``): a refusal is recorded in ``refused``,
        anything else in errors."""
        try:
            return True, call(key, *args, wait_s=wait_s)
        except AdmissionRefused:
            refused.append(key)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        return False, None

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        for j in range(5):
            key, payload = h.make_key(100 * t + j), h.kv_bytes(size, seed=100 * t + j)
            wait_s = float(rng.choice([0.0, 0.02, 5.0]))  # impatient and patient callers
            done, _ = attempt(tier.put, refused_puts, key, payload, wait_s=wait_s)
            if not done:
                continue
            acked[key] = payload
            done, got = attempt(tier.get, refused_gets, key, wait_s=wait_s)
            if done and got != payload:  # pragma: no cover - reported below
                errors.append(AssertionError(f"wrong bytes for {key}"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=worker, args=(t,)) for t in range(12)]
    for th in workers:
        th.start()
    for th in workers:
        th.join(timeout=60)
    stop.set()
    watcher.join()

    assert errors == []
    adm = tier.gate.stats()
    assert observed["objects"] <= cap.max_objects and adm.peak_objects == cap.max_objects
    most = cap.max_objects * size  # every transfer here is one block of `size` bytes
    assert observed["bytes"] <= most and adm.peak_bytes <= most
    assert refused_puts and adm.refused == len(refused_puts) + len(refused_gets)
    assert (adm.in_transit_objects, adm.in_transit_bytes) == (0, 0)
    assert acked

    tier.close()  # every acknowledged put must survive a reopen, byte for byte
    with DiskTier(tmp_path / "disk", 64 << 20, AdmissionCap()) as reopened:
        assert reopened.check_integrity() == []
        stored = {m.key for m in reopened.scan(verify=True)}
        assert stored == set(acked)  # all acknowledged, and nothing that was refused
        for key, payload in acked.items():
            assert reopened.get(key) == payload
