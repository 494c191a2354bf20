"""A shard's host pools in one shared-memory segment that workers on its node map.

Without it every byte a worker reads or writes crosses Ray's object store: the shard copies a
read into it and the worker gets a view; a write is pickled into it and the shard copies it
into its pool. With it the bytes are copied once, between the worker's array and the mapped
pool; the control messages (claims, commits) still go through the shard.

The segment is a ``memfd`` (no name in ``/dev/shm`` to leak): the kernel frees it when the
shard process and every mapping of it are gone, so a SIGKILLed shard leaves nothing behind
once its workers let go. A worker opens it through ``/proc/<shard pid>/fd/<fd>`` (same node,
same pid namespace; anywhere else the open fails or the nonce differs, and the worker keeps
the Ray path)::

    [ header: magic | nonce (16 B) | alive (int64) | per pool: worker claims, finishes ]
    [ per pool: seq | generation | object_id | length | claim_pid | claim_start ]
                                                int64 x num_blocks each   (meta)
    [ pool 0 data: num_blocks x stride (+ pad) ] [ pool 1 data ] ...   page-aligned (data)

``seq`` is a per-block sequence lock: odd while the block's bytes are being replaced, bumped
on every change of its bytes, so a reader that copied a block and finds ``seq``,
``generation`` and ``object_id`` unchanged afterwards copied bytes no writer touched
(:mod:`workers.shared`). ``claim_pid``/``claim_start`` name the process copying into the
block (0: none). A pool's records change only under its :class:`MetaLock`, which the shard
and every worker that claims blocks itself take (``workers.pool.Slots`` holds the rules).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import select
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MAGIC", "META_FIELDS", "LockFile", "MetaLock", "MetaLockTimeout", "PoolRegion",
           "Segment", "SegmentInfo", "layout_regions"]

MAGIC = b"HKVSHM02"
PAGE = 4096
NONCE_AT, ALIVE_AT = 8, 24  # header offsets (magic at 0)
COUNTS_AT = 64  # per pool i: claims and finishes made by workers, two int64 at 64 + 16 i
MAX_POOLS = (PAGE - COUNTS_AT) // 16
META_FIELDS = ("seq", "generation", "object_id", "length", "claim_pid", "claim_start")
LOCK_WAIT_S = 2.0  # a pool's records held longer than this by another process: give up


@dataclass(frozen=True, slots=True)
class PoolRegion:
    """Where one pool lives in the segment. ``data_offset`` is block 0's first byte
    (relative to the data region's start); a padded pool starts ``pad`` bytes into its own
    page-aligned slot, as a private padded pool does (``ShardConfig.pool_stride_pad``)."""

    name: str
    nbytes: int
    num_blocks: int
    stride: int
    meta_offset: int  # from the segment's start
    data_offset: int  # from the data region's start


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """What a shard tells a worker so that it can map the segment (``ShardActor.shared_pool``)."""

    pid: int
    fd: int
    nonce: bytes
    meta_bytes: int  # the data region starts here
    size: int
    pools: tuple[PoolRegion, ...]
    instance: int  # the shard process (``ShardActor.instance``) the segment belongs to
    control: str = ""  # its claims' socket (workers.control), abstract name; "": through Ray
    # a worker may claim blocks itself (under the pools' MetaLocks) instead of asking the
    # shard on its control socket; the layout gives it the sizes the shard would check
    worker_claims: bool = False
    layout: Any = None  # hkv_service.core.layout.Layout when worker_claims


def _up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def layout_regions(columns: Mapping[str, tuple[int, int]], num_blocks: int,
                   pad: int) -> tuple[tuple[PoolRegion, ...], int, int]:
    """``columns``: ``{name: (nbytes, stride)}``. Returns the regions, the meta region's size
    (the data region's offset) and the segment's size."""
    if len(columns) > MAX_POOLS:
        raise ValueError(f"{len(columns)} pools in one segment: at most {MAX_POOLS}")
    meta_at = PAGE
    data_at = 0
    regions = []
    for name, (nbytes, stride) in columns.items():
        regions.append(PoolRegion(name, nbytes, num_blocks, stride, meta_at, data_at + pad))
        meta_at += len(META_FIELDS) * 8 * num_blocks
        data_at += _up(num_blocks * stride + pad)
    meta_bytes = _up(meta_at)
    return tuple(regions), meta_bytes, meta_bytes + data_at


def meta_arrays(buf: Any, region: PoolRegion) -> dict[str, np.ndarray]:
    """The pool's per-block int64 arrays, views into ``buf`` (the segment from its start)."""
    n = region.num_blocks
    return {f: np.frombuffer(buf, np.int64, n, region.meta_offset + 8 * n * i)
            for i, f in enumerate(META_FIELDS)}


class Segment:
    """The shard's side: one memfd holding every pool's meta arrays and bytes, mapped
    read-write; it lives as long as the shard process (and any worker mapping of it)."""

    def __init__(self, columns: Mapping[str, tuple[int, int]], num_blocks: int,
                 pad: int = 0) -> None:
        self.regions, self.meta_bytes, self.size = layout_regions(columns, num_blocks, pad)
        self.fd = os.memfd_create("hkv-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.nonce = os.urandom(16)
        self.map[:8] = MAGIC
        self.map[NONCE_AT : NONCE_AT + 16] = self.nonce
        self._alive = np.frombuffer(self.map, np.int64, 1, ALIVE_AT)
        self._alive[0] = 1
        self.by_name = {r.name: r for r in self.regions}
        # the shard's own open file for the pools' locks: self.fd is closed at shutdown (no
        # attach after it) while the pools still change under their locks
        self.lock_file = LockFile(os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_CLOEXEC))

    def lock(self, name: str) -> MetaLock:
        """The lock of pool ``name``'s records (the shard's; a worker makes its own)."""
        return MetaLock(self.lock_file, self.regions.index(self.by_name[name]))

    def worker_counts(self) -> tuple[int, int]:
        """Claims and finishes workers made themselves, over every pool."""
        counts = np.frombuffer(self.map, np.int64, 2 * len(self.regions), COUNTS_AT)
        return int(counts[0::2].sum()), int(counts[1::2].sum())

    def meta(self, name: str) -> dict[str, np.ndarray]:
        return meta_arrays(self.map, self.by_name[name])

    def data(self, name: str) -> torch.Tensor:
        """The pool's bytes from block 0 on, as a uint8 tensor over the mapping."""
        r = self.by_name[name]
        start = self.meta_bytes + r.data_offset
        return torch.frombuffer(self.map, dtype=torch.uint8,
                                count=r.num_blocks * r.stride, offset=start)

    def info(self, instance: int, control: str = "", worker_claims: bool = False,
             layout: Any = None) -> SegmentInfo:
        return SegmentInfo(os.getpid(), self.fd, self.nonce, self.meta_bytes, self.size,
                           self.regions, instance, control, worker_claims and layout is not None,
                           layout)

    def close(self) -> None:
        """Say the segment is dead (a worker checks before every copy and lets go); the
        memory goes back once this process and every worker mapping are gone."""
        if self._alive[0]:
            self._alive[0] = 0
            os.close(self.fd)  # no worker attaches from now on


class MetaLockTimeout(TimeoutError):
    """Another process held a pool's records for over :data:`LOCK_WAIT_S` (a stopped
    worker): the call that needed them fails; nothing was changed."""


_FLOCK = struct.Struct("hhqqi4x")  # struct flock on Linux x86-64 / arm64


class LockFile:
    """A descriptor closed once nothing refers to it any more: an open file of a segment
    whose OFD locks guard its pools' records (a thread still inside one keeps it open:
    closing it under that thread would drop its lock, or let its unlock hit a file reopened
    under the same descriptor number), a mapping's pidfd."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self) -> None:
        os.close(self.fd)


class MetaLock:
    """One pool's records, locked against every thread of this process and (with ``file``,
    an open file of the segment) every other process: an OFD lock on byte ``index`` of the
    segment's file. It goes with the open file: a process killed while holding it holds it no
    more, so a dead worker never blocks the shard (what it left half-done is undone by
    ``workers.pool.Slots``). A live one that stops while holding it makes others wait
    :data:`LOCK_WAIT_S`, then :class:`MetaLockTimeout`."""

    __slots__ = ("_file", "_index", "_local", "_lock_arg", "_unlock_arg", "counts")

    def __init__(self, file: LockFile | None = None, index: int = 0,
                 counts: np.ndarray | None = None) -> None:
        self._file, self._index = file, index
        self._local = threading.Lock()
        self.counts = counts  # this pool's (claims, finishes) by workers, in the header
        # (packed once: a claim takes the lock on the write's hot path)
        self._lock_arg = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, index, 1, 0)
        self._unlock_arg = _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, index, 1, 0)

    def __enter__(self) -> MetaLock:
        if not self._local.acquire(blocking=False) and \
                not self._local.acquire(timeout=LOCK_WAIT_S):
            raise MetaLockTimeout(f"pool {self._index}'s records: another thread of this "
                                  f"process held them for over {LOCK_WAIT_S} s")
        if self._file is None:
            return self
        try:
            fcntl.fcntl(self._file.fd, fcntl.F_OFD_SETLK, self._lock_arg)
        except OSError as exc:
            try:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                self._wait(self._file.fd)
            except BaseException:
                self._local.release()
                raise
        return self

    def _wait(self, fd: int) -> None:
        """Another process holds the lock: ask again, pausing longer each time, until the
        deadline."""
        deadline = time.monotonic() + LOCK_WAIT_S
        pause = 20e-6
        while True:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, self._lock_arg)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise MetaLockTimeout(f"pool {self._index}'s records: another process held "
                                      f"them for over {LOCK_WAIT_S} s (a stopped worker?)")

    def __exit__(self, *_: object) -> None:
        try:
            if self._file is not None:
                fcntl.fcntl(self._file.fd, fcntl.F_OFD_SETLK, self._unlock_arg)
        finally:
            self._local.release()


def pool_counts(buf: Any, index: int) -> np.ndarray:
    """Pool ``index``'s two header counters (workers' claims, finishes), a view into ``buf``."""
    return np.frombuffer(buf, np.int64, 2, COUNTS_AT + 16 * index)


Writer = tuple[int, int]  # a writing process: (pid, start time in clock ticks since boot)


def process_start(pid: int) -> int | None:
    """``pid``'s start time (``/proc/<pid>/stat`` field 22), None if no process has it. With the
    pid it names one process for good: a pid reused later has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])  # the name in (...) may hold spaces


def fd_ready(fd: int, events: int = select.POLLIN, timeout_s: float = 0.0) -> bool:
    """Whether ``fd`` is ready for ``events`` within ``timeout_s`` (0: now). ``poll``, not
    ``select``: select refuses descriptors past 1023, and an engine's process (vLLM's, with
    its sockets and files) holds more than that."""
    waiter = select.poll()
    waiter.register(fd, events)
    return bool(waiter.poll(max(0.0, timeout_s) * 1000))


def this_writer() -> Writer:
    start = process_start(os.getpid())
    assert start is not None
    return os.getpid(), start


def writer_alive(writer: Writer) -> bool:
    """Whether the process ``writer`` names may still run code: not while any of its threads
    does (a pidfd turns readable only once the whole thread group exited; ``/proc``'s state
    shows a zombie as soon as the main thread is one). A shard asks it on every claim: the
    pidfd of a writer found live is kept (:class:`_Watched`), so asking again costs one
    ``poll`` (~1 us) instead of an open and a read of ``/proc`` (~20 us)."""
    return _WATCHED.alive(writer)


class _Watched:
    """Pidfds of writers found live, at most :data:`WATCHED_MAX` (the least recently asked
    about closed first). A pidfd names one process for good (its pid may be reused, the
    pidfd never follows it), so once its start time matched, its readability alone says
    whether that process ended."""

    def __init__(self) -> None:
        self._fds: OrderedDict[Writer, int] = OrderedDict()
        self._lock = threading.Lock()  # (an fd closed by one thread never polled by another)

    def alive(self, writer: Writer) -> bool:
        with self._lock:
            fd = self._fds.get(writer)
            if fd is not None:
                if not fd_ready(fd):
                    self._fds.move_to_end(writer)
                    return True
                del self._fds[writer]  # it ended: never asked about again
                os.close(fd)
                return False
            pid, start = writer
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return False  # reaped
            # the start time read after the open names the process the pidfd refers to
            if process_start(pid) != start or fd_ready(fd):
                os.close(fd)
                return False
            self._fds[writer] = fd
            if len(self._fds) > WATCHED_MAX:
                os.close(self._fds.popitem(last=False)[1])
            return True


WATCHED_MAX = 64  # writer processes whose pidfd a shard keeps (a node's workers)
_WATCHED = _Watched()
