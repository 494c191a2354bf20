"""Scale bench: the one metadata view filled to 10k, 100k, 1M and 4M objects (``--quick``: 10k
and 100k) as a real workload fills it, and what each size costs.

Each size runs in a fresh child process (spawned), so its RSS and heap are its own: a
``CacheState`` of the reference spec on a :class:`~.lockstats.TimedLock`, 8 owners (shards)
registered and heartbeating from a thread every 0.2 s, and a reaper thread doing what
``hkv serve``'s expire loop does (``expire_owners`` every 0.5 s, plus ``reap`` slices where the
view has it). The fill is what writers report, through the view's own methods (in process, no
RPC): per request one ``allocate`` of its new blocks, then its commit transitions as the data
plane reports them (one ``transition_many`` where the view has it: WRITE_DONE / TAIL_DONE, a
KV's at its content version, then the indexers' WRITE_DONE + INDEXER_SYNC at it). The workload:

* system-prompt roots (2 at 10k, one per 20k objects above, at most 200; 8-128 blocks each,
  Zipf-popular) under which prompts add 4-48 blocks, and follow-up turns (30%) that extend a
  recent prompt by 4-32 blocks (chains up to 1,024 blocks deep);
* one 2,032-block document under the hottest root, for the 2,048-block questions (at 10k it is
  ~80% of the objects: a 2,048-block lookup needs one);
* all five kinds: COMPRESSED (c4, c128), SWA, INDEXER, TAIL, and DISK copies kept near 9% of
  the objects: a prompt's objects offloaded (``begin_offload`` + OFFLOAD_COMMITTED on the shard
  that holds them), half of those prompts then evicted from memory (disk-only).

Per size, in order:

* ``bytes_per_object``: RSS growth over the fill (after a full collection) less the bench's
  own books, per object; ``rss_mib`` the child's whole RSS;
* ``index_resize_ms``: the longest step one insert into the index can take, the one that
  resizes the fullest of its 256 parts (``index_largest_part`` entries; timed on a copy grown
  by fresh keys until it resizes), beside ``flat_index_resize_ms``, the same for one dict of
  every entry (what the index was until 2026-12-03: 47 ms at 700k entries on this host);
* the child runs the service's GC policy (``server/gcpolicy.py``: automatic collection off, a
  collection of what is new every 0.25 s, its survivors frozen), as ``hkv serve`` does:
  ``service_gc_longest_ms`` its longest collection (``..._cpu_ms`` its thread's CPU time in
  it: far under the pause, the thread waited, for the host or the GIL). The baseline beside
  it, ``full_gc_ms``: one full ``gc.collect()`` over the whole filled heap, frozen part
  included (what CPython's automatic gen-2 collection costs at this size);
  ``fill_gc_max_pause_ms``: the longest collection during the fill (``gc.callbacks``);
* a live window: a lookup thread (flat out, alternating a 1-block lookup of a random root and
  a new 2,048-block question over the document: 2,032 cached blocks and 16 never cached, a
  request never seen before) while a mutation thread writes 20 requests/s of 16 new blocks
  (64 objects), offloads some and evicts the oldest prompts to hold the size, and, half way,
  runs one full collection if automatic collection is on (a lookup sees it as it would see
  an automatic one). ``lookup1_*`` / ``lookup2048_*``: p50/p99/max latency in ms;
  ``longest_pause_ms``: the longest time the lookup thread made no progress (the gap between
  two lookups' ends, or a collection, whichever is longer); ``heartbeat_max_ms`` (the longest
  heartbeat call) and ``heartbeat_max_gap_ms`` (the longest time between two heartbeats of one
  owner: starved heartbeats are how a healthy owner gets expired). A healthy owner found
  expired registers again, as a shard rejoins, and is counted (``fill_owners_rejoined``,
  ``healthy_owners_expired``);
* ``write_objects_per_s``: the write path as the service sees it (``allocate`` + the commit
  calls, per request of 16 new blocks, nothing else running), and ``state_calls_per_request``;
* owner loss, with lookups and mutations running: one owner goes silent past the heartbeat
  deadline (its last heartbeat backdated: no 10 s wait) and the reaper expires it, one is marked
  lost as the data plane does (``mark_owner_lost``), one re-registers as a restarted shard
  does. ``owner_loss_hold_ms`` is the longest of the three lock holds (timed by the lock);
  ``owner_loss_max_hold_ms`` the longest hold of anyone (reap slices too) in the phase,
  ``owner_loss_max_hold_thread`` who held it, ``..._cpu_ms`` that thread's CPU time in it (of
  it ``..._sys_ms`` in the kernel) and ``..._minor_faults`` the page faults it took (work, a
  wait, or memory being mapped in), ``owner_loss_reap_s`` how long the reaper's
  slices ran until a ``reap`` call begun after the losses found nothing left,
  ``owner_loss_gc_max_pause_ms`` the longest collection in the phase (of ``..._collections``),
  ``healthy_owners_expired`` heartbeating owners expired meanwhile (the cascade);
* re-confirm after a restart, in a fresh child process as a restarted service is (running
  the service's GC policy): a new view, owner ``shard-0`` registered with its pools, then what
  it held at the end of the fill (memory objects and its disk records) in random order,
  ``confirm`` in batches of 256 as ``workers/shard.py`` sends them, for at most a time budget:
  ``reconfirm_reports_per_s`` (and whether it finished). A confirm leaves each entry's summary
  to the first walk that reaches it (``contracts.defer``), and the orphans of an entry made
  with more than a slice waiting to the reaper (``ADOPT_SLICE``); the bench then pays them
  all at once (``CacheState.settle_pending`` and ``reap``: ``reconfirm_pending_entries``,
  ``reconfirm_settle_ms``), and ``reconfirm_with_summaries_reports_per_s`` counts that time
  too: the target is judged on it. Outside ``--quick`` the restart runs 3 times, each in a
  fresh process, and the median run's figures are given, with ``..._min`` and ``..._max`` of
  that rate beside them (``reconfirm_restarts``): on this host one run's rate moves 30-40%
  with the host's speed.
  The same reports confirmed in the size's own child first, after its view and the
  phases above were let go (``reconfirm_in_place_*``), show what a heap that held and churned
  a view of this size costs the same work (a restart does not pay it: that was how this
  figure was measured until 2026-12-02).

Once per run (a child too): the data plane itself (``DataPlane.write_prefix`` on an
``InProcessSystem``: 2 real shards, their pools and LMDB tiers), a 16-block request at a time:
``write_rpcs_per_request`` (calls on the metadata port, counted on a proxy, heartbeats aside)
and ``dataplane_write_objects_per_s``.

``HKV_BENCH_SCALE_SIZES`` (e.g. ``10k,100k,1m``) runs other sizes than the mode's. ``ratios``
hold every per-size figure over the smallest size's in the same run; the issue's
targets sit in ``figures`` as data (``target_*``) with a boolean per target (``*_met``); none
is asserted. The machine is shared and noisy (2 cores): compare within a run.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import random
import sys
import tempfile
import threading
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import xxhash

from ..core.api import (
    AllocRequest,
    Handle,
    LookupRequest,
    ObjectReport,
    Params,
    PoolConfig,
    StateConfig,
)
from ..core.contracts import CONTRACTS
from ..core.errors import HkvError
from ..core.hashing import content_version
from ..core.ids import BlockHash, ObjectId, PackedHashes, ShardId
from ..core.layout import Layout
from ..core.state_view import CacheState
from ..core.states import Event, Kind, State
from ..server import gcpolicy
from ..server.serve import REAP_YIELD_S
from ..specs import default_spec
from ..testing import pools_for, question
from .lockstats import TimedLock
from .timing import percentile

__all__ = ["SizeRun", "measure_size", "run"]

FULL_SIZES = (10_000, 100_000, 1_000_000, 4_000_000)
QUICK_SIZES = (10_000, 100_000)
DOC_BLOCKS = 2032  # the cached document a 2,048-block question asks over
QUESTION_BLOCKS = 16  # the question's blocks past it, never cached
REQUEST_BLOCKS = 16  # new blocks per request of the mutation load and the write figures
DOC_CHUNK = 128  # the document is written a request per this many blocks
DISK_FRACTION = 0.09
RECONFIRM_OWNER = ShardId("shard-0")
CONFIRM_BATCH = 256  # what workers/shard.py sends per confirm
MAX_DEPTH = 1024
HEARTBEAT_EVERY_S = 0.2
REAP_EVERY_S = 0.5
PROGRESS_EVERY_S = 5.0
SIZES_ENV = "HKV_BENCH_SCALE_SIZES"  # e.g. "10k,100k,1m": a run of other sizes
REAP_WAIT_S = 120.0  # the most the owner-loss phase waits for reaping to finish

_READY = {k: c.ready_state for k, c in CONTRACTS.items()}
_DEAD_ROW = -2  # a book row whose object left (evicted after its offload)
_MAX_ITEMS = 1024  # items per transition_many call (the view refuses more than 4,096)


@dataclass(frozen=True, slots=True)
class SizeRun:
    """One size's run (picklable: it crosses into the child)."""

    objects: int
    owners: int = 8
    doc_blocks: int = DOC_BLOCKS
    window_s: float = 8.0
    write_requests: int = 200
    reconfirm_budget_s: float = 30.0
    mutation_requests_per_s: float = 20.0
    heartbeat_timeout_s: float = 10.0
    seed: int = 0
    service_gc: bool = True  # the service's GC policy (server/gcpolicy.py), as hkv serve runs
    restarts: int = 3  # re-confirms after a restart, each in its own fresh process


def label(n: int) -> str:
    """10_000 -> "10k", 1_000_000 -> "1m" (figure names)."""
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1_000_000:g}m".replace(".", "_")
    if n >= 1000 and n % 100 == 0:
        return f"{n / 1000:g}k".replace(".", "_")
    return str(n)


def _say(msg: str) -> None:
    sys.stderr.write(f"hkv bench scale: {msg}\n")
    sys.stderr.flush()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource  # peak, not current: only where /proc is missing

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _chain(parent: bytes | None, tag: bytes, n: int) -> list[BlockHash]:
    """``n`` chained 16-byte block hashes continuing after ``parent`` (the view checks only that
    hashes are 16 bytes and chained consistently, not how they were made from tokens)."""
    out: list[BlockHash] = []
    prev = parent or b""
    digest = xxhash.xxh3_128_digest
    for i in range(n):
        prev = digest(prev + tag + i.to_bytes(4, "little"))
        out.append(BlockHash(prev))
    return out


class _Clock:
    """The view's clock: monotonic, but a thread may read it backdated (``backdated``): a
    heartbeat sent that way makes its owner look silent since then, so a silence past the
    deadline takes no waiting, and every other owner's heartbeats and deadline are untouched."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return time.monotonic() - getattr(self._local, "back", 0.0)

    @contextmanager
    def backdated(self, seconds: float) -> Iterator[None]:
        self._local.back = seconds
        try:
            yield
        finally:
            self._local.back = 0.0


class _GcTimer:
    """Every collection's generation, start and duration, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.pauses.append((int(info.get("generation", -1)), self._start, now - self._start))

    def since(self, t0: float) -> list[tuple[int, float, float]]:
        return [p for p in self.pauses if p[1] >= t0]


def _resize_insert_s(table: dict[Any, Any]) -> float:
    """How long the insert that resizes ``table`` takes (fresh keys until its size moves;
    ``table`` is a copy: it is changed)."""
    size, i = sys.getsizeof(table), 0
    while True:
        key = b"resize %d" % i
        i += 1
        t0 = time.perf_counter()
        table[key] = None
        took = time.perf_counter() - t0
        if sys.getsizeof(table) != size:
            return took


@dataclass(slots=True)
class _LookupLog:
    one: list[float] = field(default_factory=list)
    long: list[float] = field(default_factory=list)
    stall_max: float = 0.0
    long_blocks: int = 0  # blocks the last 2,048-block question matched
    errors: int = 0


@dataclass(slots=True)
class _MutationLog:
    requests: int = 0
    objects: int = 0
    evicted_prompts: int = 0
    errors: int = 0
    gc_injected: bool = False
    elapsed_s: float = 0.0


_Item = tuple[ObjectId, tuple[Event, ...], tuple["Params | None", ...]]


class _Writer:
    """A request's write as the data plane reports it: one allocate, then every commit in one
    ``transition_many`` call where the view has it (KVs at their content version first, then
    the indexers synced to it), else one ``transition`` call per event."""

    def __init__(self, state: CacheState) -> None:
        self.state = state
        lay = self.layout = state.layout
        self.names = [c.name for c in lay.columns]
        self.kinds = [c.kind for c in lay.columns]
        self.kv_of = [c.indexes for c in lay.columns]
        self.batched: Callable[[Sequence[Any]], list[Any]] | None = getattr(
            state, "transition_many", None)
        self.calls = 0  # calls into the view (what would be RPCs through the port)

    def write(self, hashes: Sequence[BlockHash], start: int
              ) -> list[tuple[int, int, Handle, int]]:
        """Write depths ``[start, len(hashes))``; returns the new objects as
        ``(depth, column, handle, version)`` (version: a KV's, and an indexer's KV's)."""
        lay, kinds = self.layout, self.kinds
        slots = [(d, c) for d in range(start, len(hashes)) for c in lay.attached[d % lay.period]]
        allocs = self.state.allocate(hashes, [AllocRequest(d, self.names[c]) for d, c in slots])
        self.calls += 1
        order: list[int] = []
        items: list[_Item] = []
        kv_version: dict[tuple[int, int], int] = {}
        for i, ((d, c), a) in enumerate(zip(slots, allocs, strict=True)):
            if a.existing or kinds[c] is Kind.INDEXER:
                continue
            order.append(i)
            if kinds[c] is Kind.TAIL:
                items.append((a.handle.object_id, (Event.TAIL_DONE,),
                              (Params(tail_len=lay.tail_tokens(c, d)),)))
            elif kinds[c] is Kind.COMPRESSED:  # what the data plane derives from the bytes
                v = kv_version[(d, c)] = content_version(hashes[d] + c.to_bytes(2, "little"))
                items.append((a.handle.object_id, (Event.WRITE_DONE,), (Params(version=v),)))
            else:
                items.append((a.handle.object_id, (Event.WRITE_DONE,), ()))
        for i, ((d, c), a) in enumerate(zip(slots, allocs, strict=True)):
            if a.existing or kinds[c] is not Kind.INDEXER:
                continue
            kv = self.kv_of[c]
            version = kv_version.get((d, kv)) if kv is not None else None
            if not version:
                continue  # its KV was there already, unsynced: left as the data plane leaves it
            order.append(i)
            items.append((a.handle.object_id, (Event.WRITE_DONE, Event.INDEXER_SYNC),
                          (None, Params(version=version))))
        versions = [a.version for a in allocs]
        for i, ver in zip(order, self._commit(items), strict=True):
            versions[i] = ver
        return [(slots[i][0], slots[i][1], allocs[i].handle, versions[i])
                for i in range(len(slots)) if not allocs[i].existing]

    def _commit(self, items: Sequence[_Item]) -> list[int]:
        """Apply each object's events in order; each object's version after them."""
        out: list[int] = []
        if self.batched is not None:
            for at in range(0, len(items), _MAX_ITEMS):
                chunk = items[at : at + _MAX_ITEMS]
                self.calls += 1
                out += [_version_of(r) for r in self.batched(
                    [(oid, events, params, None) for oid, events, params in chunk])]
            return out
        for oid, events, params in items:
            version = 0
            for k, event in enumerate(events):
                version = self.state.transition(
                    oid, event, params[k] if k < len(params) else None).version
                self.calls += 1
            out.append(version)
        return out


def _version_of(result: Any) -> int:
    if isinstance(result, BaseException):
        raise result
    return int(result.version)


class _Books:
    """What the bench remembers of its fill, compactly (arrays, packed hashes): each prompt's
    own hashes, the objects to evict per prompt, and the re-confirm owner's objects."""

    def __init__(self) -> None:
        # prompt id -> (first depth, its own hashes packed, the hash before them or None)
        self.prompts: list[tuple[int, bytes, bytes | None]] = []
        # re-confirm owner's objects: prompt, depth, column, block, generation, version, disk
        self.rows = tuple(array("q") for _ in range(7))
        # per prompt, oldest first: its object ids, and how many of them are disk copies
        self.evictable: deque[tuple[array[int], int]] = deque()

    def add_prompt(self, hashes: Sequence[BlockHash], start: int) -> int:
        self.prompts.append((start, b"".join(hashes[start:]), hashes[start - 1] if start else None))
        return len(self.prompts) - 1

    def add_row(self, *values: int) -> int:
        for col, v in zip(self.rows, values, strict=True):
            col.append(v)
        return len(self.rows[0]) - 1

    def nbytes(self) -> int:
        arrays = [*self.rows, *(oids for oids, _ in self.evictable)]
        return (sum(sys.getsizeof(a) for a in arrays) + sys.getsizeof(self.prompts)
                + sum(sys.getsizeof(p) + len(p[1]) + 33 for p in self.prompts))

    def hash_at(self, pid: int, depth: int) -> BlockHash | None:
        start, own, parent = self.prompts[pid]
        k = depth - start
        if k < 0:
            return BlockHash(parent) if parent is not None and k == -1 else None
        return BlockHash(own[16 * k : 16 * k + 16])


class _Scale:
    def __init__(self, run: SizeRun) -> None:
        self.run = run
        self.rng = random.Random(run.seed)
        self.spec = default_spec()
        self.layout = Layout(self.spec)
        self.clock = _Clock()
        self.lock = TimedLock(thread_cpu=True)  # (a hold's CPU beside it: work or a switch)
        self.config = state_config(run)
        self.state = CacheState(self.spec, self.config, clock=self.clock, lock=self.lock)
        self.writer = _Writer(self.state)
        self.books = _Books()
        self.owners = [ShardId(f"shard-{i}") for i in range(run.owners)]
        self.pools = self._pools()
        self.incarnations = {o: self.state.register_owner(o, self.pools) for o in self.owners}
        self.silent: set[ShardId] = set()
        self.victims: set[ShardId] = set()  # owners lost on purpose (never rejoin)
        # (owners, the call's lock hold, that hold's thread CPU time)
        self.expired: list[tuple[list[ShardId], float, float]] = []
        self.rejoined: list[ShardId] = []  # healthy owners found expired, registered again
        self._owners_lock = threading.Lock()  # incarnations: the heartbeat thread and the main
        self.heartbeat_max = 0.0  # longest heartbeat call
        self.heartbeat_gap = 0.0  # longest time between two heartbeats of one owner
        self._last_beat: dict[ShardId, float] = {}
        self.has_reap = callable(getattr(self.state, "reap", None))
        self.reap_calls = 0  # reap() calls begun
        self.reap_idle: tuple[int, float] = (0, 0.0)  # the last call that found nothing left
        self.disk_live = 0
        self.rows_at_fill = 0
        self.recent: deque[list[BlockHash]] = deque(maxlen=256)
        self.roots: list[list[BlockHash]] = []
        self.doc: list[BlockHash] = []
        self.cum: list[float] = []
        self.gc = _GcTimer()
        self._stop_background = threading.Event()
        self._background = [threading.Thread(target=fn, daemon=True, name=name) for fn, name in
                            ((self._heartbeats, "scale-heartbeat"), (self._reaper, "scale-reap"))]

    # -- setup ----------------------------------------------------------------------------

    def _pools(self) -> dict[str, PoolConfig]:
        """Each owner's pools: its share of the memory objects a fill of this size makes per
        column (from the layout), 1% over, plus a little."""
        lay, n = self.layout, self.run.objects
        per_block = Counter(c for d in range(lay.period) for c in lay.attached[d])
        total = sum(per_block.values())
        base = pools_for(lay, 1)
        return {lay.columns[c].name: replace(base[lay.columns[c].name], num_blocks=int(
            n * per_block[c] / total / self.run.owners * 1.01) + 128) for c in per_block}

    def start(self) -> None:
        gc.callbacks.append(self.gc)
        for t in self._background:
            t.start()

    def close(self) -> None:
        self._stop_background.set()
        for t in self._background:
            t.join(30)
        if self.gc in gc.callbacks:
            gc.callbacks.remove(self.gc)

    def _heartbeats(self) -> None:
        """Every owner heartbeats every 0.2 s; a healthy one found expired registers again,
        as a shard rejoins (it is counted: the cascade)."""
        while not self._stop_background.wait(HEARTBEAT_EVERY_S):
            for owner, inc in list(self.incarnations.items()):
                if owner in self.silent or owner in self.victims:
                    continue
                t0 = time.perf_counter()
                try:
                    self.state.heartbeat(owner, inc)
                except HkvError:
                    self._rejoin(owner, inc)
                    continue
                now = time.perf_counter()
                self.heartbeat_max = max(self.heartbeat_max, now - t0)
                self.heartbeat_gap = max(self.heartbeat_gap, now - self._last_beat.get(owner, now))
                self._last_beat[owner] = now

    def _rejoin(self, owner: ShardId, inc: int) -> None:
        with self._owners_lock:
            if self.incarnations.get(owner) != inc or owner in self.victims:
                return  # re-registered meanwhile, or lost on purpose
            self.rejoined.append(owner)
            _say(f"[{label(self.run.objects)}] healthy owner {owner} was expired; it registers "
                 "again")
            self.incarnations[owner] = self.state.register_owner(owner, self.pools)

    def _reset_heartbeat_figures(self) -> None:
        self.heartbeat_max = self.heartbeat_gap = 0.0
        now = time.perf_counter()
        self._last_beat = dict.fromkeys(self.incarnations, now)

    def _reaper(self) -> None:
        """What the service's expire loop does: expire silent owners; reap in slices."""
        reap: Callable[[], bool] | None = getattr(self.state, "reap", None)
        while not self._stop_background.wait(REAP_EVERY_S):
            dead = self.state.expire_owners()
            if dead:
                self.expired.append((dead, self.lock.last_held_s(),
                                     self.lock.last_held_cpu_s()))
            while reap is not None:
                self.reap_calls += 1
                call = self.reap_calls
                if not reap():
                    self.reap_idle = (call, time.perf_counter())
                    break
                time.sleep(REAP_YIELD_S)  # as hkv serve's reaper: others take the lock

    # -- the workload ---------------------------------------------------------------------

    def _roots(self) -> None:
        n = self.run.objects
        count = 2 if n < 20_000 else min(200, n // 20_000)
        lengths = (8, 16, 32, 64, 128)
        for r in range(count):
            length = 32 if r == 0 else self.rng.choice(lengths)
            self.roots.append(_chain(None, b"root %d" % r, length))
        weights = [1.0 / (r + 1) for r in range(count)]
        self.cum = list(np.cumsum(weights))

    def _new_prompt(self, tag: bytes, blocks: int | None = None
                    ) -> tuple[list[BlockHash], int]:
        """A new request's hashes and the depth its new blocks start at: a follow-up turn of a
        recent prompt (30%), else a new prompt under a Zipf-popular root."""
        rng = self.rng
        if self.recent and rng.random() < 0.3:
            base = rng.choice(self.recent)
            n = blocks or rng.randint(4, 32)
            if len(base) + n <= MAX_DEPTH:
                return base + _chain(base[-1], tag, n), len(base)
        root = self.roots[rng.choices(range(len(self.roots)), cum_weights=self.cum)[0]]
        n = blocks or rng.randint(4, 48)
        return root + _chain(root[-1], tag, n), len(root)

    def _write(self, hashes: list[BlockHash], start: int, offload: bool = True,
               evictable: bool = True) -> int:
        """Write a prompt, remember it; offload it (and maybe drop its memory copies) while
        disk copies are under their share. Returns the objects it added."""
        pid = self.books.add_prompt(hashes, start)
        new = self.writer.write(hashes, start)
        oids = array("q", (int(h.object_id) for _, _, h, _ in new))
        rows = [self.books.add_row(pid, d, c, h.block, h.generation, v, 0)
                if h.shard == RECONFIRM_OWNER else -1 for d, c, h, v in new]
        added, disk = len(new), 0
        if offload and new and self.disk_live < DISK_FRACTION * self.state.object_count():
            disk = len(oids)
            added += self._offload(pid, new, rows, oids)
            disk = len(oids) - disk
        if evictable:
            self.books.evictable.append((oids, disk))
            if len(hashes) < MAX_DEPTH:
                self.recent.append(hashes)
        return added

    def _offload(self, pid: int, new: list[tuple[int, int, Handle, int]], rows: list[int],
                 oids: array[int]) -> int:
        st, added = self.state, 0
        for d, c, h, v in new:
            try:
                dh = st.begin_offload(h.object_id, h.shard)
                st.transition(dh.object_id, Event.OFFLOAD_COMMITTED)
            except HkvError:
                continue  # gone meanwhile (evicted as a partner, its owner lost)
            oids.append(int(dh.object_id))
            self.disk_live += 1
            added += 1
            if h.shard == RECONFIRM_OWNER:
                self.books.add_row(pid, d, c, -1, 0, v, 1)
        if self.rng.random() < 0.5:  # spilled: only the disk copies stay
            for (_, _, h, _), row in zip(new, rows, strict=True):
                with suppress(HkvError):  # gone with its partner (a KV and its indexer)
                    st.evict(h.object_id)
                if row >= 0:
                    self.books.rows[3][row] = _DEAD_ROW
                added -= 1
        return added

    def _evict_oldest(self) -> None:
        oids, disk = self.books.evictable.popleft()
        self.disk_live -= disk
        for oid in oids:
            with suppress(HkvError):  # gone already: with a partner, or with its owner
                self.state.evict(ObjectId(oid))

    # -- phases ---------------------------------------------------------------------------

    def fill(self) -> dict[str, float]:
        target, name = self.run.objects, label(self.run.objects)
        gc.collect()
        rss0 = _rss_bytes()
        t0 = last = time.perf_counter()
        self._roots()
        for root in self.roots:
            self._write(root, 0, offload=False, evictable=False)
        root0 = self.roots[0]
        doc_blocks = max(self.run.doc_blocks, len(root0) + 1)
        self.doc = root0 + _chain(root0[-1], b"document", doc_blocks - len(root0))
        for end in range(len(root0) + DOC_CHUNK, doc_blocks + DOC_CHUNK, DOC_CHUNK):
            chunk = self.doc[: min(end, doc_blocks)]  # a chunked prefill, a request per chunk
            self._write(chunk, end - DOC_CHUNK, offload=False, evictable=False)
        i = errors = 0
        while (count := self.state.object_count()) < target:
            hashes, start = self._new_prompt(b"fill %d" % i)
            i += 1
            try:
                self._write(hashes, start)
            except HkvError as exc:  # e.g. its owner expired under it (heartbeats starved)
                errors += 1
                if errors <= 3:
                    _say(f"[{name}] a fill request failed: {exc}")
            time.sleep(0)  # requests arrive over RPC: others get the GIL between them
            now = time.perf_counter()
            if now - last > PROGRESS_EVERY_S:
                last = now
                _say(f"[{name}] fill {count:,} / {target:,} objects "
                     f"({count / (now - t0):,.0f}/s, {now - t0:.0f} s)")
        fill_s = time.perf_counter() - t0
        self.rows_at_fill = len(self.books.rows[0])  # what re-confirm reports
        fill_pauses = self.gc.since(t0)
        with gcpolicy.paused():  # (else the policy may freeze it all again in between)
            frozen = gc.get_freeze_count()
            gc.unfreeze()  # the service's policy froze the heap: walk all of it, this once
            gc.collect()  # the fill's garbage
            t = time.perf_counter()
            gc.collect()  # the filled heap: what an automatic full collection walks
            full_gc = time.perf_counter() - t
            if frozen:
                gc.freeze()
        rss = _rss_bytes()
        objects = self.state.object_count()
        gauges = self.state.stats()["gauges"]
        assert isinstance(gauges, dict)
        book = self.books.nbytes()
        _say(f"[{name}] filled {objects:,} objects in {fill_s:.1f} s; RSS {rss / 2**20:,.0f} "
             f"MiB; full collection {full_gc * 1e3:,.0f} ms")
        return {
            "objects": float(objects),
            "entries": float(gauges["entries"]),
            "disk_fraction": self.disk_live / objects,
            "prompts": float(len(self.books.prompts)),
            "fill_s": fill_s,
            "fill_objects_per_s": objects / fill_s,
            "rss_mib": rss / 2**20,
            "bytes_per_object": (rss - rss0 - book) / objects,
            "bench_books_mib": book / 2**20,
            "full_gc_ms": full_gc * 1e3,
            "fill_gc_max_pause_ms": max((p[2] for p in fill_pauses), default=0.0) * 1e3,
            "fill_gc_collections": float(len(fill_pauses)),
            "fill_errors": float(errors),
            "fill_heartbeat_max_gap_ms": self.heartbeat_gap * 1e3,
            "fill_owners_rejoined": float(len(self.rejoined)),
            **self.index_resize(),
        }

    def index_resize(self) -> dict[str, float]:
        """The longest step an insert into the index can take: the one that resizes its
        fullest part (a copy of it, grown by fresh keys until it resizes), beside the same for
        one flat dict of every entry (the baseline: what the index was)."""
        with gcpolicy.paused():  # (a collection meanwhile would walk these copies: 27 ms
            return self._index_resize()  # at 1M objects; the service makes no such dict)

    def _index_resize(self) -> dict[str, float]:
        parts = self.state.index.parts
        largest = max(parts, key=len)
        flat = {h: e for part in parts for h, e in part.items()}
        return {"index_largest_part": float(len(largest)),
                "index_resize_ms": _resize_insert_s(dict(largest)) * 1e3,
                "flat_index_resize_ms": _resize_insert_s(flat) * 1e3}

    @contextmanager
    def _live(self, inject_gc_after_s: float | None = None
              ) -> Iterator[tuple[_LookupLog, _MutationLog]]:
        """Lookups and mutations running until the block ends."""
        stop = threading.Event()
        looks, muts = _LookupLog(), _MutationLog()
        threads = [threading.Thread(target=self._lookups, args=(stop, looks), daemon=True,
                                    name="scale-lookups"),
                   threading.Thread(target=self._mutations, args=(stop, muts, inject_gc_after_s),
                                    daemon=True, name="scale-mutations")]
        for t in threads:
            t.start()
        try:
            yield looks, muts
        finally:
            stop.set()
            for t in threads:
                t.join(120)

    def _lookups(self, stop: threading.Event, log: _LookupLog) -> None:
        rng = random.Random(self.run.seed + 1)
        doc = self.doc[: self.run.doc_blocks]
        i = 0
        last = time.perf_counter()
        while not stop.is_set():
            one = LookupRequest(rng.choice(self.roots)[:1])
            long = LookupRequest(PackedHashes.of(question(doc, i, QUESTION_BLOCKS)))
            i += 1
            for req, out in ((one, log.one), (long, log.long)):
                t0 = time.perf_counter()
                try:
                    match = self.state.lookup(req)
                except HkvError:
                    log.errors += 1
                    continue
                t1 = time.perf_counter()
                out.append(t1 - t0)
                log.stall_max = max(log.stall_max, t1 - last)
                last = t1
                if req is long:
                    log.long_blocks = match.matched_tokens // self.layout.hash_block

    def _mutations(self, stop: threading.Event, log: _MutationLog,
                   inject_gc_after_s: float | None) -> None:
        period = 1.0 / self.run.mutation_requests_per_s
        t0 = time.perf_counter()
        next_at = t0
        i = 0
        while not stop.wait(max(0.0, next_at - time.perf_counter())):
            next_at += period
            if (inject_gc_after_s is not None and not log.gc_injected and gc.isenabled()
                    and time.perf_counter() - t0 >= inject_gc_after_s):
                gc.collect()  # what an automatic full collection does to the lookups
                log.gc_injected = True
            try:
                hashes, start = self._new_prompt(b"mutation %d %d" % (self.run.seed, i),
                                                 REQUEST_BLOCKS)
                i += 1
                log.objects += self._write(hashes, start)
                log.requests += 1
                while (self.books.evictable
                       and self.state.object_count() > self.run.objects):
                    self._evict_oldest()
                    log.evicted_prompts += 1
            except HkvError:
                log.errors += 1
        log.elapsed_s = time.perf_counter() - t0

    def live_window(self) -> dict[str, float]:
        _say(f"[{label(self.run.objects)}] lookups under mutations for {self.run.window_s:g} s")
        t0 = time.perf_counter()
        self._reset_heartbeat_figures()
        with self._live(inject_gc_after_s=self.run.window_s / 2) as (looks, muts):
            time.sleep(self.run.window_s)
        pauses = self.gc.since(t0)
        gc_max = max((p[2] for p in pauses), default=0.0)
        out = {
            **_latencies("lookup1", looks.one),
            **_latencies("lookup2048", looks.long),
            "lookup1_per_s": len(looks.one) / self.run.window_s,
            "lookup2048_per_s": len(looks.long) / self.run.window_s,
            "lookup2048_matched_blocks": float(looks.long_blocks),
            "lookup_errors": float(looks.errors),
            "live_gc_max_pause_ms": gc_max * 1e3,
            "live_gc_collections": float(len(pauses)),
            "gc_full_injected": 1.0 if muts.gc_injected else 0.0,
            "longest_pause_ms": max(looks.stall_max, gc_max) * 1e3,
            "heartbeat_max_ms": self.heartbeat_max * 1e3,
            "heartbeat_max_gap_ms": self.heartbeat_gap * 1e3,
            "mutation_objects_per_s": muts.objects / max(muts.elapsed_s, 1e-9),
            "mutation_requests": float(muts.requests),
            "mutation_errors": float(muts.errors),
        }
        return out

    def write_rate(self) -> dict[str, float]:
        n = self.run.write_requests
        requests = [self._new_prompt(b"write %d" % i, REQUEST_BLOCKS) for i in range(n)]
        calls0 = self.writer.calls
        objects = 0
        t0 = time.perf_counter()
        for hashes, start in requests:
            objects += len(self.writer.write(hashes, start))
            time.sleep(0)  # as in the fill: requests arrive over RPC
        elapsed = time.perf_counter() - t0
        return {"write_objects_per_s": objects / elapsed,
                "write_objects_per_request": objects / n,
                "state_calls_per_request": (self.writer.calls - calls0) / n,
                "write_uses_transition_many": 1.0 if self.writer.batched else 0.0}

    def owner_loss(self) -> dict[str, Any]:
        name = label(self.run.objects)
        _say(f"[{name}] owner loss (deadline, data plane, re-registration) under load")
        silent, marked, restarted = self.owners[1], self.owners[2], self.owners[3]
        before = self.state.object_count()
        self.victims |= {silent, marked}
        rejoined = len(self.rejoined)
        self._reset_heartbeat_figures()
        t_phase = time.perf_counter()
        with self._live() as (looks, _muts):
            time.sleep(0.3)
            self.lock.take_max_held()
            # 1. a shard goes silent; its silence passes the deadline, the reaper expires it
            # (its last heartbeat backdated to just inside the deadline: no waiting it out)
            self.silent.add(silent)
            time.sleep(2 * HEARTBEAT_EVERY_S)  # a heartbeat round under way has ended
            with self.clock.backdated(self.run.heartbeat_timeout_s - 0.5):
                self.state.heartbeat(silent, self.incarnations[silent])
            deadline = time.monotonic() + 30 + self.run.heartbeat_timeout_s
            while not any(silent in dead for dead, _, _ in self.expired):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the reaper did not expire silent owner {silent}")
                time.sleep(0.05)
            expire_hold, expire_cpu = next((h, c) for dead, h, c in self.expired
                                           if silent in dead)
            t_lost = time.perf_counter()
            # 2. the data plane found a shard dead
            lost = self.state.mark_owner_lost(marked)
            mark_hold, mark_cpu = self.lock.last_held_s(), self.lock.last_held_cpu_s()
            # 3. a restarted shard registers again
            with self._owners_lock:
                self.incarnations[restarted] = self.state.register_owner(restarted, self.pools)
                register_hold = self.lock.last_held_s()
                register_cpu = self.lock.last_held_cpu_s()
            t_done, calls = time.perf_counter(), self.reap_calls
            # until a reap() call begun after the losses found nothing left to bury
            while (self.has_reap and self.reap_idle[0] <= calls
                   and time.perf_counter() - t_done < REAP_WAIT_S):
                time.sleep(0.05)
            reaped = not self.has_reap or self.reap_idle[0] > calls
            time.sleep(0.3)
            longest = self.lock.take_max_held()
            by = {t.ident: t.name for t in threading.enumerate()}.get(longest.thread, "?")
        healthy_expired = len(self.rejoined) - rejoined
        alive = sum(self.state.owner_liveness().values())
        collections = self.gc.since(t_phase)
        return {
            "owner_loss_hold_ms": max(expire_hold, mark_hold, register_hold) * 1e3,
            "owner_loss_deadline_hold_ms": expire_hold * 1e3,
            "owner_loss_mark_hold_ms": mark_hold * 1e3,
            "owner_loss_reregister_hold_ms": register_hold * 1e3,
            # each hold's thread CPU time: near its wall time, the hold was work; far under
            # it, the holder waited (a thread switch at the GIL's 5 ms interval)
            "owner_loss_deadline_hold_cpu_ms": expire_cpu * 1e3,
            "owner_loss_mark_hold_cpu_ms": mark_cpu * 1e3,
            "owner_loss_reregister_hold_cpu_ms": register_cpu * 1e3,
            "owner_loss_max_hold_ms": longest.held_s * 1e3,
            "owner_loss_max_hold_cpu_ms": longest.cpu_s * 1e3,
            # of that CPU, the kernel's (as of the last tick: rough) and the page faults it
            # took: a long hold with little Python work in it is the kernel's or the host's
            "owner_loss_max_hold_sys_ms": longest.sys_s * 1e3,
            "owner_loss_max_hold_minor_faults": float(longest.minor_faults),
            "owner_loss_max_hold_thread": by,  # who held it (a name, not a figure)
            "owner_loss_objects": float(lost or 0),
            "owner_loss_reap_s": max(0.0, self.reap_idle[1] - t_lost) if self.has_reap else 0.0,
            "owner_loss_reap_done": 1.0 if reaped else 0.0,
            "owner_loss_objects_left": float(self.state.object_count()),
            "owner_loss_objects_before": float(before),
            "owner_loss_lookup_pause_ms": looks.stall_max * 1e3,
            "owner_loss_gc_max_pause_ms": max((p[2] for p in collections), default=0.0) * 1e3,
            "owner_loss_gc_collections": float(len(collections)),
            "owner_loss_heartbeat_max_ms": self.heartbeat_max * 1e3,
            "owner_loss_heartbeat_max_gap_ms": self.heartbeat_gap * 1e3,
            "healthy_owners_expired": float(healthy_expired),
            "owners_alive_after": float(alive),
        }

    def reports(self) -> list[ObjectReport]:
        """What the re-confirm owner held at the end of the fill, as it reports it."""
        lay, books = self.layout, self.books
        pids, depths, cols, blocks, gens, versions, disks = books.rows
        out = []
        for i in range(self.rows_at_fill):
            if blocks[i] == _DEAD_ROW:
                continue
            d, c = depths[i], cols[i]
            kind = lay.columns[c].kind
            lo = hi = 0
            if kind is Kind.SWA:
                lo, hi = lay.block_range(c, d)
            elif kind is Kind.TAIL:
                hi = lay.tail_tokens(c, d)
            h = books.hash_at(pids[i], d)
            assert h is not None
            out.append(ObjectReport(
                h, books.hash_at(pids[i], d - 1) if d else None, d, lay.columns[c].name,
                State.ON_DISK if disks[i] else _READY[kind], blocks[i], gens[i], versions[i],
                lo, hi))
        return out

    def reconfirm_reports(self) -> list[ObjectReport]:
        """What ``shard-0`` held at the end of the fill, shuffled: the bench's fill state and
        its view are let go first (a re-confirm in place starts from what that leaves)."""
        self.close()
        # The reports are the bench's, built at once before the timed loop; a service decodes
        # each batch as it arrives and frees it after. Built with the service's collections
        # paused and then frozen, they are never scanned by them (which took 61-107 ms at 1M:
        # a bench artifact counted as the service's longest collection).
        with gcpolicy.paused():
            reports = self.reports()
            self.rng.shuffle(reports)
            del self.writer, self.state
            gc.collect()
            gc.freeze()
        return reports

    def reconfirm_in_place(self, reports: Sequence[ObjectReport]) -> dict[str, float]:
        """The re-confirm in this process, whose heap a million-object view and its churn
        just left (``reconfirm_in_place_*``: beside the restart's figures, in a fresh one)."""
        figs = time_reconfirm(self.run, self.pools, reports, f"{label(self.run.objects)} in place")
        return {f"reconfirm_in_place_{k}": figs[k] for k in _IN_PLACE}


_IN_PLACE = ("reports_per_s", "with_summaries_reports_per_s", "max_batch_hold_ms", "complete")


def state_config(run: SizeRun) -> StateConfig:
    return StateConfig(heartbeat_timeout_s=run.heartbeat_timeout_s)


def time_reconfirm(run: SizeRun, pools: Mapping[str, PoolConfig],
                   reports: Sequence[ObjectReport], name: str) -> dict[str, float]:
    """A new view, ``shard-0`` registered, ``reports`` confirmed in batches as the shard sends
    them (within the run's time budget), then every summary they left to the walks paid."""
    _say(f"[{name}] re-confirm of {len(reports):,} reports in random order "
         f"(budget {run.reconfirm_budget_s:g} s)")
    lock = TimedLock()
    state = CacheState(default_spec(), state_config(run), lock=lock)
    inc = state.register_owner(RECONFIRM_OWNER, pools)
    done = confirmed = 0
    busy = max_hold = 0.0
    t0 = last = time.perf_counter()
    while done < len(reports) and busy < run.reconfirm_budget_s:
        batch = reports[done : done + CONFIRM_BATCH]
        t = time.perf_counter()
        confirmed += state.confirm(RECONFIRM_OWNER, batch, inc)
        gcpolicy.freeze_confirmed()  # as the servicer's Confirm does (with the policy on)
        now = time.perf_counter()
        busy += now - t
        max_hold = max(max_hold, lock.last_held_s())
        done += len(batch)
        if now - last > PROGRESS_EVERY_S:
            last = now
            _say(f"[{name}] re-confirm {done:,} / {len(reports):,} "
                 f"({done / busy:,.0f}/s, {now - t0:.0f} s)")
    # what the re-confirm left to the walks (each entry summarised once, when first read),
    # paid here at once: the rate with it counts every summary a rebuild needs, and the
    # orphans left to adopt in the reaper's slices (ADOPT_SLICE)
    t = time.perf_counter()
    pending = state.settle_pending()
    state.reap_all()
    settle = time.perf_counter() - t
    total = busy + settle
    return {
        "reports_per_s": done / busy if busy else 0.0,
        "with_summaries_reports_per_s": done / total if total else 0.0,
        "pending_entries": float(pending),
        "settle_ms": settle * 1e3,
        "reports": float(done),
        "reports_total": float(len(reports)),
        "confirmed": float(confirmed),
        "complete": 1.0 if done == len(reports) else 0.0,
        "max_batch_hold_ms": max_hold * 1e3,
    }


def reconfirm_after_restart(run: SizeRun, path: str) -> dict[str, Any]:
    """The re-confirm a restarted service sees: a fresh process (run it in a child) running
    the service's GC policy, the owner's reports streamed in (read from ``path``, written
    by :func:`measure_size`, and frozen: a service frees each batch after it)."""
    with open(path, "rb") as f:
        pools, reports = pickle.load(f)
    stop = threading.Event()
    policy = gcpolicy.install(stop) if run.service_gc else None  # (it freezes the reports)
    try:
        figs = time_reconfirm(run, pools, reports, f"{label(run.objects)} after a restart")
    finally:
        stop.set()
    out: dict[str, Any] = {f"reconfirm_{k}": v for k, v in figs.items()}
    if policy is not None:
        out["reconfirm_gc_longest_ms"] = policy.longest_pause_s * 1e3
        out["reconfirm_gc_longest_cpu_ms"] = policy.longest_pause_cpu_s * 1e3
    return out


RESTART_RATE = "reconfirm_with_summaries_reports_per_s"  # what the restarts are ranked by


def median_restart(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of the median run of the re-confirms after a restart (ranked by the rate
    with the summaries, the target's figure), with the slowest and fastest rates beside it:
    the host's speed moves 30-40% between runs of the same code (2026-12-03, the same
    reports: 103-144k reports/s), so one run's rate says little about the code."""
    ranked = sorted(runs, key=lambda f: f[RESTART_RATE])
    out = dict(ranked[len(ranked) // 2])
    out.update({f"{RESTART_RATE}_min": ranked[0][RESTART_RATE],
                f"{RESTART_RATE}_max": ranked[-1][RESTART_RATE],
                "reconfirm_restarts": float(len(ranked))})
    return out


def _latencies(name: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {f"{name}_{k}_ms": 0.0 for k in ("p50", "p99", "max")}
    return {f"{name}_p50_ms": percentile(values, 0.5) * 1e3,
            f"{name}_p99_ms": percentile(values, 0.99) * 1e3,
            f"{name}_max_ms": max(values) * 1e3}


def measure_size(run: SizeRun, reports_path: str) -> dict[str, Any]:
    """Every per-size figure but the re-confirm after a restart (run it in a fresh process:
    RSS and heap are then its own); writes what that re-confirm is sent to
    ``reports_path``."""
    policy_stop = threading.Event()
    policy = gcpolicy.install(policy_stop) if run.service_gc else None
    bench = _Scale(run)
    bench.start()
    try:
        out: dict[str, Any] = bench.fill()
        out.update(bench.live_window())
        out.update(bench.write_rate())
        out.update(bench.owner_loss())
        out["gc_threshold0"] = float(gc.get_threshold()[0])
        out["gc_enabled"] = 1.0 if gc.isenabled() else 0.0
        reports = bench.reconfirm_reports()
        with open(reports_path, "wb") as f:
            pickle.dump((bench.pools, reports), f, protocol=pickle.HIGHEST_PROTOCOL)
        out.update(bench.reconfirm_in_place(reports))
        if policy is not None:  # its bounded collections, beside one full one (full_gc_ms)
            out["service_gc_collections"] = float(policy.collections)
            out["service_gc_longest_ms"] = policy.longest_pause_s * 1e3
            out["service_gc_longest_cpu_ms"] = policy.longest_pause_cpu_s * 1e3
    finally:
        bench.close()
        policy_stop.set()
    return out


# -- the data plane: RPCs per request write ---------------------------------------------------


class _CallCounter:
    """Counts calls on a metadata port by method (instance attributes shadow its methods: the
    shards hold the same port object, so their commit calls count too)."""

    SKIP = frozenset({"heartbeat", "get_spec", "swap", "events_since", "stats"})

    def __init__(self, port: object) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        for name in dir(port):
            fn = getattr(port, name)
            if name.startswith("_") or not callable(fn) or name in self.SKIP:
                continue
            setattr(port, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    def take(self) -> Counter[str]:
        with self._lock:
            out, self.counts = self.counts, Counter()
            return out


def _payload(lay: Layout, rng: np.random.Generator, blocks: int
             ) -> tuple[dict[tuple[int, str], np.ndarray], dict[tuple[int, str],
                                                               tuple[np.ndarray, int]]]:
    """A request's bytes: every object of depths ``[0, blocks)``, exactly its size."""
    data: dict[tuple[int, str], np.ndarray] = {}
    tails: dict[tuple[int, str], tuple[np.ndarray, int]] = {}
    for d in range(blocks):
        for c in lay.attached[d % lay.period]:
            col = lay.columns[c]
            if col.kind is Kind.TAIL:
                n = lay.tail_tokens(c, d)
                tails[(d, col.name)] = (rng.integers(0, 256, lay.object_bytes(c, d, tail_len=n),
                                                     dtype=np.uint8), n)
            else:
                data[(d, col.name)] = rng.integers(0, 256, col.nbytes, dtype=np.uint8)
    return data, tails


def dataplane_figures(requests: int, seed: int = 0) -> dict[str, float]:
    """``DataPlane.write_prefix`` of ``requests`` new 16-block prompts on an InProcessSystem
    (2 shards): metadata calls per request, by method, and objects written per second."""
    from workers.inprocess import InProcessConfig, InProcessSystem  # torch: only here

    spec = default_spec()
    lay = Layout(spec)
    rng = np.random.default_rng(seed)
    config = InProcessConfig(shards=2, blocks_per_group=REQUEST_BLOCKS * (requests + 2),
                             heartbeat_interval_s=30.0)
    with tempfile.TemporaryDirectory(prefix="hkv-bench-scale-") as tmp:
        system = InProcessSystem(spec, tmp, config)
        try:
            counter = _CallCounter(system.meta)
            plane = system.dataplane(timeout_s=60.0)
            per_request: list[Counter[str]] = []
            objects, elapsed = 0, 0.0
            for i in range(requests + 1):
                hashes = _chain(None, b"dataplane %d %d" % (seed, i), REQUEST_BLOCKS)
                blocks, tails = _payload(lay, rng, REQUEST_BLOCKS)
                counter.take()
                t0 = time.perf_counter()
                report = plane.write_prefix(hashes, blocks, tails)
                dt = time.perf_counter() - t0
                calls = counter.take()
                if not report.ok:
                    raise RuntimeError(f"the data plane's write failed: {report.failed}")
                if i:  # the first one warms up
                    per_request.append(calls)
                    objects += report.written
                    elapsed += dt
        finally:
            system.close()
    totals = [sum(c.values()) for c in per_request]
    methods = sorted({m for c in per_request for m in c})
    out = {
        "write_rpcs_per_request": sum(totals) / len(totals),
        "write_rpcs_per_request_max": float(max(totals)),
        "dataplane_objects_per_request": objects / len(per_request),
        "dataplane_write_objects_per_s": objects / elapsed,
    }
    out.update({f"write_rpcs_{m}_per_request": sum(c[m] for c in per_request) / len(per_request)
                for m in methods})
    return out


# -- the run ----------------------------------------------------------------------------------


def _in_child(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


_PER_SIZE_RATIOS = (
    "bytes_per_object", "rss_mib", "full_gc_ms", "fill_objects_per_s",
    "lookup1_p50_ms", "lookup1_p99_ms", "lookup1_max_ms",
    "lookup2048_p50_ms", "lookup2048_p99_ms", "lookup2048_max_ms",
    "longest_pause_ms", "heartbeat_max_ms", "write_objects_per_s", "service_gc_longest_ms",
    "owner_loss_hold_ms", "owner_loss_max_hold_ms", "reconfirm_reports_per_s",
    "reconfirm_with_summaries_reports_per_s", "reconfirm_in_place_with_summaries_reports_per_s",
)
TARGETS = {
    "target_lookup_p99_ratio_max": 2.0,  # p99 lookup at 1M <= 2x its 10k value
    "target_longest_pause_ms_max": 50.0,  # no pause seen by a lookup above 50 ms at 4M
    "target_owner_loss_hold_ms_max": 1.0,  # owner loss under the lock <= 1 ms, any size
    "target_reconfirm_reports_per_s_min": 100_000.0,  # re-confirm, any order
    "target_write_rpcs_per_request_max": 3.0,  # a request's write in <= 3 RPCs
}


def _targets(per_size: dict[int, dict[str, Any]], plane: dict[str, Any]
             ) -> dict[str, float | bool]:
    sizes = sorted(per_size)
    small, big = sizes[0], sizes[-1]
    at = 1_000_000 if 1_000_000 in per_size else big  # the p99 target's size (1M in a full run)
    out: dict[str, float | bool] = dict(TARGETS)
    for kind in ("lookup1", "lookup2048"):
        ratio = per_size[at][f"{kind}_p99_ms"] / max(per_size[small][f"{kind}_p99_ms"], 1e-9)
        out[f"{kind}_p99_ratio_{label(at)}_met"] = ratio <= TARGETS["target_lookup_p99_ratio_max"]
    worst_pause = per_size[big]["longest_pause_ms"]
    out[f"longest_pause_{label(big)}_met"] = worst_pause <= TARGETS["target_longest_pause_ms_max"]
    # the same target while an owner is lost and its objects reaped (lookups run then too)
    out[f"longest_pause_owner_loss_{label(big)}_met"] = (
        per_size[big]["owner_loss_lookup_pause_ms"] <= TARGETS["target_longest_pause_ms_max"])
    out["owner_loss_hold_met"] = all(
        f["owner_loss_hold_ms"] <= TARGETS["target_owner_loss_hold_ms_max"]
        for f in per_size.values())
    for scene in ("", "in_place_"):  # after a restart (the target); in the churned process
        out[f"reconfirm_{scene}rate_met"] = all(  # with the summaries it left to walks, paid
            f[f"reconfirm_{scene}with_summaries_reports_per_s"]
            >= TARGETS["target_reconfirm_reports_per_s_min"]
            for f in per_size.values())
    out["write_rpcs_met"] = (plane["write_rpcs_per_request_max"]
                             <= TARGETS["target_write_rpcs_per_request_max"])
    return out


def _sizes_from_env() -> tuple[int, ...]:
    """``HKV_BENCH_SCALE_SIZES=10k,100k,1m``: other sizes than the mode's (a partial run)."""
    raw = os.environ.get(SIZES_ENV, "").strip()
    scale = {"k": 1_000, "m": 1_000_000}
    out = []
    for part in filter(None, (p.strip().lower() for p in raw.split(","))):
        mult = scale.get(part[-1], 1)
        try:
            out.append(int(float(part[:-1] if mult > 1 else part) * mult))
        except ValueError:
            raise ValueError(f"{SIZES_ENV}={raw!r}: sizes are numbers like 10k, 1m or 250000"
                             ) from None
    return tuple(out)


def run(quick: bool = False, *, sizes: Sequence[int] | None = None,
        doc_blocks: int = DOC_BLOCKS, window_s: float | None = None,
        write_requests: int | None = None, reconfirm_budget_s: float | None = None,
        dataplane_requests: int | None = None) -> dict[str, Any]:
    """``--quick``: 10k and 100k objects, shorter windows (well under a minute or two on 2
    cores); else 10k, 100k, 1M and 4M (``HKV_BENCH_SCALE_SIZES`` names other sizes). The
    keyword arguments shrink a run further (tests)."""
    chosen = tuple(sizes or _sizes_from_env() or (QUICK_SIZES if quick else FULL_SIZES))
    base = SizeRun(
        objects=0, doc_blocks=doc_blocks,
        window_s=window_s if window_s is not None else (2.0 if quick else 8.0),
        write_requests=write_requests if write_requests is not None else (40 if quick else 200),
        reconfirm_budget_s=reconfirm_budget_s if reconfirm_budget_s is not None else (
            5.0 if quick else 30.0),
        restarts=1 if quick else 3,
    )
    per_size: dict[int, dict[str, Any]] = {}
    for n in chosen:
        _say(f"[{label(n)}] starting (a fresh process)")
        size_run = replace(base, objects=n)
        with tempfile.TemporaryDirectory(prefix="hkv-bench-scale-") as tmp:
            path = os.path.join(tmp, "reports.pickle")
            figs = _in_child(measure_size, size_run, path)
            figs.update(median_restart([  # each in a fresh process, as a restart is
                _in_child(reconfirm_after_restart, size_run, path)
                for _ in range(size_run.restarts)]))
        per_size[n] = figs
        _say(f"[{label(n)}] done: " + ", ".join(
            f"{k} {figs[k]:.4g}" for k in _PER_SIZE_RATIOS if k in figs))
    _say("the data plane: RPCs per request write")
    plane = _in_child(dataplane_figures, dataplane_requests or (10 if quick else 40))
    small = min(per_size)
    figures: dict[str, Any] = {"sizes": float(len(per_size)),
                               "smallest_objects": float(small)}
    for n, figs in per_size.items():
        figures.update({f"{k}_{label(n)}": v for k, v in figs.items()})
    figures.update(plane)
    figures.update(_targets(per_size, plane))
    baseline = {f"{k}_{label(small)}": v for k, v in per_size[small].items()}
    ratios = {
        f"{k}_{label(n)}_vs_{label(small)}": per_size[n][k] / per_size[small][k]
        for n in sorted(per_size) if n != small
        for k in _PER_SIZE_RATIOS if per_size[small].get(k) and per_size[n].get(k)
    }
    for n in sorted(per_size):  # the service's GC policy against a full collection
        f = per_size[n]
        if f.get("service_gc_longest_ms") and f.get("full_gc_ms"):  # (none ran: no ratio)
            ratios[f"service_gc_vs_full_gc_{label(n)}"] = (f["service_gc_longest_ms"]
                                                          / f["full_gc_ms"])
    return {"name": "scale", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": ratios}
