"""put_many in write batches of half the cap, the next batch encoded on the helper thread while
one commits: order, the cap, tickets on every error path, no deadlock at a one-object cap."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from hkv_service.core.api import AdmissionCap
from storage import DiskFull, DiskTier
from storage import tier as tier_module


def _committed_batches(tier: DiskTier) -> list[int]:
    """Record the size of every write batch ``tier`` commits."""
    sizes: list[int] = []
    commit = tier._commit

    def spy(batch: Any, *rest: Any) -> Any:
        sizes.append(len(batch.encoded))
        return commit(batch, *rest)

    tier._commit = spy  # type: ignore[method-assign]
    return sizes


def test_batches_are_half_the_cap_and_keep_order(tier_factory: Callable[..., DiskTier],
                                                 h: Any) -> None:
    tier = tier_factory(cap=AdmissionCap(max_objects=6))
    sizes = _committed_batches(tier)
    items = [(h.make_key(i), h.kv_bytes(3000 + i, seed=i)) for i in range(10)]
    metas = tier.put_many(items)
    assert [m.key for m in metas] == [key for key, _ in items]
    assert sizes == [3, 3, 3, 1]
    for key, payload in items:
        assert tier.get(key) == payload
    stats = tier.gate.stats()
    assert stats.in_transit_objects == 0 and stats.peak_objects <= 6


def test_a_batch_is_cut_at_write_batch_bytes(tier_factory: Callable[..., DiskTier], h: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_module, "WRITE_BATCH_BYTES", 10_000)
    tier = tier_factory()
    sizes = _committed_batches(tier)
    tier.put_many([(h.make_key(i), h.kv_bytes(4000, seed=i)) for i in range(5)])
    assert sizes == [2, 2, 1]


@pytest.mark.parametrize("wait_s", [0.0, 2.0])
def test_a_one_object_cap_commits_before_it_admits(tier_factory: Callable[..., DiskTier],
                                                   h: Any, wait_s: float) -> None:
    """No room beside the held batch: it is committed first, never waited on (a wait would
    be for the caller's own ticket) and never refused."""
    tier = tier_factory(cap=AdmissionCap(max_objects=1))
    metas = tier.put_many([(h.make_key(i), b"v%d" % i) for i in range(4)], wait_s=wait_s)
    assert len(metas) == 4 and tier.gate.stats().refused == 0
    assert [tier.get(h.make_key(i)) for i in range(4)] == [b"v0", b"v1", b"v2", b"v3"]


def test_a_later_batch_that_cannot_encode_leaves_earlier_ones_committed(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    tier = tier_factory(budget=20_000, cap=AdmissionCap(max_objects=4))
    items = [(h.make_key(i), h.kv_bytes(1000, seed=i)) for i in range(4)]
    items.append((h.make_key(9), h.kv_bytes(30_000, seed=9)))  # over the whole budget
    with pytest.raises(DiskFull, match="exceeds the disk tier budget"):
        tier.put_many(items)
    for key, payload in items[:4]:
        assert tier.get(key) == payload
    assert tier.gate.stats().in_transit_objects == 0


@pytest.mark.parametrize("after_puts", [True, False])
def test_a_commit_that_fails_while_the_next_batch_waits(tier_factory: Callable[..., DiskTier],
                                                        h: Any, after_puts: bool) -> None:
    """The failing commit's batch and the next batch (encoding beside the sync, or not yet
    started when the failure came before the puts ended) both give their tickets back, and
    nothing of the failed batch is visible."""
    tier = tier_factory(cap=AdmissionCap(max_objects=4))
    commit, calls = tier._commit_batch, []

    def failing_second(txn: Any, batch: Any, touched: Any, then: Any = None) -> Any:
        calls.append(len(batch.encoded))
        if len(calls) == 2:
            if then is not None and after_puts:
                then()  # the next batch is encoding when the commit fails
            raise DiskFull("injected: the file system refused the pages")
        return commit(txn, batch, touched, then)

    tier._commit_batch = failing_second  # type: ignore[method-assign]
    items = [(h.make_key(i), b"x%d" % i) for i in range(6)]
    with pytest.raises(DiskFull, match="injected"):
        tier.put_many(items)
    assert calls == [2, 2]
    assert tier.gate.stats().in_transit_objects == 0
    assert [tier.contains(key) for key, _ in items] == [True, True, False, False, False, False]


def test_concurrent_writers_share_the_cap_and_the_helper(tier_factory: Callable[..., DiskTier],
                                                         h: Any) -> None:
    tier = tier_factory(cap=AdmissionCap(max_objects=4))
    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            tier.put_many([(h.make_key(base + i), h.kv_bytes(2000, seed=base + i))
                           for i in range(12)], wait_s=10.0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(100 * t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert tier.stats().entries == 48
    stats = tier.gate.stats()
    assert stats.in_transit_objects == 0 and stats.peak_objects <= 4
    assert tier.check_integrity() == []


def test_a_key_twice_in_one_batch_keeps_the_later_bytes(tier_factory: Callable[..., DiskTier],
                                                        h: Any) -> None:
    tier = tier_factory()
    key = h.make_key(1)
    metas = tier.put_many([(key, b"first"), (h.make_key(2), b"other"), (key, b"second")])
    assert len(metas) == 3 and tier.get(key) == b"second"
    assert tier.stats().entries == 2 and tier.check_integrity() == []
