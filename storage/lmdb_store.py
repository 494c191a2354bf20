"""The LMDB adapter: one environment per owner, its sub-databases, map growth, error mapping.

Theory of operation. :class:`DiskStore` opens one LMDB environment under a directory, inside
the process that uses it (never at import, never inherited across ``fork``: a forked child
using the parent's environment corrupts reader slots, so every call checks the pid). The
tier's data lives in named sub-databases (:data:`DB_NAMES`). Every write is one function run
inside ``with env.begin(write=True)``: it commits as a whole or not at all.

Durability: the default sync mode (``sync=True``, ``metasync=True``, no ``writemap``) is kept
on purpose. It is the mode in which LMDB promises ACID commits and an intact database after a
crash or power loss: a commit returns only after the data pages and then the meta page are on
disk, and a crash at any instant leaves the previous meta page pointing at a complete
snapshot. ``writemap`` would let a stray write through the map (or a torn page write) damage
committed data; turning off sync would make "acknowledged" mean "maybe". The tier only reports
an object as on disk after :meth:`DiskStore.write` returns, so that acknowledgement is true.

Map growth: the map starts at ``map_size_initial``; a write that raises ``MapFullError``
(which aborts the whole transaction, leaving nothing half-committed) makes the store grow the
map (``set_mapsize`` may only run with no transaction open in this process, so all
transactions hold a shared gate and growth takes it exclusively) and retry once. Past
``map_size_max`` the write fails with :class:`~storage.errors.DiskFull`.

Errors: LMDB exceptions are translated in exactly one place, :func:`translate`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb

from hkv_service.core.errors import HkvError

from .errors import DiskFull, StorageFailure

__all__ = ["DB_NAMES", "DiskStore", "StoreConfig", "translate"]

T = TypeVar("T")
MiB = 1 << 20
DB_NAMES = ("records", "index", "lru", "quarantine", "meta")
# Messages LMDB gives when a commit cannot write its pages: ENOSPC, EFBIG, EDQUOT, and EIO
# (which is what a page flush past RLIMIT_FSIZE reports on Linux).
_DISK_FULL_HINTS = ("no space", "too large", "quota", "input/output error")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    map_size_initial: int = 64 * MiB
    map_size_max: int = 4096 * MiB
    # Each concurrent read transaction holds one slot (py-lmdb opens with MDB_NOTLS, so slots
    # belong to transactions, not threads): room for many caller threads plus get_many's pool.
    max_readers: int = 256


def _translated(exc: lmdb.Error, writing: bool) -> HkvError:
    text = str(exc)
    if writing and any(hint in text.lower() for hint in _DISK_FULL_HINTS):
        return DiskFull(
            f"disk write failed ({text}): the file system or the file-size limit is full; "
            "the write was rolled back, free space (delete entries) and retry"
        )
    return StorageFailure(f"LMDB failed: {text}")


@contextmanager
def translate(writing: bool) -> Iterator[None]:
    """Map LMDB errors to hkv errors. ``MapFullError`` passes through: the store handles it."""
    try:
        yield
    except lmdb.MapFullError:
        raise
    except lmdb.Error as exc:
        raise _translated(exc, writing) from exc


_forks = 0  # forks this process descends from; a store remembers the count it opened at


def _count_fork() -> None:
    global _forks
    _forks += 1


# Cheaper than comparing os.getpid() on every read (a syscall), and exact: multiprocessing's
# fork start method goes through os.fork too.
os.register_at_fork(after_in_child=_count_fork)


class _SharedExclusive:
    """Many holders of the shared side at once, or one exclusive holder. Not reentrant.

    The shared side is on every read, so its fast path is one plain-lock round trip each
    way (a ``Condition`` built on that same lock serves the rare waits).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False

    def enter_shared(self) -> None:
        with self._lock:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def exit_shared(self) -> None:
        with self._lock:
            self._shared -= 1
            if self._exclusive and self._shared == 0:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._lock:
            self._cond.wait_for(lambda: not self._exclusive)
            self._exclusive = True  # new shared holders wait from here on
            self._cond.wait_for(lambda: self._shared == 0)
        try:
            yield
        finally:
            with self._lock:
                self._exclusive = False
                self._cond.notify_all()


class _ReadTxn:
    """Context manager for one read snapshot: gate, ``begin(buffers=True)``, abort, translate."""

    __slots__ = ("_env", "_gate", "_txn")

    def __init__(self, env: lmdb.Environment, gate: _SharedExclusive) -> None:
        self._env, self._gate = env, gate

    def __enter__(self) -> lmdb.Transaction:
        self._gate.enter_shared()
        try:
            self._txn = self._env.begin(buffers=True)
        except lmdb.Error as exc:
            self._gate.exit_shared()
            raise _translated(exc, writing=False) from exc
        return self._txn

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            self._txn.abort()
        finally:
            self._gate.exit_shared()
        if isinstance(exc, lmdb.Error):
            raise _translated(exc, writing=False) from exc


class DiskStore:
    """One LMDB environment with the tier's sub-databases. Thread-safe; one process only."""

    def __init__(self, path: str | Path, config: StoreConfig) -> None:
        if config.map_size_initial > config.map_size_max:
            config = StoreConfig(config.map_size_max, config.map_size_max, config.max_readers)
        self.config = config
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._forks = _forks
        self._gate = _SharedExclusive()
        self._write_lock = threading.Lock()
        with translate(writing=False):
            self.env = lmdb.open(
                str(self.path), map_size=config.map_size_initial, max_dbs=len(DB_NAMES),
                max_readers=config.max_readers, sync=True, metasync=True, writemap=False,
                lock=True, subdir=True,
            )
            self.stale_readers_cleared = self.env.reader_check()
            with self.env.begin(write=True) as txn:
                self.dbs = {name: self.env.open_db(name.encode(), txn=txn) for name in DB_NAMES}

    @property
    def map_size(self) -> int:
        return int(self.env.info()["map_size"])

    def _inherited(self) -> bool:
        """Opened by a process this one was forked from: never to be used here."""
        return _forks != self._forks

    def _check_process(self) -> None:
        if self._inherited():
            raise StorageFailure(
                "this LMDB environment was opened in another process (inherited across fork); "
                "open a new DiskTier inside this process"
            )

    def read(self) -> _ReadTxn:
        """A read snapshot whose ``get`` returns zero-copy memoryviews valid inside the block."""
        self._check_process()
        return _ReadTxn(self.env, self._gate)

    def write(self, fn: Callable[[lmdb.Transaction], T], need_bytes: int = 0) -> T:
        """Run ``fn`` in one write transaction and commit; all or nothing.

        On a full map, grow it (by at least ``2 * need_bytes``) and retry once. ``fn`` may
        run twice, so it must not have side effects outside the transaction that it cannot
        repeat. Raises DiskFull when the map cannot grow or the file system refuses pages.
        """
        self._check_process()
        with self._write_lock:
            try:
                return self._attempt(fn)
            except lmdb.MapFullError:
                grown = self._grow(need_bytes)
            if grown:
                try:
                    return self._attempt(fn)
                except lmdb.MapFullError:
                    pass
            raise DiskFull(
                f"disk tier map is full at {self.map_size} bytes (limit {self.config.map_size_max})"
                f"; the write of ~{need_bytes} bytes was rolled back: delete entries or raise "
                "map_size_max"
            )

    def _attempt(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        self._gate.enter_shared()
        try:
            with translate(writing=True), self.env.begin(write=True) as txn:
                return fn(txn)
        finally:
            self._gate.exit_shared()

    def _grow(self, need_bytes: int) -> bool:
        current = self.map_size
        wanted = max(2 * current, current + 2 * need_bytes + MiB)
        new = min(self.config.map_size_max, -(-wanted // MiB) * MiB)
        if new <= current:
            return False
        with self._gate.exclusive(), translate(writing=False):
            self.env.set_mapsize(new)
        return True

    def close(self) -> None:
        if self._inherited():
            return  # never touch a parent's environment from a forked child
        with self._write_lock, self._gate.exclusive():
            self.env.close()
