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

    [ header: magic | nonce (16 B) | alive (int64) ]      page 0
    [ per pool: seq | generation | object_id | length ]   int64 x num_blocks each   (meta)
    [ pool 0 data: num_blocks x stride (+ pad) ] [ pool 1 data ] ...   page-aligned (data)

Only the shard writes the meta region; workers map it read-only. ``seq`` is a per-block
sequence lock: odd while the block's bytes are being replaced, bumped on every change of its
bytes, so a reader that copied a block and finds ``seq``, ``generation`` and ``object_id``
unchanged afterwards copied bytes no writer touched (:mod:`workers.shared`).
"""

from __future__ import annotations

import mmap
import os
import select
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["MAGIC", "META_FIELDS", "PoolRegion", "Segment", "SegmentInfo", "layout_regions"]

MAGIC = b"HKVSHM01"
PAGE = 4096
NONCE_AT, ALIVE_AT = 8, 24  # header offsets (magic at 0)
META_FIELDS = ("seq", "generation", "object_id", "length")


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


def _up(n: int, to: int = PAGE) -> int:
    return -(-n // to) * to


def layout_regions(columns: Mapping[str, tuple[int, int]], num_blocks: int,
                   pad: int) -> tuple[tuple[PoolRegion, ...], int, int]:
    """``columns``: ``{name: (nbytes, stride)}``. Returns the regions, the meta region's size
    (the data region's offset) and the segment's size."""
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

    def meta(self, name: str) -> dict[str, np.ndarray]:
        return meta_arrays(self.map, self.by_name[name])

    def data(self, name: str) -> torch.Tensor:
        """The pool's bytes from block 0 on, as a uint8 tensor over the mapping."""
        r = self.by_name[name]
        start = self.meta_bytes + r.data_offset
        return torch.frombuffer(self.map, dtype=torch.uint8,
                                count=r.num_blocks * r.stride, offset=start)

    def info(self, instance: int, control: str = "") -> SegmentInfo:
        return SegmentInfo(os.getpid(), self.fd, self.nonce, self.meta_bytes, self.size,
                           self.regions, instance, control)

    def close(self) -> None:
        """Say the segment is dead (a worker checks before every copy and lets go); the
        memory goes back once this process and every worker mapping are gone."""
        if self._alive[0]:
            self._alive[0] = 0
            os.close(self.fd)  # no worker attaches from now on


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


def this_writer() -> Writer:
    start = process_start(os.getpid())
    assert start is not None
    return os.getpid(), start


def writer_alive(writer: Writer) -> bool:
    """Whether the process ``writer`` names may still run code: not while any of its threads
    does (a pidfd turns readable only once the whole thread group exited; ``/proc``'s state
    shows a zombie as soon as the main thread is one). A shard asks it on every claim: the
    pidfd of a writer found live is kept (:class:`_Watched`), so asking again costs one
    ``select`` (~1 us) instead of an open and a read of ``/proc`` (~20 us)."""
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
                if not select.select([fd], [], [], 0)[0]:
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
            if process_start(pid) != start or select.select([fd], [], [], 0)[0]:
                os.close(fd)
                return False
            self._fds[writer] = fd
            if len(self._fds) > WATCHED_MAX:
                os.close(self._fds.popitem(last=False)[1])
            return True


WATCHED_MAX = 64  # writer processes whose pidfd a shard keeps (a node's workers)
_WATCHED = _Watched()
