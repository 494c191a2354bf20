"""A worker's side of a shard's shared-memory pools (:mod:`workers.shm`): bytes copied once.

:class:`Mapped` is one shard's segment mapped in this process (the data region read-write;
the meta region read-write where this process claims blocks itself, else read-only).
:class:`SharedLink` wraps a :class:`~workers.link.ShardLink` and takes the data plane's
``read_blocks`` and ``write_blocks`` calls on itself when the shard's segment can be mapped
here (same node, same pid namespace, host pools); every other call, and any shard it cannot
map, goes through the wrapped link as before.

Read (no call to the shard at all; a seqlock over the shard's own meta arrays)::

    s0 = seq[b]; (s0 even, generation, object) checked    the shard's read check
    copy length[b] bytes out of the segment
    seq[b] == s0, generation and object still the same   else the copy is discarded
    items that fail either check are asked of the shard (it gives the verdict: STALE ...)

A batch's copies of 2 MiB or more are split over this thread and helper threads
(:mod:`workers.copies`: one thread copying block by block moves about half of what the
machine can); the call returns only once every part is copied, so the second look at ``seq``
(a read) and the finish (a write) always come after the last byte.

A write bumps ``seq`` before it changes a byte and after (``BlockPool.write``/``claim``/
``finish``), so an unchanged ``seq`` means no byte changed during the copy. The loads of the
copy and of the second ``seq`` are ordered on x86-64 (TSO) without a fence; Python has no fence
to offer elsewhere, so other machines keep the Ray path (:data:`ORDERED`).

Write (the bytes never go through Ray), with the shard's ``worker_claims`` (the default: no
call to another process at all)::

    under each pool's lock (an OFD lock on the segment's file, ``shm.MetaLock``):
      the shard's size and write checks, then claim   ``pool.Slots.claim``, in the records
    copy each array into its block
    under the lock: finish                           ``seq`` even: readable

The rules are the shard's own (``pool.Slots``, ``ports.size_refusal``: one home for both);
the shard takes the same lock for every change of a pool's records, and around its own
copies out of the segment (a worker's claim never lands between its check and its copy). A
write with commits for the shard to report still ends with the shard's ``finish_blocks``.
Without ``worker_claims``, one round trip to the shard::

    claim_blocks(handles, sizes, writer)   the shard's write checks; the blocks are this
                                           process's to fill (no one else's while it lives)
    copy each array into its block
    finish_blocks(...)                     readable; then as write_blocks (commits, tags)

The finish is posted (:meth:`~workers.control.ControlClient.post`): sent once every byte is
copied, its answer not waited for when the write's result does not depend on it (no commits
for the shard to report: the data plane's ``report=False``, a plain write). The shard takes a
connection's calls in order, so the data plane's ``settle_blocks`` (sent on the same socket)
and this process's next claim find the blocks finished; a read that finds a block still
claimed for the very object it reads waits for its finish (this process's own: until their
answers are read; another's: up to :data:`FINISH_WAIT_S`) before it leaves the block to the
shard (:meth:`SharedLink._read_mapped`): a block committed right after its write is read
from the segment, not refused as STALE. Either way, a writer killed before its finish leaves
the block claimed by a dead process: never readable (odd ``seq``), taken back by the next
write of the block (``Slots.check_claim``). One killed after it leaves whole bytes: the
finish is made only after the last byte was copied. A finish refused (the claim was taken
from a live writer: never, short of the shard's own reset) leaves the block unreadable,
counted in ``ControlClient.refused`` when posted: reads of it are STALE, never its bytes.
A worker stopped while it holds a pool's lock holds up that pool's changes for
``shm.LOCK_WAIT_S``, then they fail (a sentence, nothing changed); a killed one's lock goes
with it.

A shard that died (its pid's ``pidfd`` is readable) or shut down (the segment's alive word is
0) is let go before the next copy: a worker never reads a replaced shard's segment. The mapping
is dropped then, so the kernel frees a killed shard's memory once its workers noticed.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from .control import ControlClient
from .copies import copier
from .link import Deferred, Pending, ShardLink, ShardUnavailable
from .pool import HandleBatch, Slots, StaleWrite, _as_bytes
from .ports import ItemResult, Outcome, PackedRead, size_refusal
from .shm import (
    ALIVE_AT,
    MAGIC,
    NONCE_AT,
    LockFile,
    MetaLock,
    MetaLockTimeout,
    SegmentInfo,
    Writer,
    fd_ready,
    meta_arrays,
    pool_counts,
    this_writer,
    writer_alive,
)

__all__ = ["ORDERED", "Mapped", "NotShared", "SharedLink", "shared_links"]

log = logging.getLogger(__name__)

ORDERED = platform.machine() in ("x86_64", "AMD64")  # loads not reordered with loads (TSO)
ARENA_BYTES = 256 << 20  # read buffers kept for reuse per shard (_Arena)
RETRY_ATTACH_S = 1.0  # a shard whose segment could not be mapped is asked again after this
SMALL_BATCH = 4  # reads of at most this many items check them one by one (Mapped._read_few)
SYNC_S = 2.0  # a read waits this long at most for this process's finishes in flight
FINISH_WAIT_S = 0.2  # ... and this long for a finish of the object it reads by anyone else
FINISH_POLL_S = 50e-6  # (how often it looks meanwhile)
_EMPTY = -1
_UNREAD = ItemResult(Outcome.FAILED, "not read")  # an item's span until it is read
_GRANTED = ItemResult(Outcome.OK)


class NotShared(Exception):
    """The shard's segment cannot be mapped here (another node or pid namespace, dead)."""


class _Region:
    __slots__ = ("data", "generation", "length", "num_blocks", "object_id", "seq", "stride")

    def __init__(self, meta: dict[str, np.ndarray], data: np.ndarray, stride: int) -> None:
        self.seq, self.generation = meta["seq"], meta["generation"]
        self.object_id, self.length = meta["object_id"], meta["length"]
        self.data, self.stride, self.num_blocks = data, stride, len(self.seq)


class Mapped:
    """One shard's segment, mapped in this process."""

    def __init__(self, info: SegmentInfo) -> None:
        self.info = info
        try:
            self.pidfd = os.pidfd_open(info.pid)  # before the open: see alive()
        except OSError as exc:
            raise NotShared(f"no process {info.pid} here: {exc}") from None
        try:
            fd = os.open(f"/proc/{info.pid}/fd/{info.fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            os.close(self.pidfd)
            raise NotShared(f"cannot open the segment of process {info.pid}: {exc}") from None
        # claiming blocks here changes the records (under their locks: this open file's)
        self.worker_claims = bool(info.worker_claims) and info.layout is not None
        try:
            self._meta = mmap.mmap(fd, info.meta_bytes, flags=mmap.MAP_SHARED, prot=(
                mmap.PROT_READ | mmap.PROT_WRITE) if self.worker_claims else mmap.PROT_READ)
            if self._meta[:8] != MAGIC or self._meta[NONCE_AT : NONCE_AT + 16] != info.nonce:
                self._meta.close()  # another process's file under that pid and fd
                raise NotShared(f"process {info.pid}'s fd {info.fd} is not this shard's segment")
            # populated: one pass now instead of a page fault per 4 KiB on each page's first
            # copy (which costs more than the copy); the pages exist already (the shard's)
            self._data = mmap.mmap(fd, info.size - info.meta_bytes, offset=info.meta_bytes,
                                   flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            self.inode = os.fstat(fd).st_ino  # (what /proc/<pid>/maps names the mapping by)
        except BaseException:
            os.close(self.pidfd)
            os.close(fd)
            raise
        lock_file = LockFile(fd)  # the pools' locks are this open file's (closed with it)
        # the pidfd is closed by close(), or with this object if no one called it (a data
        # plane dropped without closing its links: no descriptor outlives its mapping)
        self._pid_file: LockFile | None = LockFile(self.pidfd)
        self.me = this_writer()  # (alive: it is this process)
        self._alive = np.frombuffer(self._meta, np.int64, 1, ALIVE_AT)
        self.pools = {r.name: _Region(meta_arrays(self._meta, r), np.frombuffer(
            self._data, np.uint8, r.num_blocks * r.stride, r.data_offset).reshape(
                r.num_blocks, r.stride), r.stride) for r in info.pools}
        self.slots: dict[str, Slots] = {}
        if self.worker_claims:
            self.slots = {r.name: Slots(r.name, r.nbytes, meta_arrays(self._meta, r), MetaLock(
                lock_file, i, pool_counts(self._meta, i)), self.pools[r.name].data)
                for i, r in enumerate(info.pools)}

    def alive(self) -> bool:
        """The shard process that made the segment still runs and has not shut it down.
        (The pidfd was opened before the segment and the nonce matched: it is that process.)"""
        held = self._pid_file  # (kept open while asked, whatever close() does meanwhile)
        if held is None or not self._alive[0]:
            return False
        return not fd_ready(held.fd)  # readable once it exited

    def close(self) -> None:
        """Let go of the segment (its memory is freed once no one maps it)."""
        if self.pidfd < 0:
            return
        self.pidfd, self._pid_file = -1, None  # (closed with its last reference: this one)
        self.pools, self.slots = {}, {}  # (the locks' file closes with the last of them)
        self._alive = np.zeros(1, np.int64)
        for m in (self._meta, self._data):
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                m.close()

    # -- the copies -------------------------------------------------------------------------

    def read(self, batch: HandleBatch, dest: Callable[[int, int], np.ndarray | None]
             ) -> np.ndarray:
        """Copy each readable item's bytes into ``dest(i, nbytes)`` (None: skip the item);
        returns one bool per item, True where the copy is the object's bytes (see the module
        docstring). False items were not (wholly) copied: ask the shard."""
        ok = np.zeros(len(batch), dtype=bool)
        if not self.alive():
            return ok
        if len(batch) <= SMALL_BATCH:
            self._read_few(batch, dest, ok)
            return ok
        slots, blocks = batch.slot_of(), batch.field("block")
        gens, oids = batch.field("generation"), batch.field("object_id")
        for s, col in enumerate(batch.columns):
            r = self.pools.get(col[3])
            if r is None:
                continue
            idx = np.flatnonzero(slots == s) if len(batch.columns) > 1 else np.arange(len(batch))
            idx = idx[(blocks[idx] >= 0) & (blocks[idx] < r.num_blocks)]
            b = blocks[idx]
            s0 = r.seq[b]  # (fancy indexing: a copy, taken before the bytes)
            good = ((s0 & 1) == 0) & (r.generation[b] == gens[idx]) & (
                r.object_id[b] == oids[idx]) & (oids[idx] != _EMPTY)
            pairs = []
            for i, blk, n in zip(idx[good].tolist(), b[good].tolist(),
                                 r.length[b[good]].tolist(), strict=True):
                out = dest(i, n)
                if out is not None:
                    pairs.append((out, r.data[blk, :n]))
                    ok[i] = True
            copier().copy(pairs)  # (every part copied before the second look at seq)
            ok[idx] &= (r.seq[b] == s0) & (r.generation[b] == gens[idx]) & (
                r.object_id[b] == oids[idx])
        return ok

    def _read_few(self, batch: HandleBatch, dest: Callable[[int, int], np.ndarray | None],
                  ok: np.ndarray) -> None:
        """:meth:`read`, item by item (a handful of items: numpy's per-call cost would weigh
        more than the scalar reads). The same loads in the same order for each item: ``seq``, then
        the identity and length, the bytes (all items' copies at once, ``workers.copies``),
        then ``seq`` and the identity again."""
        copied: list[tuple[int, _Region, int, int, int, int]] = []
        pairs = []
        for i, (slot, oid, gen, blk, _) in enumerate(batch.rows.tolist()):
            r = self.pools.get(batch.columns[slot][3])
            if r is None or not 0 <= blk < r.num_blocks or oid == _EMPTY:
                continue
            s0 = int(r.seq[blk])
            if s0 & 1 or int(r.generation[blk]) != gen or int(r.object_id[blk]) != oid:
                continue
            n = int(r.length[blk])
            out = dest(i, n)
            if out is None:
                continue
            pairs.append((out, r.data[blk, :n]))
            copied.append((i, r, blk, s0, gen, oid))
        copier().copy(pairs)  # (every part copied before the second look at seq)
        for i, r, blk, s0, gen, oid in copied:
            ok[i] = int(r.seq[blk]) == s0 and int(r.generation[blk]) == gen and \
                int(r.object_id[blk]) == oid

    def finishing(self, batch: HandleBatch) -> np.ndarray:
        """One bool per item: its block is claimed for exactly that object (odd ``seq``,
        the handle's generation and object): its bytes are being copied or its finish was
        not taken yet."""
        out = np.zeros(len(batch), dtype=bool)
        if not self.alive():
            return out
        for i, (slot, oid, gen, blk, _) in enumerate(batch.rows.tolist()):
            r = self.pools.get(batch.columns[slot][3])
            if r is not None and 0 <= blk < r.num_blocks and oid != _EMPTY:
                out[i] = bool(int(r.seq[blk]) & 1) and int(r.generation[blk]) == gen and \
                    int(r.object_id[blk]) == oid
        return out

    # -- claims made here (info.worker_claims): ShardActor.claim_blocks without the call ----

    def claim(self, batch: HandleBatch, sizes: Sequence[int], writer: Writer,
              tags: Sequence[Any] | None, commits: Sequence[Any] | None
              ) -> list[ItemResult] | None:
        """What the shard's ``claim_blocks`` answers, decided here under each pool's lock by
        the same rules (``ports.size_refusal``, ``pool.Slots.claim``); None, as the shard
        answers, for a writer that is not a live process seen from here (its claims could
        never lapse). The caller found the shard alive just before (``SharedLink._attach``)
        and asks again once the write is finished: a claim in a dead shard's records is
        never acknowledged."""
        slots = self._slots()
        if writer != self.me and not writer_alive(writer):
            return None
        out: list[ItemResult] = [_GRANTED] * len(batch)
        rows = batch.rows.tolist()
        for slot, col in enumerate(batch.columns):
            items = [i for i, row in enumerate(rows) if row[0] == slot]
            pool = slots.get(col[3])
            if pool is None:
                for i in items:
                    out[i] = ItemResult(Outcome.FAILED, f"bad handle: no column {col[3]!r}")
                continue
            try:
                with pool.lock:
                    for i in items:
                        out[i] = self._claim_one(pool, col, rows[i], sizes[i], writer,
                                                 tags[i] if tags else None,
                                                 commits[i] if commits else None)
            except MetaLockTimeout as exc:  # nothing of this pool's items was changed after it
                for i in items:
                    if out[i] is _GRANTED:
                        out[i] = ItemResult(Outcome.FAILED, str(exc))
        return out

    def _slots(self) -> dict[str, Slots]:
        slots = self.slots
        if not slots:  # let go of (by another thread: the shard died or was replaced)
            raise NotShared("the shard's segment was let go of")
        return slots

    def _claim_one(self, pool: Slots, col: Any, row: list[int], size: int, writer: Writer,
                   tag: Any, commit: Any) -> ItemResult:
        refused = size_refusal(self.info.layout, col[1], col[3],
                               tag.depth if tag is not None else None, commit, int(size))
        if refused is not None:
            return refused
        _, oid, gen, block, _ = row
        res = pool.claim_result(block, gen, oid, int(size), writer)
        if res.ok and pool.lock.counts is not None:
            pool.lock.counts[0] += 1
        return res

    def finish(self, batch: HandleBatch, writer: Writer) -> list[ItemResult]:
        """``writer`` copied its claims' bytes: readable (as the shard's ``finish_blocks``
        with nothing to report). An item whose claim is not held any more is STALE."""
        out: list[ItemResult] = [_GRANTED] * len(batch)
        self._each_claim(batch, lambda pool, i, blk, gen, oid: pool.finish(blk, gen, oid, writer),
                         out, count=1)
        return out

    def release(self, batch: HandleBatch, writer: Writer) -> None:
        """``writer`` gives its claims up (its copy failed): those blocks hold no object."""
        self._each_claim(batch, lambda pool, i, blk, gen, oid: pool.release(blk, gen, oid,
                                                                           writer),
                         [_GRANTED] * len(batch))

    def _each_claim(self, batch: HandleBatch, step: Callable[..., None], out: list[ItemResult],
                    count: int = -1) -> None:
        rows, slots = batch.rows.tolist(), self._slots()
        for slot, col in enumerate(batch.columns):
            pool = slots[col[3]]
            with pool.lock:
                for i, row in enumerate(rows):
                    if row[0] != slot:
                        continue
                    try:
                        step(pool, i, row[3], row[2], row[1])
                    except StaleWrite as exc:
                        out[i] = ItemResult(Outcome.STALE, str(exc))
                        continue
                    if count >= 0 and pool.lock.counts is not None:
                        pool.lock.counts[count] += 1

    def write(self, batch: HandleBatch, arrays: Sequence[Any], which: Sequence[int]) -> None:
        """Copy ``arrays[i]`` into the block of item ``i`` (claimed for this process) for each
        ``i`` in ``which``. Raises NotShared if the shard is gone."""
        if not self.alive():
            raise NotShared("the shard's segment is gone")
        pairs = []
        for i in which:
            slot, _, _, block, _ = batch.rows[i].tolist()
            r = self.pools[batch.columns[slot][3]]
            src = _as_bytes(arrays[i])
            pairs.append((r.data[block, : src.size], src))
        copier().copy(pairs)  # (returns once every part is copied: only then the finish)


class SharedLink:
    """A :class:`~workers.link.ShardLink` that copies the data plane's bytes through the
    shard's shared segment when it can, and through ``link`` otherwise."""

    def __init__(self, link: ShardLink) -> None:
        self.link = link
        self.shard_id = link.shard_id
        self.mapped: Mapped | None = None
        self.control: ControlClient | None = None  # the shard's claim socket, if reachable
        self._next_try = 0.0
        self._attach_lock = threading.Lock()  # one mapping per link, whatever the threads
        self.writer = this_writer()
        self._pid = os.getpid()
        self._arena = _Arena()

    def __getattr__(self, name: str) -> Any:  # kill, revive, alive ... of the wrapped link
        return getattr(self.link, name)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        if method == "read_blocks" and len(args) == 1 and not kwargs:
            m = self._attached()
            if m is not None:
                return self._read(m, HandleBatch.of(args[0]))
        if method == "write_blocks" and len(args) == 1 and "arrays" in kwargs and \
                set(kwargs) <= {"arrays", "tags", "commits", "report"}:
            m = self._attached()
            if m is not None:
                return self._write(m, HandleBatch.of(args[0]), **kwargs)
        if method == "settle_blocks" and self.control is not None and \
                self._attached() is not None:
            # on the socket the finishes went: the shard takes it after them (in order)
            return self._control_call(method, *args, **kwargs)
        return self.link.submit(method, *args, **kwargs)

    def close_mapping(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.control is not None:
            self.control.close()
            self.control = None

    def _control_call(self, method: str, *args: Any, **kwargs: Any) -> Pending:
        """``method`` (claim, finish, release, settle) over the shard's control socket when
        connected (tens of microseconds), else through the link (a Ray call). Sent when its
        result is asked for, as before: a claim nobody waits for is never made (it would
        keep its blocks from reuse for as long as this process lives)."""
        control = self.control
        if control is None:
            return self.link.submit(method, *args, **kwargs)

        def call(timeout_s: float) -> Any:
            try:
                return control.call(method, *args, timeout_s=timeout_s, **kwargs)
            except ShardUnavailable:
                self._lost_control(control)
                raise
        return Deferred(call)

    def _lost_control(self, control: ControlClient) -> None:
        """The shard's socket failed: gone or out of step; Ray from now on (or re-attach)."""
        control.close()
        if self.control is control:
            self.control = None

    def attach(self) -> bool:
        """Map the shard's segment now if it can be (mapping it populates every page: tens
        of milliseconds for a large pool, better paid before the first transfer than by
        it); True if mapped. Otherwise transfers try again as they come."""
        return self._attached() is not None

    def _attached(self) -> Mapped | None:
        """The shard's segment, mapped (again) if need be; None: use the link."""
        with self._attach_lock:
            return self._attach()

    def _attach(self) -> Mapped | None:
        if self._pid != os.getpid():  # a forked child: its own identity, its own connection
            self._pid, self.writer = os.getpid(), this_writer()
            self.close_mapping()
            self._next_try = 0.0
        if self.mapped is not None and not self.mapped.alive():
            self.close_mapping()  # dead or replaced: never read it again
            self._next_try = 0.0
        if self.mapped is not None or not ORDERED or time.monotonic() < self._next_try:
            return self.mapped
        self._next_try = time.monotonic() + RETRY_ATTACH_S
        try:
            info = self.link.submit("shared_pool").result(10.0)
            if info is not None:
                self.mapped = Mapped(info)
                if info.control:
                    try:
                        self.control = ControlClient(self.shard_id, info.control)
                    except OSError as exc:  # another network namespace: claims through Ray
                        log.info("shard %s: claims through the link (%s)", self.shard_id, exc)
        except NotShared as exc:
            log.info("shard %s: bytes through the link (%s)", self.shard_id, exc)
        except Exception as exc:  # the shard is down: the data plane's call finds out
            log.debug("shard %s: no shared pool now: %s", self.shard_id, exc)
        return self.mapped

    # -- read -------------------------------------------------------------------------------

    def read_into(self, handles: Sequence[Any], dests: Sequence[np.ndarray],
                  timeout_s: float) -> list[ItemResult | None]:
        """Copy each handle's bytes into ``dests[i]`` (a writable uint8 array of exactly the
        object's size: a staging buffer, a KV cache page): None where that was done, else
        the item's result (STALE ...). Through the segment when mapped (one copy, no call to
        the shard); what it cannot serve, through the link's ``read_blocks``."""
        batch = HandleBatch.of(handles)
        done = np.zeros(len(batch), dtype=bool)
        m = self._attached()
        if m is not None:
            done = self._read_mapped(
                m, batch, lambda i, n: dests[i] if dests[i].nbytes == n else None)
        out: list[ItemResult | None] = [None] * len(batch)
        rest = np.flatnonzero(~done).tolist()
        if rest:
            got = self.link.submit("read_blocks", batch.take(rest)).result(timeout_s)
            for j, i in enumerate(rest):
                item = got[j]
                if isinstance(item, ItemResult):
                    out[i] = item
                elif item.nbytes != dests[i].nbytes:
                    out[i] = ItemResult(Outcome.FAILED, f"{item.nbytes} bytes for a "
                                                        f"{dests[i].nbytes}-byte buffer")
                else:
                    np.copyto(dests[i], item)
        return out

    def _read_mapped(self, m: Mapped, batch: HandleBatch,
                     dest: Callable[[int, int], np.ndarray | None]) -> np.ndarray:
        """``m.read``, and for the items it could not serve, a wait for a finish that is
        under way: this process's own finishes in flight on the shard's socket are answered
        first (a block this process wrote, and may have committed, is readable once its
        finish was taken); a block whose claim is the very object asked for (another
        process's finish not taken yet) is waited for up to :data:`FINISH_WAIT_S`. What is
        still not readable then is left to the shard (its verdict: STALE ...)."""
        ok = m.read(batch, dest)
        if ok.all():
            return ok
        control = self.control
        synced = False
        if control is not None and control.in_flight:
            try:
                control.sync(SYNC_S)
                synced = True
            except ShardUnavailable:
                self._lost_control(control)
        rest = np.flatnonzero(~ok)
        deadline = time.monotonic() + FINISH_WAIT_S
        while len(rest):
            sub = batch.take(rest.tolist())
            if not synced:
                waiting = m.finishing(sub)
                if not waiting.any() or time.monotonic() > deadline:
                    break
                time.sleep(FINISH_POLL_S)
            synced = False
            def into(j: int, n: int, at: np.ndarray = rest) -> np.ndarray | None:
                return dest(int(at[j]), n)
            got = m.read(sub, into)
            ok[rest[got]] = True
            rest = rest[~got]
        return ok

    def _read(self, m: Mapped, batch: HandleBatch) -> Pending:
        """``read_blocks``: each item's bytes in one arena buffer (a span each), what the
        segment could not serve asked of the shard."""
        cols = batch.columns
        at = list(accumulate((cols[s][4] for s in batch.slot_of().tolist()), initial=0))
        buf = self._arena.take(at[-1])  # (each item's size at most)
        spans: list[tuple[int, int, int] | ItemResult] = [_UNREAD] * len(batch)

        def dest(i: int, n: int) -> np.ndarray:
            spans[i] = (0, at[i], n)
            return buf[at[i] : at[i] + n]

        ok = self._read_mapped(m, batch, dest)
        if ok.all():
            read = PackedRead([buf], spans)
            return Deferred(lambda _t: read)
        rest = np.flatnonzero(~ok).tolist()
        pending = self.link.submit("read_blocks", batch.take(rest))

        def finish(timeout_s: float) -> PackedRead:
            got = pending.result(timeout_s)
            buffers = [buf]
            for j, i in enumerate(rest):
                item = got[j]
                if isinstance(item, ItemResult):
                    spans[i] = item
                else:
                    spans[i] = (len(buffers), 0, len(item))
                    buffers.append(np.asarray(item))
            return PackedRead(buffers, spans)
        return Deferred(finish)

    # -- write ------------------------------------------------------------------------------

    def _write(self, m: Mapped, batch: HandleBatch, arrays: Sequence[Any],
               tags: Sequence[Any] | None = None, commits: Sequence[Any] | None = None,
               report: bool = True) -> Pending:
        sizes = [_as_bytes(a).size for a in arrays]
        # a claim nobody waits for is never made (it would keep its blocks from reuse for as
        # long as this process lives): made when the result is asked for, here or by the shard
        claimed: Pending = Deferred(lambda _t: self._claim_here(m, batch, sizes, tags, commits)) \
            if m.worker_claims else self._control_call("claim_blocks", batch, sizes,
                                                       self.writer, tags=tags, commits=commits)

        def finish(timeout_s: float) -> list[ItemResult]:
            claims: list[ItemResult] | None = claimed.result(timeout_s)
            if claims is None:  # the shard cannot take this process's copies: the link's way
                plain: list[ItemResult] = self.link.submit(
                    "write_blocks", batch, arrays=arrays, tags=tags, commits=commits,
                    report=report).result(timeout_s)
                return plain
            mine = [i for i, r in enumerate(claims) if r.ok]
            if not mine:
                return claims
            granted = batch if len(mine) == len(batch) else batch.take(mine)
            try:
                m.write(batch, arrays, mine)
            except NotShared:
                raise ShardUnavailable(self.shard_id, "the shard's segment went away during "
                                       "a write") from None
            except BaseException:
                with contextlib.suppress(Exception):
                    if m.worker_claims:
                        m.release(granted, self.writer)
                    else:
                        self._control_call("release_blocks", granted,
                                           self.writer).result(timeout_s)
                raise
            # (every byte is copied: only now may the finish be made)
            quiet = not report or (tags is None and commits is None)  # nothing to report
            if quiet and m.worker_claims:
                return self._finish_here(m, granted, mine, claims)
            control = self.control
            if quiet and control is not None:
                # the shard's answer is OK for every claim it granted: posted, not waited
                # for (see the module docstring)
                try:
                    control.post("finish_blocks", granted, self.writer, report=False)
                except ShardUnavailable:
                    self._lost_control(control)
                    raise
                return claims

            def sub(xs: Sequence[Any] | None) -> list[Any] | None:
                return None if xs is None else [xs[i] for i in mine]
            done = self._control_call("finish_blocks", granted, self.writer,
                                      tags=sub(tags), commits=sub(commits),
                                      report=report).result(timeout_s)
            for j, i in enumerate(mine):
                claims[i] = done[j]
            return claims
        return Deferred(finish)

    def _claim_here(self, m: Mapped, batch: HandleBatch, sizes: Sequence[int],
                    tags: Sequence[Any] | None, commits: Sequence[Any] | None
                    ) -> list[ItemResult] | None:
        try:
            return m.claim(batch, sizes, self.writer, tags, commits)
        except NotShared:
            raise ShardUnavailable(self.shard_id, "the shard's segment went away before a "
                                   "write") from None

    def _finish_here(self, m: Mapped, granted: HandleBatch, mine: list[int],
                     claims: list[ItemResult]) -> list[ItemResult]:
        """The finish of this process's own claims with nothing for the shard to report."""
        try:
            finished = m.finish(granted, self.writer)
        except NotShared:
            finished = []
        for j, res in enumerate(finished):
            claims[mine[j]] = res  # (STALE only if the claim was taken: never, while live)
        if not finished or not m.alive():  # the shard died meanwhile: nothing acknowledged
            raise ShardUnavailable(self.shard_id, "the shard's segment went away during a "
                                   "write")
        return claims


class _Arena:
    """The buffers ``read_blocks`` answers in, reused once the caller let go of every array
    cut from one (its only reference is then this list's): a fresh buffer costs a page fault
    per 4 KiB on its first pass, which weighs more than the copy itself. At most
    :data:`ARENA_BYTES` are kept."""

    def __init__(self) -> None:
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()  # two readers never take the same free buffer

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i in range(len(self._bufs)):
                if self._bufs[i].nbytes >= nbytes and sys.getrefcount(self._bufs[i]) == 2:
                    return self._bufs[i][:nbytes]  # no view of it is left anywhere
            buf = np.empty(nbytes, dtype=np.uint8)
            if sum(b.nbytes for b in self._bufs) + nbytes <= ARENA_BYTES:
                self._bufs.append(buf)
            return buf


def shared_links(links: dict[str, ShardLink]) -> dict[str, ShardLink]:
    """Each link wrapped in a :class:`SharedLink` (once)."""
    return {sid: link if isinstance(link, SharedLink) else SharedLink(link)
            for sid, link in links.items()}
