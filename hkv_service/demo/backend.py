"""The cache the demo's workers drive: one backend over the real parts, on either wiring.

:class:`DemoBackend` drives a :class:`~.wiring.Wiring` (in-process or the system ``hkv up``
starts) the way an inference worker would:

* lookup -> the metadata port's ``lookup`` (the funnel), with a lease unless the worker races
  an evict;
* load -> ``DataPlane.load`` (the shards' verified disk loads; ``slow`` leaves them in flight
  on the shard for a while), read -> ``DataPlane.read`` (the shard re-checks generation and
  occupant right before copying; a :class:`Recompute` becomes a ``ReadResult`` with its reason);
* write -> ``DataPlane.write_prefix``, then a write-through ``DataPlane.offload`` of what was
  written to the holding shard's disk tier (memory copies stay);
* safe_prefix -> the oracle: this backend's own books of what it wrote completely and which
  live objects still hold it, kept current by the transition stream (evictions, losses,
  re-confirmations), never the funnel.

Every fault is made with the real components: an evicted block reused by other bytes in the
shard's pool, a stalled tail writer and an indexer of old bytes committed through the shard,
a bit flipped in the shard's own LMDB file, a load held in flight on the shard, a shard crashed
(its successor starts cold), the metadata service restarted under live shards, a shard whose
pools are only 32-byte aligned, small pools, a reader of another ABI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hkv_service.core.api import AllocRequest, Handle, LookupRequest, Match, Params
from hkv_service.core.contracts import CONTRACTS
from hkv_service.core.errors import HkvError, PoolExhausted
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.layout import AT_BOUNDARY, Column, Layout
from hkv_service.core.states import TERMINAL_STATES, Event, Kind, Reason, State
from hkv_service.refmodel import BlockRun
from workers import outage
from workers.checkpoints import StateCheckpoint, StateRefused, state_payload
from workers.dataplane import PendingLoad, Recompute
from workers.link import ShardUnavailable
from workers.ports import Commit
from workers.tags import BlockTag

from .faults import flip_on_disk
from .wiring import EVENTS_BATCH, Wiring

__all__ = [
    "ALIGNMENT", "DemoBackend", "Lookup", "ReadResult", "WriteOptions", "WriteReport",
    "place_column",
]

ALIGNMENT = 128  # bytes every handle must be aligned to (c128 blocks are 128 bytes)
LEASE_TTL_S = 30.0
OFFLOAD_BATCH = 32  # objects per offload call (under the admission cap of 64 in transit)
MISALIGNED_DEPTHS = 2  # the last entries a misaligned writer places on the odd shard
WATCH_S = 0.1  # one poll of the transition stream
SLOW_LOAD_S = 0.3  # how long a slow_disk_load stays in flight on the shard
Blocks = dict[str, Mapping[int, torch.Tensor]]  # per column: {block: tensor} or a BlockRun
Tails = dict[str, tuple[torch.Tensor, int]]
States = dict[str, torch.Tensor]  # per recurrent group: its state as of the resume point
Key = tuple[bytes, str]  # (block hash, column name)
Slot = tuple[int, str]  # (depth, column name)
_EMPTY_OBJECT = -1  # the pool's "no occupant" object id
_FLIP_NEEDLE = 64  # bytes of a payload searched for in the LMDB file


@dataclass
class Lookup:
    """A Match plus what the backend needs to read it."""

    match: Match
    usable: int
    hashes: Sequence[BlockHash]
    handles: dict[str, tuple[Handle, ...]]
    lease_id: LeaseId | None


@dataclass
class ReadResult:
    blocks: Blocks | None = None
    tails: Tails | None = None
    reason: str | None = None  # set when the read failed: recompute
    states: States = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class WriteOptions:
    owner: str | None = None  # place every block on this shard (misaligned_handle)
    partial_tail: bool = False  # stall the c4 tail writer half way (TAIL_PARTIAL)
    stale_indexer: bool = False  # indexer keeps old bytes, never synced


@dataclass
class WriteReport:
    written: int = 0
    existing: int = 0
    repaired: int = 0
    pool_exhausted: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    refused_states: dict[Slot, str] = field(default_factory=dict)  # slot -> why (not written)


def needed_columns(lay: Layout, depth: int, p: int) -> list[int]:
    """Columns whose block at ``depth`` a reader resuming at ``p`` needs (the oracle's own
    rule, not the funnel's): every compressed/indexer block, the tails and the recurrent
    states at p, SWA blocks meeting [p-W, p)."""
    end = (depth + 1) * lay.hash_block
    out = []
    for c in lay.attached[depth % lay.period]:
        col = lay.columns[c]
        if col.kind in AT_BOUNDARY and end != p:
            continue
        if col.kind is Kind.SWA and end <= p - col.group.window:
            continue
        out.append(c)
    return out


def place_block(blocks: Blocks, tails: Tails, lay: Layout, col: Column, depth: int,
                tensor: torch.Tensor, usable: int, states: States | None = None) -> None:
    """File one read block where ``RefModel.import_cache`` wants it: a tail with the number of
    raw tokens it holds at ``usable``, a recurrent state under its group, any other block
    under its index in its own group."""
    if col.kind is Kind.STATE:
        if states is not None:
            states[col.group.name] = tensor
    elif col.kind is Kind.TAIL:
        tails[col.group.name] = (tensor, col.tail_tokens_at(usable))
    else:
        end = (depth + 1) * lay.hash_block
        have = blocks.get(col.name)
        if not isinstance(have, dict):
            have = blocks[col.name] = dict(have or {})
        have[end // col.group.block_size - 1] = tensor


def place_column(blocks: Blocks, tails: Tails, lay: Layout, col: Column,
                 depths: Sequence[int], arrays: Sequence[np.ndarray], usable: int,
                 states: States | None = None) -> None:
    """File one column's read blocks (``arrays[i]`` ends at hash block ``depths[i]``).

    Blocks that are consecutive in their group (what a reader needs always is) are stacked
    into one :class:`BlockRun` with one copy of the column's bytes, which ``import_cache``
    adopts as the group's rows; anything else (a tail, a gap, a misshapen block) is filed
    block by block with a copy each, and import names what is wrong."""
    ks = [((d + 1) * lay.hash_block) // col.group.block_size - 1 for d in depths]
    if col.kind not in AT_BOUNDARY and ks and ks == list(range(ks[0], ks[0] + len(ks))):
        try:
            stacked = np.stack(arrays)  # the one copy
        except ValueError:  # shapes differ: block by block below
            pass
        else:
            blocks[col.name] = BlockRun(ks[0], torch.from_numpy(stacked))
            return
    for d, a in zip(depths, arrays, strict=True):
        place_block(blocks, tails, lay, col, d, torch.from_numpy(np.array(a, copy=True)), usable,
                    states)


_HELD_STATES = frozenset(c.ready_state for k, c in CONTRACTS.items() if k is not Kind.DISK)


class _Books:
    """The oracle: what this backend wrote completely, and which live objects (on which
    shard) still hold it. Fed by the writes and by the transition stream."""

    def __init__(self, odd_shard: str | None) -> None:
        self.lock = threading.RLock()
        self.odd_shard = odd_shard
        self.good: set[Key] = set()
        self.copies: dict[Key, dict[int, str]] = {}  # key -> {object id: shard}
        self.key_of: dict[int, Key] = {}
        self.dead: set[int] = set()
        self.heads: dict[Key, bytes] = {}  # first bytes of each payload (disk_bitflip)
        # at the last service restart: the shard of each key's memory copy, which its shard
        # re-confirms to the new view under a new id
        self.before_restart: dict[Key, str] = {}

    def add(self, key: Key, oid: int, shard: str) -> None:
        with self.lock:
            if oid in self.dead:
                return
            self.copies.setdefault(key, {})[oid] = shard
            self.key_of[oid] = key

    def gone(self, oid: int) -> None:
        with self.lock:
            self.dead.add(oid)
            key = self.key_of.pop(oid, None)
            if key is not None:
                self.copies.get(key, {}).pop(oid, None)

    def lose_memory_of(self, shard: str, disk_oids: set[int]) -> None:
        """A shard crashed: its memory objects are gone (its disk records come back)."""
        with self.lock:
            for held in self.copies.values():
                for oid in [o for o, s in held.items() if s == shard and o not in disk_oids]:
                    del held[oid]

    def forget_copies(self, disk_oids: set[int]) -> None:
        """The metadata view was restarted: every object id is void; the shards' re-confirmed
        memory objects and disk records come back through the stream under new ids."""
        with self.lock:
            self.before_restart = {key: shard for key, held in self.copies.items()
                                   for oid, shard in held.items() if oid not in disk_oids}
            self.dead |= set(self.key_of)
            self.copies.clear()
            self.key_of.clear()

    def known(self) -> set[int]:
        with self.lock:
            return set(self.key_of) | self.dead

    def safe(self, key: Key, disk_oids: set[int]) -> bool:
        """Written completely and held by a live copy a 128-aligned reader may be handed
        (copies on the odd shard, memory or its disk, are placed misaligned). A memory copy
        is what the service serves when there is one (a misaligned one is MISALIGNED, the
        disk copy is not offered instead); only without one do disk copies count."""
        if key not in self.good:
            return False
        held = self.copies.get(key, {})
        memory = [s for oid, s in held.items() if oid not in disk_oids]
        return all(s != self.odd_shard for s in memory) if memory else any(
            s != self.odd_shard for s in held.values())


class DemoBackend:
    def __init__(self, wiring: Wiring, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.wiring = wiring
        self.shapes = dict(shapes)  # per column: the reference model's array shape
        self.name = wiring.name
        self.meta = wiring.meta
        self.dp = wiring.dp
        self.layout = self.dp.layout
        self.odd_shard = wiring.odd_shard
        self.books = _Books(wiring.odd_shard)
        self._odd_restarts = 0  # service restarts seen (the odd shard restarts every other)
        self.events: Counter[str] = Counter()
        self.lock = threading.RLock()  # allocations, block reuse and faults of this process
        self.faulty: dict[Key, int] = {}  # partial tails / unsynced indexers we left behind
        self.disk_oids: set[int] = set()  # DISK objects (they survive a shard crash)
        self.retired: Counter[str] = Counter()  # counters of metadata views before a restart
        self.retired_downgrades: Counter[str] = Counter()
        self._owner_of: dict[int, str] = {}  # DISK object -> the shard whose tier holds it
        self._pending: list[PendingLoad] = []
        self._crashed: set[str] = set()
        self._seq = 0
        self._caught_up = 0.0  # the watcher has seen every event logged before this time
        self._synced = threading.Condition(self.books.lock)
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="hkv-demo-watch",
                                         daemon=True)
        self._watcher.start()

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        self._stop.set()
        self._watcher.join(5.0)
        self.wiring.close()

    def _watch(self) -> None:
        """Follow the transition stream: objects evicted, lost or corrupt leave the books;
        disk records (written through, or re-confirmed after a restart) come into them."""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with self.books.lock:
                    seq = self._seq
                got = self.wiring.events(seq, WATCH_S)
            except Exception as exc:  # a service restart or close under way
                self.events[f"watch_error:{type(exc).__name__}"] += 1
                self._stop.wait(0.2)
                continue
            with self.books.lock:
                if seq != self._seq:  # a restart reset the stream meanwhile: drop this batch
                    continue
                if got:
                    self._seq = got[-1].seq
                for ev in got:
                    self._note(ev)
                if len(got) < EVENTS_BATCH:  # every event logged before `started` is in
                    self._caught_up = started
                    self._synced.notify_all()

    def _sync(self, timeout_s: float = 5.0) -> None:
        """Until the books hold every transition logged before now (the oracle's answer is
        then as of this moment, not of the watcher's last poll)."""
        now = time.monotonic()
        with self.books.lock:
            self._synced.wait_for(lambda: self._caught_up >= now or self._stop.is_set(),
                                  timeout_s)

    def _note(self, ev: Any) -> None:
        oid = int(ev.object_id)
        if ev.state in TERMINAL_STATES:
            self.books.gone(oid)
        elif ev.kind is Kind.DISK and ev.state is State.ON_DISK:
            self.disk_oids.add(oid)
            key = (bytes(ev.block_hash), str(ev.column))
            if key in self.books.good and oid not in self.books.known():
                self.books.add(key, oid, self._disk_owner(oid))
        elif ev.state in _HELD_STATES and oid not in self.books.known():
            # a memory object its shard re-confirmed after a restart: the copy the books had
            key = (bytes(ev.block_hash), str(ev.column))
            shard = self.books.before_restart.pop(key, None)
            if shard is not None and key in self.books.good:
                self.books.add(key, oid, shard)

    def _disk_owner(self, oid: int) -> str:
        return self._owner_of.get(oid, "")  # "": re-confirmed after a restart, owner unknown

    # ---- lookup / load / read ---------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], resume_tokens: int,
               reader_abi: Mapping[str, int] | None = None, lease: bool = True,
               wait_in_flight: bool = True) -> Lookup:
        """The funnel's answer. DISK_INFLIGHT here is mostly another worker's load under way:
        with ``wait_in_flight`` it is waited for (twice at most) rather than recomputed. While
        the metadata service is out (another worker's service_restart) the answer is "reuse
        nothing" with ``outage.OUTAGE_REASON``, as an inference worker's is."""
        req = LookupRequest(list(hashes), resume_tokens, dict(reader_abi) if reader_abi else None,
                            ALIGNMENT, LEASE_TTL_S if lease else 0.0)
        m = outage.lookup(self.meta, req)
        for _ in range(2 if wait_in_flight else 0):
            if not any(d.reason is Reason.DISK_INFLIGHT for d in m.downgrades):
                break
            if m.lease_id is not None:
                with contextlib.suppress(Exception):
                    self.meta.release_lease(m.lease_id)
            self.events["waited_for_inflight_load"] += 1
            self._stop.wait(SLOW_LOAD_S / 2)
            m = outage.lookup(self.meta, req)
        return Lookup(m, m.usable_tokens, hashes, dict(m.handles), m.lease_id)

    def load(self, lk: Lookup, slow: bool = False) -> list[str]:
        """Load the match's disk objects on the shards. ``slow``: the shards hold the loads in
        flight for SLOW_LOAD_S; this returns once the service shows them in flight."""
        if not lk.match.needs_load:
            return []
        if slow:
            started = self.dp.start_load(lk.match, list(lk.hashes), hold_s=SLOW_LOAD_S)
            if isinstance(started, Recompute):
                return [started.reason.value]
            with self.lock:
                self._pending.append(started)
            self._await_in_flight(lk)
            return []
        got = self.dp.load(lk.match, list(lk.hashes))
        if isinstance(got, Recompute):
            self.events[f"load_failed:{got.reason.value}"] += 1
            return [got.reason.value]
        self.events["loaded"] += len(got)
        return []

    def _await_in_flight(self, lk: Lookup, timeout_s: float = 2.0) -> None:
        """Until a probe (no handles, no lease) of the same question reports DISK_INFLIGHT."""
        req = LookupRequest(list(lk.hashes), lk.match.matched_tokens or None, None, ALIGNMENT,
                            handles=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = outage.lookup(self.meta, req)  # an outage: nothing to see, until the deadline
            if any(d.reason is Reason.DISK_INFLIGHT for d in m.downgrades):
                return
            self._stop.wait(0.01)

    def settle(self) -> list[str]:
        """Wait for the slow loads to land (checksum-verified); their failure reasons."""
        with self.lock:
            pending, self._pending = self._pending, []
        out = []
        for p in pending:
            got = p.wait()
            if isinstance(got, Recompute):
                out.append(got.reason.value)
        return out

    def read(self, lk: Lookup) -> ReadResult:
        try:
            out = self.dp.read(lk.match, list(lk.hashes), release=False)
        finally:
            self._revive_crashed()
        if isinstance(out, Recompute):
            self.events[f"read_recompute:{out.reason.value}"] += 1
            return ReadResult(reason=out.reason.value)
        lay = self.layout
        blocks: Blocks = {}
        tails: Tails = {}
        states: States = {}
        for name, arrays in out.items():
            col = lay.columns[lay.by_name[name]]
            depths = lay.needed_depths(lay.by_name[name], lk.usable)
            if len(depths) != len(arrays):
                return ReadResult(reason=Reason.MISSING_COMPONENT.value)
            shape = self._shape(col)
            # views of the shard's bytes; place_column copies each column once
            views = [np.ascontiguousarray(arr).view(np.float32).reshape(-1, *shape[1:])
                     for arr in arrays]  # a tail: exactly its rows
            place_column(blocks, tails, lay, col, depths, views, lk.usable, states)
        return ReadResult(blocks, tails, states=states)

    def _shape(self, col: Column) -> tuple[int, ...]:
        return self.shapes[col.name]

    def release(self, lk: Lookup) -> None:
        if lk.lease_id is not None:
            with contextlib.suppress(Exception):
                self.meta.release_lease(lk.lease_id)

    # ---- write ------------------------------------------------------------------------------

    def write(
        self,
        hashes: Sequence[BlockHash],
        blocks: Mapping[int, Mapping[str, torch.Tensor]],
        tails: Mapping[int, Mapping[str, tuple[torch.Tensor, int]]],
        opts: WriteOptions = WriteOptions(),
        states: Mapping[int, Mapping[str, StateCheckpoint]] | None = None,
    ) -> WriteReport:
        """Write a prompt's new blocks, tails and recurrent states (each state filed only if
        it is its boundary's, in the spec's layout: ``workers.checkpoints``; a refused one is
        left out and named in ``refused_states``)."""
        rep = WriteReport()
        hashes = list(hashes)
        data: dict[Slot, np.ndarray] = {}
        tail_data: dict[Slot, tuple[np.ndarray, int]] = {}
        for d, cols in blocks.items():
            for name, t in cols.items():
                data[(d, name)] = _as_bytes(t)
        for d, tcols in tails.items():
            for g, (t, n) in tcols.items():
                tail_data[(d, f"{g}.tail")] = (_as_bytes(t[:n]), n)  # exactly its rows
        for d, scols in (states or {}).items():
            for name, ckpt in scols.items():
                try:
                    data[(d, name)] = state_payload(self.layout, name, d, ckpt)
                except StateRefused as err:
                    rep.refused_states[(d, name)] = str(err)
                    self.events["state_refused"] += 1
        special = self._faulty_writes(blocks, tails, data, tail_data, opts)
        with self.lock:
            wr = self._write_prefix(hashes, data, tail_data, opts.owner)
            rep.written += wr.written
            rep.existing += wr.existing
            if wr.failed:
                self.events["write_failed"] += len(wr.failed)
                rep.pool_exhausted += sum(r.cause is not None and issubclass(r.cause, PoolExhausted)
                                          for r in wr.failed.values())
            done: list[tuple[Slot, Handle]] = []
            known = self.books.known() | set(self.faulty.values())
            for s, h in sorted(wr.handles.items()):
                if s in wr.failed or int(h.object_id) in known:
                    continue  # failed, or an object that was already there
                key = (bytes(hashes[s[0]]), s[1])
                self.books.good.add(key)
                self.books.add(key, int(h.object_id), h.shard)
                payload = data.get(s)
                if payload is not None:
                    self.books.heads[key] = payload[:_FLIP_NEEDLE].tobytes()
                done.append((s, h))
            for s, (arr, commit, fault) in sorted(special.items()):
                if self._write_special(hashes, s, arr, commit):
                    rep.faults[fault] += 1
            repaired = self._repair(hashes, data, tail_data, wr)
            rep.repaired += len(repaired)
            done += repaired
            self._write_through(hashes, done)
        return rep

    def _write_prefix(self, hashes: list[BlockHash], data: dict[Slot, np.ndarray],
                      tail_data: dict[Slot, tuple[np.ndarray, int]], odd: str | None) -> Any:
        """``DataPlane.write_prefix``; a misaligned writer (``odd``) places the last
        MISALIGNED_DEPTHS entries it writes on that shard, the rest where the service likes."""
        regular = self._regular_shard(hashes)
        if odd is None:
            return self.dp.write_prefix(hashes, data, tail_data, owner=regular)
        cut = max((d for d, _ in (*data, *tail_data)), default=0) - MISALIGNED_DEPTHS + 1
        early = self.dp.write_prefix(hashes, {k: v for k, v in data.items() if k[0] < cut},
                                     {k: v for k, v in tail_data.items() if k[0] < cut},
                                     owner=regular)
        late = self.dp.write_prefix(hashes, {k: v for k, v in data.items() if k[0] >= cut},
                                    {k: v for k, v in tail_data.items() if k[0] >= cut},
                                    owner=ShardId(odd))
        for name in ("versions", "failed", "handles"):
            getattr(early, name).update(getattr(late, name))
        early.written += late.written
        early.existing += late.existing
        return early

    def _regular_shard(self, hashes: Sequence[BlockHash]) -> ShardId | None:
        """Where a well-behaved writer puts its blocks while the odd shard exists: a regular
        shard, chosen by the prompt's last hash (the service, left to choose, would use the
        odd one too). None (the service chooses) when there is no odd shard."""
        if self.odd_shard is None:
            return None
        regular = sorted(s for s in self.dp.shards if s != self.odd_shard)
        return ShardId(regular[bytes(hashes[-1])[0] % len(regular)])

    def _faulty_writes(self, blocks: Mapping[int, Mapping[str, torch.Tensor]],
                       tails: Mapping[int, Mapping[str, tuple[torch.Tensor, int]]],
                       data: dict[Slot, np.ndarray], tail_data: dict[Slot, tuple[np.ndarray, int]],
                       opts: WriteOptions) -> dict[Slot, tuple[np.ndarray, Commit, str]]:
        """Take the slots a faulty writer writes wrong out of ``data``/``tail_data``."""
        special: dict[Slot, tuple[np.ndarray, Commit, str]] = {}
        first = min(set(blocks) | set(tails), default=-1)
        last_tail = max(tails, default=-1)
        # a writer stalled at its last resume point (where the next turn resumes): half the
        # rows, never TAIL_DONE
        slot = (last_tail, "c4.tail")
        if opts.partial_tail and slot in tail_data and tail_data[slot][1] >= 2:
            _, n = tail_data.pop(slot)
            rows = tails[last_tail]["c4"][0].numpy()[: n // 2].astype(np.float32, copy=True)
            special[slot] = (_as_bytes(rows), Commit((Event.TAIL_APPEND,),
                                                     (Params(tail_len=n // 2),)), "partial_tail")
        slot = (first, "idx")  # keys of old bytes: WRITE_DONE, never INDEXER_SYNC
        if opts.stale_indexer and slot in data:
            old = np.roll(blocks[first]["idx"].numpy().astype(np.float32), 1, axis=0) * 0.5
            data.pop(slot)
            special[slot] = (_as_bytes(old), Commit((Event.WRITE_DONE,)), "stale_indexer")
        return special

    def _write_special(self, hashes: list[BlockHash], s: Slot, arr: np.ndarray,
                       commit: Commit) -> bool:
        """Allocate one slot and write it with ``commit`` (a fault: never readable)."""
        d, name = s
        try:
            a = self.meta.allocate(hashes, [AllocRequest(d, name)], None)[0]
        except HkvError:
            return False
        if a.existing:
            return False  # someone else's complete object: leave it
        tag = BlockTag(hashes[d], hashes[d - 1] if d else None, d)
        res = self._call(a.handle, "write_blocks", [a.handle], [arr], [tag], [commit])
        if res is None or not res[0].ok:
            with contextlib.suppress(Exception):
                self.meta.evict(a.handle.object_id)
            return False
        key = (bytes(hashes[d]), name)
        with self.books.lock:
            # the bad bytes are in memory only; a disk copy of good bytes (written through
            # earlier) still serves a reader, who loads it past the bad memory object
            if not any(o in self.disk_oids for o in self.books.copies.get(key, {})):
                self.books.good.discard(key)
        self.faulty[key] = int(a.handle.object_id)
        return True

    def _repair(self, hashes: list[BlockHash], data: Mapping[Slot, np.ndarray],
                tail_data: Mapping[Slot, tuple[np.ndarray, int]], wr: Any
                ) -> list[tuple[Slot, Handle]]:
        """A later writer replaces a stalled tail or an unsynced indexer with a fresh object
        of fresh bytes (``AllocRequest.replace``: the stalled one is retired first; an
        object's bytes are never rewritten)."""
        out: list[tuple[Slot, Handle]] = []
        lay = self.layout
        for s in sorted(set(data) | set(tail_data)):
            key = (bytes(hashes[s[0]]), s[1])
            if key not in self.faulty or s not in wr.handles:
                continue
            del self.faulty[key]
            col = lay.columns[lay.by_name[s[1]]]
            if col.kind not in (Kind.TAIL, Kind.INDEXER):
                continue
            d = s[0]
            kv_name = lay.columns[col.indexes].name if col.indexes is not None else None
            reqs = [AllocRequest(d, s[1])] + ([AllocRequest(d, kv_name)] if kv_name else [])
            try:
                allocs = self.meta.allocate(hashes, reqs, None)
            except HkvError:
                continue
            if not self._give_back_fresh(allocs):
                continue  # the stalled object is gone meanwhile
            a = allocs[0]
            tag = BlockTag(hashes[d], hashes[d - 1] if d else None, d)
            if a.state is State.TAIL_PARTIAL and s in tail_data:
                arr, n = tail_data[s]
                commit = Commit((Event.TAIL_DONE,), (Params(tail_len=n),))
            elif a.state is State.INDEXER_WRITTEN and kv_name is not None and s in data:
                arr = data[s]
                version = wr.versions.get((d, kv_name), allocs[1].version)
                commit = Commit((Event.WRITE_DONE, Event.INDEXER_SYNC),
                                (None, Params(version=version)))
            else:
                continue
            fresh = self._replacement(hashes, s, a)
            if fresh is None:
                continue
            res = self._call(fresh, "write_blocks", [fresh], [arr], [tag], [commit])
            if res is not None and res[0].ok:
                self.books.good.add(key)
                self.books.add(key, int(fresh.object_id), fresh.shard)
                out.append((s, fresh))
            else:
                with contextlib.suppress(Exception):
                    self.meta.evict(fresh.object_id)
        return out

    def _give_back_fresh(self, allocs: Sequence[Any]) -> bool:
        """True if the slot asked first holds an object already (the one to replace); else
        every block this allocation reserved goes back."""
        if allocs[0].existing:
            return True
        for x in allocs:
            if not x.existing:
                with contextlib.suppress(Exception):
                    self.meta.evict(x.handle.object_id)
        return False

    def _replacement(self, hashes: list[BlockHash], s: Slot, old: Any) -> Handle | None:
        """A fresh object in slot ``s`` in place of ``old`` (retired first), or None."""
        try:
            (a,) = self.meta.allocate(hashes, [AllocRequest(
                s[0], s[1], replace=int(old.handle.object_id))], None)
        except HkvError:
            return None
        return None if a.existing else a.handle

    def _write_through(self, hashes: list[BlockHash], done: list[tuple[Slot, Handle]]) -> None:
        """Copy what was just written to the holding shard's disk tier; memory copies stay."""
        results: list[Any] = []
        for i in range(0, len(done), OFFLOAD_BATCH):  # stay under the admission cap
            results += self.dp.offload([h for _, h in done[i : i + OFFLOAD_BATCH]])
        ok = 0
        for (s, h), res in zip(done, results, strict=True):
            if res.ok and res.handle is not None:
                oid = int(res.handle.object_id)
                self._owner_of[oid] = h.shard
                self.disk_oids.add(oid)
                self.books.add((bytes(hashes[s[0]]), s[1]), oid, h.shard)
                ok += 1
            else:
                self.events[f"offload_failed:{res.outcome.value}"] += 1
        self.events["offloaded"] += ok

    def _call(self, h: Handle, method: str, *args: Any) -> Any:
        link = self.dp.shards.get(h.shard)
        if link is None:
            return None
        try:
            return link.submit(method, *args).result(15.0)
        except (ShardUnavailable, HkvError) as exc:
            self.events[f"shard_call_failed:{type(exc).__name__}"] += 1
            return None

    # ---- faults -----------------------------------------------------------------------------

    def inject_evict_race(self, lk: Lookup, pick: int) -> bool:
        """Evict one matched memory block after the (lease-less) lookup, and let another
        writer reuse the freed block: the shard now holds other bytes at the next generation."""
        with self.lock:
            cands = [h for hs in lk.handles.values() for h in hs if h.block >= 0 and h.shard]
            if not cands:
                return False
            h = cands[pick % len(cands)]
            try:
                self.meta.evict(h.object_id)
            except HkvError:
                return False
            noise = np.random.default_rng(pick).integers(0, 256, h.nbytes, dtype=np.uint8)
            reuse = dataclasses.replace(h, generation=h.generation + 1,
                                        object_id=ObjectId(_EMPTY_OBJECT))
            res = self._call(reuse, "write_blocks", [reuse], [noise])
            ok = res is not None and bool(res[0].ok)
            self.events["evict_race_reused" if ok else "evict_race_not_reused"] += 1
            return True  # evicted either way: the read must not serve it

    def push_to_disk(self, lk: Lookup, pick: int) -> bool:
        """Evict the memory copy of one matched block a disk bit flip can land in (COMPRESSED
        or SWA, of 2 KiB or more) whose disk copy the write-through made: the next lookup of
        the prompt loads it. (The lookup's lease is released.)"""
        with self.lock:
            lay = self.layout
            cands = []
            for hs in lk.handles.values():
                for h in hs:
                    col = lay.columns[h.column]
                    if h.block < 0 or col.kind not in (Kind.COMPRESSED, Kind.SWA) or \
                            col.nbytes < 2048:
                        continue
                    key = self.books.key_of.get(int(h.object_id))
                    held = self.books.copies.get(key, {}) if key is not None else {}
                    if any(o in self.disk_oids for o in held):
                        cands.append(h)
            if not cands:
                return False
            h = cands[pick % len(cands)]
            try:
                self.meta.evict(h.object_id)
            except HkvError:
                return False
            self.events["pushed_to_disk"] += 1
            return True

    def inject_disk_bitflip(self, lk: Lookup, pick: int) -> bool:
        """Flip one bit of a record the match is about to load, in its shard's LMDB file."""
        with self.lock:
            lay = self.layout
            cands = []
            for h in lk.match.load:
                col = lay.columns[h.column]
                if col.kind not in (Kind.COMPRESSED, Kind.SWA) or col.nbytes < 2048:
                    continue
                key = self.books.key_of.get(int(h.object_id))
                head = self.books.heads.get(key) if key is not None else None
                if key is not None and head is not None and h.shard:
                    cands.append((h, key, head))
            if not cands:
                return False
            h, key, head = cands[pick % len(cands)]
            if not flip_on_disk(self.wiring.shard_dir(h.shard), head):
                return False
            with self.books.lock:
                self.books.copies.get(key, {}).pop(int(h.object_id), None)
            return True

    def inject_shard_kill(self, lk: Lookup) -> bool:
        """The shard holding a matched block crashes between lookup and read: the read meets a
        dead shard (OWNER_LOST); its successor (empty pools, same disk) starts right after.
        False if it is down already (another worker killed it and no read revived it yet)."""
        shards = sorted({h.shard for hs in lk.handles.values() for h in hs if h.shard})
        if not shards:
            return False
        with self.lock:
            if shards[0] in self._crashed:
                return False
            self.wiring.crash_shard(shards[0])
            self._crashed.add(shards[0])
        return True

    def _revive_crashed(self) -> None:
        with self.lock:
            crashed, self._crashed = self._crashed, set()
            for sid in sorted(crashed):
                self.wiring.revive_shard(sid)
                self.books.lose_memory_of(sid, self.disk_oids)
                self.events["shard_kill"] += 1

    def inject_service_restart(self) -> None:
        """The metadata service restarts under the live shards; they rejoin it."""
        with self.lock:
            snap = self.wiring.stats()
            self.retired.update(_counts(snap.get("transitions")))
            self.retired_downgrades.update(_counts(snap.get("downgrades")))
            self.wiring.restart_service()
            if self.odd_shard is not None:
                # The odd shard's padded pools are a deliberate fault; its copies, misaligned
                # for every reader, would block their slots until evicted (shards keep their
                # memory across a service restart, and a misaligned copy is not replaced).
                # It restarts with every other service restart: misaligned copies stay long
                # enough for readers to meet them, and not for good.
                self._odd_restarts += 1
                # (one a reader already crashed is revived by ``_revive_crashed``, once)
                if self._odd_restarts % 2 == 0 and self.odd_shard not in self._crashed:
                    self.wiring.crash_shard(self.odd_shard)
                    self.wiring.revive_shard(self.odd_shard)
            with self.books.lock:
                self.books.forget_copies(self.disk_oids)
                self._seq = 0
                self._caught_up = 0.0
                self.disk_oids.clear()
                self._owner_of.clear()
            self.faulty.clear()

    # ---- oracle and stats -------------------------------------------------------------------

    def safe_prefix(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """Longest LCM-aligned p <= limit whose needed blocks this backend wrote completely and
        some live, aligned object still holds (its own books, never the funnel), for a reader
        of the spec's own kernel ABI."""
        lay = self.layout
        hb, lcm = lay.hash_block, lay.lcm
        self._sync()
        with self.books.lock:
            for k in range(limit // lcm, 0, -1):
                p = k * lcm
                if all(self.books.safe((bytes(hashes[d]), lay.columns[c].name), self.disk_oids)
                       for d in range(p // hb) for c in needed_columns(lay, d, p)):
                    return int(p)
        return 0

    def stats(self) -> dict[str, Any]:
        snap = self.wiring.stats()
        transitions = Counter(self.retired)
        transitions.update(_counts(snap.get("transitions")))
        downgrades = Counter(self.retired_downgrades)
        downgrades.update(_counts(snap.get("downgrades")))
        return {
            "backend": self.name,
            "disk": "lmdb",
            "transitions": dict(sorted(transitions.items())),
            "downgrades": dict(sorted(downgrades.items())),
            "events": dict(self.events),
            "restarts": self.wiring.restarts,
        }


def _counts(value: object) -> dict[str, int]:
    return {str(k): int(v) for k, v in value.items()} if isinstance(value, Mapping) else {}


def _as_bytes(t: Any) -> np.ndarray:
    arr = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint8).reshape(-1)
