"""storage/tier.py: round trips, LRU by bytes, admission cap, deadlines, rebuild by scan."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkv_service.core.api import AdmissionCap
from hkv_service.core.errors import AdmissionRefused, InvalidInput
from storage import DiskFull, DiskKey, DiskTier, NotOnDisk
from storage.codec import Codec
from storage.record import HEADER

KINDS = ("COMPRESSED", "TAIL", "SWA", "INDEXER", "STATE")
SIZES = (0, 1, 4096, 256 << 10, 1 << 20)


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_every_kind_and_size(tier: DiskTier, h: Any, kind: str) -> None:
    expected: dict[DiskKey, bytes] = {}
    for i, size in enumerate(SIZES):
        for compressible in (False, True):
            key = h.make_key(2 * i + compressible, kind)
            expected[key] = bytes(size) if compressible else h.kv_bytes(size, seed=i)
            meta = tier.put(key, expected[key])
            want = Codec.ZSTD if compressible and size >= 4096 else Codec.RAW
            assert (meta.codec, meta.raw_len) == (want, size)
    for key, payload in expected.items():
        assert tier.get(key) == payload
    assert tier.get_many(list(expected)) == list(expected.values())
    assert tier.check_integrity() == []


def test_numpy_payload_and_get_into(tier: DiskTier, h: Any) -> None:
    arr = np.random.default_rng(3).standard_normal((64, 512)).astype(np.float16)
    tier.put(h.make_key(1), arr)
    out = np.empty_like(arr)
    assert tier.get_into(h.make_key(1), out) == arr.nbytes
    assert np.array_equal(out, arr)
    outs = [np.zeros_like(arr) for _ in range(3)]
    keys = [h.make_key(1)] * 3
    assert tier.get_many_into(keys, outs) == [arr.nbytes] * 3
    assert all(np.array_equal(o, arr) for o in outs)
    with pytest.raises(InvalidInput):
        tier.get_into(h.make_key(1), np.empty(10, np.uint8))
    with pytest.raises(InvalidInput):
        tier.get_into(h.make_key(1), bytes(arr.nbytes))


def test_put_replaces_delete_and_contains(tier: DiskTier, h: Any) -> None:
    key = h.make_key(5)
    tier.put(key, b"one")
    tier.put(key, b"second")  # a retried/re-put is idempotent: one record, latest bytes
    assert tier.get(key) == b"second" and tier.stats().entries == 1
    assert tier.contains(key) and tier.delete(key)
    assert not tier.contains(key) and not tier.delete(key)
    with pytest.raises(NotOnDisk):
        tier.get(key)
    assert tier.stats().bytes_used == 0 and tier.check_integrity() == []


def _budget_for(n: int, size: int) -> int:
    return n * (HEADER.size + size)


def test_lru_eviction_by_last_use(tier_factory: Callable[..., DiskTier], h: Any) -> None:
    size = 10_000
    seen: list[tuple[DiskKey, ...]] = []
    tier = tier_factory(budget=_budget_for(4, size), on_evict=seen.append)
    a, b, c, d, e, f = (h.make_key(i) for i in range(6))
    for key in (a, b, c, d):
        tier.put(key, h.kv_bytes(size, seed=key.block_hash[-1]))
    tier.get(a)  # a is now the most recently used
    assert tier.put(e, h.kv_bytes(size)).evicted == (b,)
    assert tier.put(f, h.kv_bytes(size)).evicted == (c,)
    assert seen == [(b,), (c,)]
    assert [tier.contains(k) for k in (a, b, c, d, e, f)] == [1, 0, 0, 1, 1, 1]
    assert tier.stats().evicted == 2 and tier.check_integrity() == []


def test_lru_order_survives_reopen(tier_factory: Callable[..., DiskTier], h: Any) -> None:
    size = 5000
    tier = tier_factory(budget=_budget_for(3, size))
    for i in range(3):
        tier.put(h.make_key(i), h.kv_bytes(size, seed=i))
    tier.get(h.make_key(0))
    tier.close()  # folds the pending last-use note into LMDB
    tier = tier_factory(budget=_budget_for(3, size))
    assert tier.put(h.make_key(9), h.kv_bytes(size)).evicted == (h.make_key(1),)


def test_object_larger_than_budget_is_disk_full(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    tier = tier_factory(budget=1000)
    tier.put(h.make_key(1), b"small")
    with pytest.raises(DiskFull, match="exceeds the disk tier budget"):
        tier.put(h.make_key(2), h.kv_bytes(5000))
    assert tier.get(h.make_key(1)) == b"small"
    assert tier.gate.stats().in_transit_objects == 0


def test_put_many_batches_and_evicts_atomically(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    size = 4000
    tier = tier_factory(budget=_budget_for(8, size), cap=AdmissionCap(max_objects=3))
    items = [(h.make_key(i), h.kv_bytes(size, seed=i)) for i in range(12)]
    metas = tier.put_many(items, wait_s=1.0)
    assert [m.key for m in metas] == [k for k, _ in items]
    evicted = [k for m in metas for k in m.evicted]
    assert evicted == [h.make_key(i) for i in range(4)]
    assert tier.stats().entries == 8 and tier.gate.stats().peak_objects <= 3
    assert tier.check_integrity() == []


def test_scan_rebuilds_the_index_after_reopen(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    tier = tier_factory()
    keys = [h.make_key(i, kind) for i, kind in enumerate(KINDS * 3)]
    metas = {tier.put(k, h.kv_bytes(3000, seed=i)).key: i for i, k in enumerate(keys)}
    tier.close()
    tier = tier_factory()
    found = list(tier.scan(verify=True))
    assert sorted(m.key.to_bytes() for m in found) == sorted(k.to_bytes() for k in metas)
    assert all(m.raw_len == 3000 and m.last_used_ns >= m.created_ns for m in found)


def test_admission_cap_holds_under_16_threads(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    cap = AdmissionCap(max_objects=3, max_bytes=1 << 30)
    tier = tier_factory(cap=cap)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for j in range(6):
                key = h.make_key(100 * t + j)
                payload = h.kv_bytes(32 << 10, seed=t)
                tier.put(key, payload, wait_s=30)
                assert tier.get(key, wait_s=30) == payload
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    adm = tier.gate.stats()
    assert 1 <= adm.peak_objects <= cap.max_objects
    assert (adm.in_transit_objects, adm.in_transit_bytes) == (0, 0)
    assert adm.admitted == 16 * 6 * 2 and tier.stats().puts == 96
    assert tier.check_integrity() == []


def test_wait_deadline_is_respected(tier_factory: Callable[..., DiskTier], h: Any) -> None:
    tier = tier_factory(cap=AdmissionCap(max_objects=1))
    tier.put(h.make_key(1), b"x")
    held = tier.gate.acquire(1)
    for call in (lambda: tier.put(h.make_key(2), b"y", wait_s=0.2),
                 lambda: tier.get(h.make_key(1), wait_s=0.2)):
        start = time.monotonic()
        with pytest.raises(AdmissionRefused) as err:
            call()
        assert 0.2 <= time.monotonic() - start < 2.0
        assert err.value.retry_after_s > 0
    tier.gate.release(held)
    assert not tier.contains(h.make_key(2))
    tier.put(h.make_key(2), b"y")
    assert tier.gate.stats().refused == 2 and tier.gate.stats().in_transit_objects == 0


def test_bad_input_is_invalid_input(tier: DiskTier, h: Any, tmp_path: Path) -> None:
    with pytest.raises(InvalidInput):
        tier.put(DiskKey(b"x" * 15, "g", "SWA", 1), b"data")
    with pytest.raises(InvalidInput):
        tier.put(h.make_key(1), "not bytes")
    with pytest.raises(InvalidInput):
        DiskTier(tmp_path / "other", 0, AdmissionCap())
    assert tier.gate.stats().in_transit_objects == 0


def test_get_many_missing_key_raises_and_releases(tier: DiskTier, h: Any) -> None:
    tier.put(h.make_key(1), b"one")
    with pytest.raises(NotOnDisk):
        tier.get_many([h.make_key(1), h.make_key(2)])
    assert tier.get_many([h.make_key(1)] * 70) == [b"one"] * 70  # more than one batch
    assert tier.gate.stats().in_transit_objects == 0
