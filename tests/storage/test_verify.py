"""Verified copies on two threads (storage/verify.py): the same digests and bytes as on one, on
both sides of the threshold, with a failure on either thread, through a batch that mixes
codecs, corruption wherever it sits in a batch, and after fork."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from storage import CorruptEntry, DiskTier, NotOnDisk, verify
from storage.codec import Codec
from storage.verify import PARALLEL_MIN_BYTES, VERIFY_CHUNK, _half, copy_all


@pytest.mark.parametrize("sizes", [[1000, 70_000], [PARALLEL_MIN_BYTES],
                                   [300_000, 5, 300_000], [2 * PARALLEL_MIN_BYTES + 3],
                                   [PARALLEL_MIN_BYTES // 2] * 2, [40_000] * 40,
                                   [5, 3 * VERIFY_CHUNK + 1, 70_000]])
def test_copy_all_copies_and_hashes_the_sources(sizes: list[int]) -> None:
    rng = np.random.default_rng(sum(sizes))
    sources = [memoryview(rng.bytes(n)) for n in sizes]
    outs = [memoryview(bytearray(n)) for n in sizes]
    digests = copy_all(list(zip(sources, outs, strict=True)))
    assert digests == [xxhash.xxh3_128_digest(src) for src in sources]
    assert [bytes(out) for out in outs] == [bytes(src) for src in sources]


def _slow_helper(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make every helper job start late and note when it ended (raised or not): a caller
    that returned without waiting for it would find the list still empty."""
    ended: list[bool] = []
    real = verify.run_beside

    def slow(fn: Callable[..., Any], *args: Any) -> Any:
        def job() -> Any:
            time.sleep(0.2)
            try:
                return fn(*args)
            finally:
                ended.append(True)
        return real(job)

    monkeypatch.setattr(verify, "run_beside", slow)
    return ended


def test_copy_all_waits_for_the_hash_before_raising(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails (here: unequal lengths) must not return while the helper still reads
    the sources: in the tier they are pages of a snapshot that closes on return."""
    ended = _slow_helper(monkeypatch)
    big = memoryview(bytes(PARALLEL_MIN_BYTES + 1))  # one object past the threshold
    with pytest.raises(ValueError):
        copy_all([(big, memoryview(bytearray(PARALLEL_MIN_BYTES)))])
    assert ended == [True]
    monkeypatch.undo()
    big = memoryview(bytes(PARALLEL_MIN_BYTES))
    # the helper is idle again: the next call is served, not queued behind a stuck job
    out = memoryview(bytearray(PARALLEL_MIN_BYTES))
    assert copy_all([(big, out)]) == [xxhash.xxh3_128_digest(big)]


@pytest.mark.parametrize("sizes", [[1, 1], [10, 1, 1, 1], [1, 1, 1, 10], [3, 3, 3]])
def test_a_batch_is_cut_in_two_non_empty_halves_by_bytes(sizes: list[int]) -> None:
    pairs = [(memoryview(bytes(n)), memoryview(bytearray(n))) for n in sizes]
    cut = _half(pairs)
    assert 0 < cut < len(pairs)
    mine, theirs = sum(sizes[:cut]), sum(sizes[cut:])
    assert abs(mine - theirs) <= max(sizes)


@pytest.mark.parametrize("bad", [0, 2])
def test_a_failing_copy_on_either_thread_raises_after_both_end(
    bad: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Object 0 is the caller's, object 2 the helper's; either copy failing raises here,
    only once the other thread is done (its sources are a snapshot's pages)."""
    n = PARALLEL_MIN_BYTES // 2
    pairs = [(memoryview(bytes(n)), memoryview(bytearray(n - (i == bad)))) for i in range(3)]
    ended = _slow_helper(monkeypatch)
    with pytest.raises(ValueError):
        copy_all(pairs)
    assert ended == [True]
    monkeypatch.undo()
    good = [(memoryview(bytes(n)), memoryview(bytearray(n))) for _ in range(3)]
    assert copy_all(good) == [xxhash.xxh3_128_digest(bytes(n))] * 3  # the helper is free


def test_a_mixed_batch_loads_in_order(tier_factory: Callable[..., DiskTier], h: Any) -> None:
    """Raw records over the threshold go to the helper, a zstd record and an undersized
    destination do not; results keep the keys' order."""
    tier = tier_factory()
    raw = [h.kv_bytes(300_000, seed=i) for i in range(3)]
    zeros = bytes(200_000)  # compresses: stored as zstd
    keys = [h.make_key(i) for i in range(4)]
    for key, payload in zip(keys, [raw[0], zeros, raw[1], raw[2]], strict=True):
        tier.put(key, payload)
    assert [m.codec for m in tier.scan()].count(Codec.ZSTD) == 1
    outs = [np.zeros(len(p) + 7, np.uint8) for p in (raw[0], zeros, raw[1], raw[2])]
    assert tier.get_many_into(keys, outs) == [300_000, 200_000, 300_000, 300_000]
    for out, payload in zip(outs, [raw[0], zeros, raw[1], raw[2]], strict=True):
        assert bytes(out[: len(payload)]) == payload and not out[len(payload):].any()
    with pytest.raises(Exception, match="too small"):
        tier.get_many_into(keys, [*outs[:3], np.zeros(10, np.uint8)])
    assert tier.stats().admission.in_transit_objects == 0


@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_flip_in_a_parallel_batch(tier_factory: Callable[..., DiskTier], h: Any,
                                    tmp_path: Path, victim: int) -> None:
    """Objects 0-1 are copied and hashed by the caller, 2 by the helper: wherever the corrupt
    record is, it is named and quarantined, and the others in the batch stay good."""
    tier = tier_factory()
    payloads = [h.kv_bytes(300_000, seed=10 + i) for i in range(3)]
    keys = [h.make_key(i) for i in range(3)]
    for key, payload in zip(keys, payloads, strict=True):
        tier.put(key, payload)
    tier.close()
    data = tmp_path / "disk" / "data.mdb"
    h.flip_bit(data, h.find_once(data, payloads[victim][:64]) + 299_000, bit=2)

    tier = tier_factory()
    outs = [np.zeros(300_000, np.uint8) for _ in keys]
    with pytest.raises(CorruptEntry) as err:
        tier.get_many_into(keys, outs)
    assert err.value.key == keys[victim].to_bytes() and err.value.reason == "payload_checksum"
    assert tier.quarantine_count() == 1
    with pytest.raises(NotOnDisk):
        tier.get(keys[victim])
    rest = [i for i in range(3) if i != victim]
    assert tier.get_many_into([keys[i] for i in rest], [outs[i] for i in rest]) == [300_000] * 2
    assert all(bytes(outs[i]) == payloads[i] for i in rest)


def test_a_forked_child_gets_its_own_helper(tmp_path: Path) -> None:
    """The helper thread does not survive fork; a child that loads must not wait on it."""
    big = memoryview(np.random.default_rng(3).bytes(PARALLEL_MIN_BYTES))
    copy_all([(big, memoryview(bytearray(len(big))))])  # the parent's helper runs
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the parallel copy completes and is right
        signal.alarm(20)
        out = memoryview(bytearray(len(big)))
        ok = copy_all([(big, out)]) == [xxhash.xxh3_128_digest(big)]
        os._exit(0 if ok and out == big else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_readers_and_writers_share_the_helper(tier_factory: Callable[..., DiskTier],
                                              h: Any) -> None:
    """Batched and single loads (both two-thread paths) while writers pipeline put_many over
    the same keys: every load returns bytes some put stored for that key, never a mix, and
    the store stays sound. Bounded: a fixed number of rounds per thread."""
    import threading

    nkeys = 8
    sizes = [600_000 if i % 2 else 160_000 for i in range(nkeys)]  # singles: both paths
    versions = {v: [h.kv_bytes(sizes[i], seed=100 * v + i) for i in range(nkeys)]
                for v in range(3)}
    keys = [h.make_key(i) for i in range(nkeys)]
    tier = tier_factory(budget=64 << 20)
    tier.put_many(list(zip(keys, versions[0], strict=True)))
    allowed = [{versions[v][i] for v in versions} for i in range(nkeys)]
    errors: list[BaseException] = []

    def writer(v: int) -> None:
        try:
            for _ in range(6):
                tier.put_many(list(zip(keys, versions[v], strict=True)), wait_s=10.0)
        except BaseException as exc:
            errors.append(exc)

    def reader(batched: bool) -> None:
        try:
            outs = [np.zeros(n, np.uint8) for n in sizes]
            for _ in range(10):
                if batched:
                    tier.get_many_into(keys, outs, wait_s=10.0)
                else:
                    for key, out in zip(keys, outs, strict=True):
                        tier.get_into(key, out, wait_s=10.0)
                assert all(bytes(o) in allowed[i] for i, o in enumerate(outs))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in (1, 2)]
    threads += [threading.Thread(target=reader, args=(b,)) for b in (True, False, True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == [] and not any(thread.is_alive() for thread in threads)
    assert tier.check_integrity() == [] and tier.stats().corruption == 0
    assert tier.gate.stats().in_transit_objects == 0
