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

Damage: LMDB maps ``data.mdb`` and trusts it. Before mapping, the file is checked against its
meta pages (:mod:`storage.envcheck`: a truncated file would kill the process with SIGBUS),
every page reachable from them against LMDB's invariants (:mod:`storage.pagecheck`: the
free-page list and the node and overflow sizes that writes rely on, which no LMDB read checks),
and LMDB walks every B-tree and looks every key up in a child process (:mod:`storage.envprobe`:
a page of garbage can make LMDB read past the file's end or fail an assertion, which kills the
process that walks; a key out of order cannot be found, so not repaired). Only then is the
environment opened here, where the main database must list exactly the tier's sub-databases
(the walk runs here instead when no child could be started). A damaged environment is closed,
its files are moved to ``<dir>/set-aside/<UTC stamp>-damaged/`` beside a ``REASON`` file (only
the newest :data:`KEEP_SET_ASIDE` such folders are kept: each may be as large as the tier, and
a cache's damaged copy is worth less than the room it takes), a warning is logged, it is
counted in :attr:`DiskStore.set_aside`, and an empty environment replaces it. The same happens
when a transaction meets damage later (:data:`DAMAGE_ERRORS`): the store resets itself
(:meth:`DiskStore.reset`, at most once per environment) and raises
:class:`~storage.errors.StoreDamaged`, which the tier turns into a miss or a retry.

Errors: LMDB exceptions are translated in exactly one place, :func:`translate`.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lmdb

from hkv_service.core.errors import HkvError

from .envcheck import data_file_problem
from .envprobe import ChildWalk, walk_in_child
from .errors import DiskFull, StorageFailure, StoreDamaged
from .pagecheck import tree_problem

__all__ = ["DAMAGE_ERRORS", "DB_NAMES", "DiskStore", "SetAside", "StoreConfig", "translate"]

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1 << 20
DB_NAMES = ("records", "index", "lru", "quarantine", "meta")
ENV_FILES = ("data.mdb", "lock.mdb")
SET_ASIDE_DIR = "set-aside"
KEEP_SET_ASIDE = 1
_SET_ASIDE_NAME = re.compile(r"^\d{8}T\d{6}\.\d{9}Z-[a-z]+$")
_DB_NAME = re.compile(rb"^[a-z_]{1,32}$")  # ours, and those of older layouts ("headers")
# Messages LMDB gives when a commit cannot write its pages: ENOSPC, EFBIG, EDQUOT, and EIO
# (which is what a page flush past RLIMIT_FSIZE reports on Linux).
_DISK_FULL_HINTS = ("no space", "too large", "quota", "input/output error")
# What LMDB raises when the environment's own structure is damaged: a page of the wrong type
# or past the last page, a foreign or torn file, a tree deeper than possible, a value size no
# writer of ours makes, and the "must abort" that follows any of them inside a transaction.
DAMAGE_ERRORS: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
    lmdb.PanicError, lmdb.CursorFullError, lmdb.PageFullError, lmdb.IncompatibleError,
    lmdb.BadTxnError, lmdb.BadValsizeError,
)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    map_size_initial: int = 64 * MiB
    map_size_max: int = 4096 * MiB
    # Each concurrent read transaction holds one slot (py-lmdb opens with MDB_NOTLS, so slots
    # belong to transactions, not threads): room for many caller threads plus get_many's pool.
    max_readers: int = 256


@dataclass(frozen=True, slots=True)
class SetAside:
    """An environment moved out of the way: ``label`` "damaged" or "retired" (another
    record format), why, and the folder its files went to."""

    label: str
    reason: str
    where: Path


def _translated(exc: lmdb.Error, writing: bool, generation: int = 0) -> HkvError:
    text = str(exc)
    if isinstance(exc, DAMAGE_ERRORS):
        return StoreDamaged(f"the disk tier's LMDB environment is damaged ({text}); it was "
                            "moved aside and the tier started cold", text, generation)
    if writing and any(hint in text.lower() for hint in _DISK_FULL_HINTS):
        return DiskFull(
            f"disk write failed ({text}): the file system or the file-size limit is full; "
            "the write was rolled back, free space (delete entries) and retry"
        )
    return StorageFailure(f"LMDB failed: {text}")


@contextmanager
def translate(writing: bool, generation: int = 0) -> Iterator[None]:
    """Map LMDB errors to hkv errors. ``MapFullError`` passes through: the store handles it."""
    try:
        yield
    except lmdb.MapFullError:
        raise
    except lmdb.Error as exc:
        raise _translated(exc, writing, generation) from exc


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
    """Context manager for one read snapshot: gate, ``begin(buffers=True)``, abort, translate.

    The environment is taken once the gate is held: a reset may have replaced it meanwhile.
    """

    __slots__ = ("_generation", "_store", "_txn")

    def __init__(self, store: DiskStore) -> None:
        self._store = store

    def __enter__(self) -> lmdb.Transaction:
        store = self._store
        store._gate.enter_shared()
        self._generation = store.generation
        try:
            self._txn = store.env.begin(buffers=True)
        except lmdb.Error as exc:
            store._gate.exit_shared()
            raise store._read_failed(exc, self._generation) from exc
        return self._txn

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        try:
            self._txn.abort()
        finally:
            self._store._gate.exit_shared()
        if isinstance(exc, lmdb.Error):
            raise self._store._read_failed(exc, self._generation) from exc


class DiskStore:
    """One LMDB environment with the tier's sub-databases. Thread-safe; one process only.

    ``dbs`` is updated in place when a reset replaces the environment, so holders of the
    mapping (the tier's catalog) always see the current handles. ``on_create`` runs inside
    the transaction that creates each new environment (the first, and each after a reset),
    with its handles: the tier stamps its record format there.
    """

    def __init__(self, path: str | Path, config: StoreConfig,
                 on_create: Callable[[lmdb.Transaction, dict[str, Any]], None] | None = None
                 ) -> None:
        if config.map_size_initial > config.map_size_max:
            config = StoreConfig(config.map_size_max, config.map_size_max, config.max_readers)
        self.config = config
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._forks = _forks
        self._gate = _SharedExclusive()
        self._write_lock = threading.Lock()
        self._write_owner: int | None = None  # thread id inside write(), see _read_failed
        self.dbs: dict[str, Any] = {}
        self.generation = 0  # bumped by every reset
        self.set_aside: list[SetAside] = []
        self.open_walk: ChildWalk | None = None  # the child's walk before the first open
        self._on_create = on_create
        self._open_checked()

    # -- opening, validation, reset -----------------------------------------------------

    def _open_checked(self) -> None:
        """Open the environment, or an empty one in its place when it is damaged."""
        problem = self._damage_before_open()
        if problem is not None:
            self._move_aside(problem, "damaged")
        walked = problem is None and self.open_walk is not None and self.open_walk.clean
        try:
            self._open_env(walk=not walked)  # the child's walk was this walk, and more
        except StoreDamaged as exc:
            self._move_aside(exc.reason, "damaged")
            self._open_env()

    def _damage_before_open(self) -> str | None:
        """Why the environment on disk must not be opened in this process, or None: its data
        file against its meta pages, every page reachable from them against LMDB's
        invariants (:mod:`storage.pagecheck`), then LMDB's own walk of it in a child process
        (a crash there ends the child, see :mod:`storage.envprobe`)."""
        data = self.path / "data.mdb"
        try:
            problem = data_file_problem(data) or tree_problem(data)
        except OSError as exc:
            raise StorageFailure(f"cannot read the disk tier's data file: {exc}") from exc
        if problem is not None or not data.exists():
            return problem
        self.open_walk = walk_in_child(self.path)
        return _walk_damage(self.open_walk, self.path)

    def _open_env(self, walk: bool = True) -> None:
        """Open (creating when absent) the environment and its sub-databases and, with
        ``walk``, walk every B-tree once. Damage raises StoreDamaged, with the environment
        closed."""
        with translate(writing=False, generation=self.generation):
            env = lmdb.open(
                str(self.path), map_size=self.config.map_size_initial, max_dbs=len(DB_NAMES),
                max_readers=self.config.max_readers, sync=True, metasync=True, writemap=False,
                lock=True, subdir=True,
            )
        try:
            with translate(writing=False, generation=self.generation):
                self.stale_readers_cleared = env.reader_check()
                dbs = _open_dbs(env, self.generation, self._on_create)
                if walk:
                    _walk(env, dbs)
                self._map_size = int(env.info()["map_size"])
        except BaseException:
            env.close()
            raise
        self.env = env
        self.dbs.clear()
        self.dbs.update(dbs)

    def _move_aside(self, reason: str, label: str) -> None:
        """Move the environment's files (closed) to a fresh folder under set-aside/."""
        ns = time.time_ns()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9))
        where = self.path / SET_ASIDE_DIR / f"{stamp}.{ns % 10**9:09d}Z-{label}"
        try:
            where.mkdir(parents=True)
            for name in ENV_FILES:
                if (self.path / name).exists():
                    os.replace(self.path / name, where / name)
            (where / "REASON").write_text(reason + "\n")
        except OSError as exc:
            raise StorageFailure(
                f"the disk tier at {self.path} is unusable ({reason}) and could not be moved "
                f"aside ({exc}): move or delete its data.mdb and lock.mdb"
            ) from exc
        _prune(where.parent, KEEP_SET_ASIDE)
        self.set_aside.append(SetAside(label, reason, where))
        log.warning("disk tier at %s set aside as %s: %s; its files are in %s and the tier "
                    "starts cold", self.path, label, reason, where)

    def reset(self, reason: str, label: str, generation: int | None = None) -> bool:
        """Replace the environment by an empty one, moving its files aside as ``label``.

        With ``generation``, only while that environment is still the current one (another
        thread may have reset it already). True if this call reset it.
        """
        with self._write_lock:
            return self._reset_locked(reason, label, generation)

    def _reset_locked(self, reason: str, label: str, generation: int | None) -> bool:
        if self._inherited() or generation not in (None, self.generation):
            return False
        with self._gate.exclusive():  # no transaction is open while the files move
            self.env.close()
            self._move_aside(reason, label)
            self.generation += 1
            self._open_env()
        return True

    def _read_failed(self, exc: lmdb.Error, generation: int) -> HkvError:
        """The error a failed read raises. On damage the store resets first, unless this
        thread is inside a write (a read nested in it): that write resets on its way out."""
        err = _translated(exc, writing=False, generation=generation)
        if isinstance(err, StoreDamaged) and self._write_owner != threading.get_ident():
            self.reset(err.reason, "damaged", generation)
        return err

    # -- transactions -------------------------------------------------------------------

    @property
    def map_size(self) -> int:
        return self._map_size

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
        return _ReadTxn(self)

    def write(self, fn: Callable[[lmdb.Transaction], T], need_bytes: int = 0) -> T:
        """Run ``fn`` in one write transaction and commit; all or nothing.

        On a full map, grow it (by at least ``2 * need_bytes``) and retry once. ``fn`` may
        run twice, so it must not have side effects outside the transaction that it cannot
        repeat. Raises DiskFull when the map cannot grow or the file system refuses pages,
        StoreDamaged (after the reset) when the transaction met damage.
        """
        self._check_process()
        with self._write_lock:
            self._write_owner = threading.get_ident()
            try:
                return self._write_locked(fn, need_bytes)
            except StoreDamaged as exc:
                self._reset_locked(exc.reason, "damaged", exc.generation)
                raise
            finally:
                self._write_owner = None

    def _write_locked(self, fn: Callable[[lmdb.Transaction], T], need_bytes: int) -> T:
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
            with translate(writing=True, generation=self.generation), \
                    self.env.begin(write=True) as txn:
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
            self._map_size = new
        return True

    def close(self) -> None:
        if self._inherited():
            return  # never touch a parent's environment from a forked child
        with self._write_lock, self._gate.exclusive():
            self.env.close()


def _walk_damage(walk: ChildWalk, path: Path) -> str | None:
    """The damage a child's walk shows, or None. A child that died of a signal or ran out of
    time while walking, or met an LMDB error of :data:`DAMAGE_ERRORS`, shows damage; one
    that could not run at all (no process, no lmdb) shows nothing, and the open goes on in
    this process as it did before there was a child."""
    if walk.clean:
        return None
    error = getattr(lmdb, walk.error, None) if walk.error else None
    met_damage = isinstance(error, type) and issubclass(error, DAMAGE_ERRORS)
    if walk.started and (walk.signal is not None or walk.timed_out or walk.damage is not None
                         or met_damage):
        return walk.describe()
    log.warning("disk tier at %s: could not walk the environment in a child process (%s); "
                "walking it in this process", path, walk.describe())
    return None


def _open_dbs(env: lmdb.Environment, generation: int,
              on_create: Callable[[lmdb.Transaction, dict[str, Any]], None] | None
              ) -> dict[str, Any]:
    """The sub-database handles, created (and ``on_create`` run) in a new environment. One
    that has committed must list every one of DB_NAMES, and only names, in its main database
    (garbage there would otherwise make LMDB create empty sub-databases over the lost ones).
    """
    with env.begin(write=True, buffers=True) as txn:
        with txn.cursor() as cur:
            names = {bytes(k) if len(k) <= 64 else b"?" for k in cur.iternext(values=False)}
        fresh = env.info()["last_txnid"] == 0
        missing = set() if fresh else {n.encode() for n in DB_NAMES} - names
        if missing or not all(_DB_NAME.match(name) for name in names):
            shown = sorted(n.decode(errors="replace") for n in names)[:8]
            reason = f"the main database lists {shown}, not the tier's sub-databases"
            raise StoreDamaged(f"the disk tier's LMDB environment is damaged ({reason})",
                               reason, generation)
        dbs = {name: env.open_db(name.encode(), txn=txn, create=fresh) for name in DB_NAMES}
        if fresh and on_create is not None:
            on_create(txn, dbs)
        return dbs


def _walk(env: lmdb.Environment, dbs: dict[str, Any]) -> None:
    """Visit every entry of every sub-database without reading a value: LMDB checks each
    branch and leaf page it passes and each overflow page number (raises on damage)."""
    with env.begin(buffers=True) as txn:
        for db in dbs.values():
            with txn.cursor(db=db) as cur:
                collections.deque(cur.iternext(keys=True, values=True), maxlen=0)


def _prune(root: Path, keep: int) -> None:
    """Delete all but the ``keep`` newest set-aside folders (their names sort by time)."""
    ours = sorted(p for p in root.iterdir() if p.is_dir() and _SET_ASIDE_NAME.match(p.name))
    for old in ours[:-keep] if keep else ours:
        shutil.rmtree(old, ignore_errors=True)
