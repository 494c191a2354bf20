"""Disk-tier benchmark: our offload/load against raw LMDB and plain files, in one run.

What bounds the figures: every store here uses the production sync mode (LMDB ``sync=True``,
``metasync=True``, no ``writemap``; the plain file is fsynced per batch), so offload is bounded
by the device's write bandwidth plus one fsync per batch of ``BATCH`` blocks; the data set fits
in RAM but not in the CPU caches, so loads come from the page cache and are bounded by memory
(the 4 KiB-page mmap reads at ~6 GB/s on the 2-core dev machine, against ~9 GB/s for the same
copy out of anonymous huge-page memory). Raw LMDB is get + one copy into the same preallocated
numpy buffer (a memoryview assignment, measured faster than ``np.copyto``), on one thread.
Ours adds, per object, the xxh3-128 verify of every byte, the header check, an admission
ticket and the last-use note, and uses two threads where that pays (``storage.verify``): a
``get_many_into`` batch is split in halves copied and verified by the caller and by the
tier's helper thread at once, which is why ``load_many`` can pass 1.0x of one-thread raw;
one object from 512 KiB is copied while the helper hashes its source; a single smaller
object is copied and then hashed on the calling thread. Offload, too, runs the next batch's
encoding on the helper while one batch syncs. ``verify`` reports the hash speed on a
cache-resident chunk; ``serial_verify`` is bare LMDB get + copy + xxh3-128 of the copy on
one thread (no header, ticket or note): what verifying costs without the helper.
Blocks are random-normal fp16, which zstd level 1 shrinks by only ~8%, under the 10% the tier
demands, so they are stored raw: the ratios price the checksum, the header and the
compression probe (sampled on the first payloads of a stream, then once in 64 while the
stream keeps failing it, as for a group's KV in production), not compression itself. Each
figure is the best of ``reps`` passes over fresh stores.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash
import zstandard

from hkv_service.core.api import AdmissionCap
from storage import DiskKey, DiskTier
from storage.codec import Codec
from storage.verify import VERIFY_CHUNK, copy_digest

__all__ = ["run"]

MiB = 1 << 20
BATCH = 16  # blocks per write transaction / per fsync, the same for every store
SIZES = {"1MiB": MiB, "256KiB": 256 << 10}


def _blocks(size: int, count: int, seed: int) -> list[memoryview]:
    """``count`` distinct blocks of fp16 normal values, each in its own memory.

    Windows of one small random pool give distinct contents cheaply; they are copied out so
    that a writer reads its sources from memory, as a shard's offload does, not from a pool
    that stays in cache (which flattered the writers that copy least).
    """
    pool = np.random.default_rng(seed).standard_normal((size * 4) // 2).astype(np.float16)
    raw = pool.view(np.uint8)
    span = len(raw) - size
    blocks = np.empty((count, size), np.uint8)
    for i in range(count):
        start = (i * 4099 * 2) % span
        blocks[i] = raw[start : start + size]
    return [blocks[i].data for i in range(count)]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def _buffers(blocks: list[memoryview]) -> list[np.ndarray]:
    """Preallocated destinations, touched once so page faults are not timed."""
    outs = [np.empty(len(b), np.uint8) for b in blocks]
    for out in outs:
        out.fill(0)
    return outs


def _keys(count: int) -> list[DiskKey]:
    return [DiskKey(i.to_bytes(16, "big"), "bench", "COMPRESSED", 1) for i in range(count)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _Ours:
    """The disk tier as production runs it: one put_many (BATCH objects per transaction),
    get_into / get_many_into numpy buffers."""

    def __init__(self, root: Path, blocks: list[memoryview]) -> None:
        self.root, self.blocks, self.keys = root / "ours", blocks, _keys(len(blocks))
        self.outs, self.kept_zstd = _buffers(blocks), False
        self.tier: DiskTier | None = None
        self.budget = 4 * sum(len(b) for b in blocks) + 64 * MiB

    def write(self) -> float:
        if self.tier is not None:
            self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)
        # A cap of two batches: put_many writes BATCH objects per transaction (half the cap)
        # and encodes the next batch while one commits.
        self.tier = tier = DiskTier(self.root, self.budget,
                                    AdmissionCap(max_objects=2 * BATCH, max_bytes=1 << 40))
        pairs = list(zip(self.keys, self.blocks, strict=True))
        seconds = _timed(lambda: tier.put_many(pairs))
        self.kept_zstd = any(m.codec is Codec.ZSTD for m in tier.scan())
        return seconds

    def read(self) -> float:
        tier = self.tier
        assert tier is not None
        return _timed(lambda: [tier.get_into(k, o) for k, o in zip(self.keys, self.outs,
                                                                     strict=True)])

    def read_many(self) -> float:
        tier = self.tier
        assert tier is not None
        return _timed(lambda: tier.get_many_into(self.keys, self.outs))

    def close(self) -> None:
        assert all(bytes(o) == bytes(b) for o, b in zip(self.outs, self.blocks, strict=True))
        if self.tier is not None:
            self.tier.close()


class _RawLmdb:
    """Bare py-lmdb, same sync mode and batching: put the bytes, get + one copy."""

    def __init__(self, root: Path, blocks: list[memoryview]) -> None:
        self.root, self.blocks = root / "raw", blocks
        self.keys = [k.to_bytes() for k in _keys(len(blocks))]
        self.outs = _buffers(blocks)
        self.env: lmdb.Environment | None = None
        self.map_size = 4 * sum(len(b) for b in blocks) + 64 * MiB

    def write(self) -> float:
        if self.env is not None:
            self.env.close()
        shutil.rmtree(self.root, ignore_errors=True)
        self.env = env = lmdb.open(str(self.root), map_size=self.map_size, sync=True,
                                   metasync=True, writemap=False)

        def batches() -> None:
            for i in range(0, len(self.blocks), BATCH):
                with env.begin(write=True) as txn:
                    for key, block in zip(self.keys[i : i + BATCH], self.blocks[i : i + BATCH],
                                          strict=True):
                        txn.put(key, block)

        return _timed(batches)

    def _gets(self, copy: Callable[[memoryview, memoryview], object]) -> float:
        """Time one get + ``copy(view, destination)`` per block, one read txn per get."""
        env = self.env
        assert env is not None

        def gets() -> None:
            for key, out in zip(self.keys, self.outs, strict=True):
                with env.begin(buffers=True) as txn:
                    view = txn.get(key)
                    assert view is not None
                    copy(view, out.data)

        return _timed(gets)

    def read(self) -> float:
        def copy(view: memoryview, dest: memoryview) -> None:
            dest[:] = view

        return self._gets(copy)

    def read_verify(self) -> float:
        """``read`` plus the xxh3-128 of each copy, with the tier's own copy-and-hash
        (:func:`storage.verify.copy_digest`): the bare cost of a verify-every-byte load, no
        header or ticket."""
        return self._gets(copy_digest)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


class _PlainFile:
    """One file, writev + fsync per batch; read back with readinto."""

    def __init__(self, root: Path, blocks: list[memoryview]) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.path, self.blocks, self.outs = root / "plain.bin", blocks, _buffers(blocks)

    def write(self) -> float:
        def batches() -> None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for i in range(0, len(self.blocks), BATCH):
                    os.writev(fd, self.blocks[i : i + BATCH])
                    os.fsync(fd)
            finally:
                os.close(fd)

        return _timed(batches)

    def read(self) -> float:
        def reads() -> None:
            with self.path.open("rb", buffering=0) as f:
                for out in self.outs:
                    f.readinto(out.data)

        return _timed(reads)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def _measure(root: Path, blocks: list[memoryview], reps: int) -> dict[str, dict[str, Any]]:
    """Best-of-``reps`` figures; contenders alternate inside each rep, so drift in the disk
    (other tenants, writeback) hits all of them alike."""
    ours, raw, plain = _Ours(root, blocks), _RawLmdb(root, blocks), _PlainFile(root, blocks)
    best: dict[str, float] = {}

    def note(name: str, seconds: float) -> None:
        best[name] = min(seconds, best.get(name, float("inf")))

    writers = [("raw_put", raw.write), ("ours_put", ours.write), ("file_write", plain.write)]
    readers = [("raw_get", raw.read), ("ours_get", ours.read),
               ("ours_get_many", ours.read_many), ("file_read", plain.read),
               ("raw_get_verify", raw.read_verify)]
    for rep in range(reps):  # rotate the order: no contender always follows another's I/O
        for name, fn in writers[rep % 3 :] + writers[: rep % 3]:
            note(name, fn())
    for rep in range(reps + 1):  # the first pass also maps the pages; best-of drops it
        for name, fn in readers[rep % 5 :] + readers[: rep % 5]:
            note(name, fn())
    total = sum(len(b) for b in blocks)
    gbps = {name: _gbps(total, seconds) for name, seconds in best.items()}
    for contender in (ours, raw, plain):
        contender.close()
    return {
        "ours": {"offload_gbps": gbps["ours_put"], "load_gbps": gbps["ours_get"],
                 "load_many_gbps": gbps["ours_get_many"], "zstd_kept": ours.kept_zstd},
        "lmdb": {"put_gbps": gbps["raw_put"], "get_gbps": gbps["raw_get"],
                 "get_verify_gbps": gbps["raw_get_verify"]},
        "file": {"write_gbps": gbps["file_write"], "read_gbps": gbps["file_read"]},
    }


def _hash_hot_gbps(reps: int) -> float:
    """xxh3-128 on one ``VERIFY_CHUNK`` buffer that stays in cache: the verify's own speed."""
    chunk = np.random.default_rng(0).integers(0, 256, VERIFY_CHUNK, np.uint8).data
    rounds = 64
    best = min(_timed(lambda: [xxhash.xxh3_128_digest(chunk) for _ in range(rounds)])
               for _ in range(4 * reps))
    return _gbps(rounds * VERIFY_CHUNK, best)


def _zstd_ratio(block: memoryview) -> float:
    frame = zstandard.ZstdCompressor(level=1, write_checksum=False).compress(block)
    return round(len(frame) / len(block), 4)


def run(quick: bool = False) -> dict[str, Any]:
    """Measure and return ``{"name", "quick", "figures", "baseline", "ratios"}``."""
    total_bytes, reps = (32 * MiB, 2) if quick else (256 * MiB, 5)
    figures: dict[str, Any] = {"batch_blocks": BATCH}
    baseline: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix="hkv-bench-disk-"))
    hash_gbps = _hash_hot_gbps(reps)
    figures["verify"] = {"xxh3_128_hot_gbps": hash_gbps, "chunk_bytes": VERIFY_CHUNK}
    try:
        for label, size in SIZES.items():
            blocks = _blocks(size, total_bytes // size, seed=size)
            got = _measure(root / label, blocks, reps)
            ours, raw, plain = got["ours"], got["lmdb"], got["file"]
            figures[label] = {**ours, "zstd_ratio": _zstd_ratio(blocks[0])}
            baseline[label] = {"lmdb": raw, "file": plain}
            ratios.update({
                f"offload_vs_lmdb_put_{label}": ours["offload_gbps"] / raw["put_gbps"],
                f"load_vs_lmdb_get_{label}": ours["load_gbps"] / raw["get_gbps"],
                f"load_many_vs_lmdb_get_{label}": ours["load_many_gbps"] / raw["get_gbps"],
                f"offload_vs_file_write_{label}": ours["offload_gbps"] / plain["write_gbps"],
                # bare get + copy + hash of the copy on one thread: verify without the helper
                f"serial_verify_vs_lmdb_get_{label}": raw["get_verify_gbps"] / raw["get_gbps"],
            })
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"name": "disk", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": {name: round(value, 3) for name, value in ratios.items()}}
