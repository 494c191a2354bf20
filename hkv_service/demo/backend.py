"""The cache the demo's workers drive: a small protocol and its in-process implementation.

:class:`InProcessBackend` is the quickstart fallback and works without gRPC or Ray: one
:class:`CacheState` (the metadata view, funnel and checks) plus what owners would hold:

* a block store per shard keyed by ``(shard, column, block)`` that keeps the object id and the
  generation of every block it holds and re-checks both on every read (the shard's half of the
  TOCTOU check); it learns of evictions and losses from the view's transition log, as a shard
  told to free blocks would;
* a disk tier: the real LMDB :class:`storage.DiskTier` in a temp dir (xxh3-128 verified on
  every load), or an in-memory dict with xxhash checksums when ``storage`` is unavailable;
* a side catalog of what every object is (prefix hash, parent, depth, version, lo/hi) so the
  view can be rebuilt from the owners' reports after a service restart.

Writers commit in the order the transition rules need: COMPRESSED/SWA ``WRITE_DONE``, tails
``TAIL_DONE`` with their length, indexers ``WRITE_DONE`` then ``INDEXER_SYNC`` at the c4 KV's
version. Bytes always land before the transition that makes them readable.

TEST ONLY: with ``HKV_UNSAFE_DISABLE_LAYER3=1`` (or ``UNSAFE_DISABLE_LAYER3 = True``) the
backend reports hash-level hits (``matched_tokens`` cut to whole LCM blocks) and reads whatever
the objects there hold, bypassing the funnel's intersection check. See tests/demo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import xxhash

from hkv_service.core.allocator import PoolConfig
from hkv_service.core.errors import HkvError, IllegalTransition, PoolExhausted
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.hashing import content_version
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.layout import Column, Layout
from hkv_service.core.records import Handle
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import (
    Allocation,
    AllocRequest,
    CacheState,
    Match,
    ObjectReport,
)
from hkv_service.core.states import TERMINAL_STATES, Event, Kind, Reason, State
from hkv_service.core.transitions import Params
from hkv_service.refmodel import BlockRun
from hkv_service.testing import pools_for

__all__ = [
    "ALIGNMENT",
    "UNSAFE_DISABLE_LAYER3",
    "CacheBackend",
    "InProcessBackend",
    "Lookup",
    "ReadResult",
    "WriteOptions",
    "layer3_disabled",
]

UNSAFE_DISABLE_LAYER3 = False  # TEST ONLY; see module docstring
ALIGNMENT = 128  # bytes every handle must be aligned to (c128 blocks are 128 bytes)
LEASE_TTL_S = 30.0
OFFLOAD_BATCH = 32  # objects per LMDB commit (under the admission cap of 64 in transit)
MISALIGNED_DEPTHS = 8  # the last entries a misaligned writer places (512 tokens)
Blocks = dict[str, Mapping[int, torch.Tensor]]  # per column: {block: tensor} or a BlockRun
Tails = dict[str, tuple[torch.Tensor, int]]


def layer3_disabled() -> bool:
    return UNSAFE_DISABLE_LAYER3 or os.environ.get("HKV_UNSAFE_DISABLE_LAYER3") == "1"


@dataclass
class Lookup:
    """A Match plus what the backend needs to read it safely."""

    match: Match
    usable: int
    hashes: Sequence[BlockHash]
    epoch: int
    incarnations: dict[str, int]
    handles: dict[str, tuple[Handle, ...]]
    lease_id: LeaseId | None


@dataclass
class ReadResult:
    blocks: Blocks | None = None
    tails: Tails | None = None
    reason: str | None = None  # set when the read failed: recompute

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


class CacheBackend(Protocol):
    """What the workload drives."""

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        resume_tokens: int,
        reader_abi: Mapping[str, int] | None = None,
        lease: bool = True,
    ) -> Lookup: ...
    def load(self, lk: Lookup, slow: bool = False) -> list[str]: ...
    def settle(self) -> list[str]: ...
    def inject_evict_race(self, lk: Lookup, pick: int) -> bool: ...
    def inject_disk_bitflip(self, lk: Lookup, pick: int) -> bool: ...
    def inject_shard_kill(self, lk: Lookup) -> bool: ...
    def inject_service_restart(self) -> None: ...
    def read(self, lk: Lookup) -> ReadResult: ...
    def release(self, lk: Lookup) -> None: ...
    def write(
        self,
        hashes: Sequence[BlockHash],
        blocks: Mapping[int, Mapping[str, torch.Tensor]],
        tails: Mapping[int, Mapping[str, tuple[torch.Tensor, int]]],
        opts: WriteOptions = WriteOptions(),
    ) -> WriteReport: ...
    def safe_prefix(
        self, hashes: Sequence[BlockHash], limit: int, abi_ok: bool = True
    ) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def _counts(value: object) -> dict[str, int]:
    return dict(value) if isinstance(value, Mapping) else {}


def _needed_columns(lay: Any, depth: int, p: int) -> list[int]:
    """Columns whose block at ``depth`` a reader resuming at ``p`` needs (own rule, not the
    funnel's): every compressed/indexer block, the tails at p, SWA blocks meeting [p-W, p)."""
    end = (depth + 1) * lay.hash_block
    out = []
    for c in lay.attached[depth % lay.period]:
        col = lay.columns[c]
        if col.kind is Kind.TAIL and end != p:
            continue
        if col.kind is Kind.SWA and end <= p - col.group.window:
            continue
        out.append(c)
    return out


def place_block(blocks: Blocks, tails: Tails, lay: Layout, col: Column, depth: int,
                tensor: torch.Tensor, usable: int) -> None:
    """File one read block where ``RefModel.import_cache`` wants it: a tail with the number of
    raw tokens it holds at ``usable``, any other block under its index in its own group."""
    if col.kind is Kind.TAIL:
        tails[col.group.name] = (tensor, col.tail_tokens_at(usable))
    else:
        end = (depth + 1) * lay.hash_block
        have = blocks.get(col.name)
        if not isinstance(have, dict):
            have = blocks[col.name] = dict(have or {})
        have[end // col.group.block_size - 1] = tensor


def place_column(blocks: Blocks, tails: Tails, lay: Layout, col: Column,
                 depths: Sequence[int], arrays: Sequence[np.ndarray], usable: int) -> None:
    """File one column's read blocks (``arrays[i]`` ends at hash block ``depths[i]``).

    Blocks that are consecutive in their group (what a reader needs always is) are stacked
    into one :class:`BlockRun` with one copy of the column's bytes, which ``import_cache``
    adopts as the group's rows; anything else (a tail, a gap, a misshapen block) is filed
    block by block with a copy each, and import names what is wrong."""
    ks = [((d + 1) * lay.hash_block) // col.group.block_size - 1 for d in depths]
    if col.kind is not Kind.TAIL and ks and ks == list(range(ks[0], ks[0] + len(ks))):
        try:
            stacked = np.stack(arrays)  # the one copy
        except ValueError:  # shapes differ: block by block below
            pass
        else:
            blocks[col.name] = BlockRun(ks[0], torch.from_numpy(stacked))
            return
    for d, a in zip(depths, arrays, strict=True):
        place_block(blocks, tails, lay, col, d, torch.from_numpy(np.array(a, copy=True)), usable)


# ---- owner-side records ---------------------------------------------------------------------


@dataclass
class _Slot:
    """One block in a shard's pool: what the shard knows about the bytes it holds."""

    object_id: int
    generation: int
    data: np.ndarray
    key: tuple[bytes, str]  # (block hash, column)
    good: bool  # the writer finished writing correct bytes (oracle bookkeeping)
    state: State
    disk: bool = False  # a loaded copy of a disk object


@dataclass
class _Meta:
    """Catalog entry: enough to re-report an object after a service restart."""

    parent: bytes | None
    depth: int
    version: int = 0
    lo: int = 0
    hi: int = 0


@dataclass
class _DiskRec:
    object_id: int
    good: bool  # bytes on disk are what was written (no flip)
    version: int
    lo: int
    hi: int


class _MemDisk:
    """Fallback disk tier: bytes + xxh3-128 checksum, verified on get."""

    def __init__(self) -> None:
        self.data: dict[tuple[bytes, str], tuple[bytearray, bytes]] = {}

    def put(self, key: tuple[bytes, str], payload: bytes) -> None:
        self.data[key] = (bytearray(payload), xxhash.xxh3_128_digest(payload))

    def get(self, key: tuple[bytes, str]) -> bytes:
        raw, digest = self.data[key]
        if xxhash.xxh3_128_digest(bytes(raw)) != digest:
            del self.data[key]
            raise _Corrupt(f"checksum mismatch for {key[1]}")
        return bytes(raw)

    def flip(self, key: tuple[bytes, str], offset: int) -> bool:
        raw, _ = self.data[key]
        raw[offset % len(raw)] ^= 1 << 3
        return True

    def close(self) -> None:
        self.data.clear()


class _Corrupt(Exception):
    pass


class _Disk:
    """The real LMDB disk tier when the ``storage`` package is importable, else _MemDisk."""

    def __init__(self, budget: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="hkv-demo-disk-")
        self.mem: _MemDisk | None = None
        self.tier: Any = None
        self.abi: dict[str, int] = {}
        try:
            from hkv_service.core.admission import AdmissionCap
            from storage import DiskTier

            self.tier = DiskTier(self.dir, budget, AdmissionCap(max_objects=64, max_bytes=1 << 28))
        except Exception:
            self.mem = _MemDisk()
        self.kind = "lmdb" if self.tier is not None else "memory"

    def _key(self, key: tuple[bytes, str], kind: Kind, abi: int) -> Any:
        from storage import DiskKey

        return DiskKey(key[0], key[1], kind.value, abi)

    def put(self, key: tuple[bytes, str], kind: Kind, abi: int, payload: bytes) -> None:
        if self.mem is not None:
            self.mem.put(key, payload)
        else:
            self.tier.put(self._key(key, kind, abi), payload)

    def put_many(self, items: Sequence[tuple[tuple[bytes, str], Kind, int, bytes]]) -> None:
        if self.mem is not None:
            for key, _, _, payload in items:
                self.mem.put(key, payload)
        else:
            self.tier.put_many([(self._key(k, kind, abi), p) for k, kind, abi, p in items])

    def get(self, key: tuple[bytes, str], kind: Kind, abi: int) -> bytes:
        if self.mem is not None:
            return self.mem.get(key)
        from storage import CorruptEntry, NotOnDisk

        try:
            return bytes(self.tier.get(self._key(key, kind, abi)))
        except (CorruptEntry, NotOnDisk) as err:
            raise _Corrupt(str(err)) from err

    def flip(self, key: tuple[bytes, str], payload: bytes) -> bool:
        """Flip one bit of every copy of ``payload`` in the store's file."""
        if self.mem is not None:
            return self.mem.flip(key, 101)
        needle = payload[:64]
        flipped = False
        for path in Path(self.dir).rglob("data.mdb"):
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
                    spots = []
                    at = mm.find(needle)
                    while at >= 0:
                        spots.append(at)
                        at = mm.find(needle, at + 1)
                for at in spots:
                    off = at + min(100, len(payload) - 1)
                    byte = os.pread(fd, 1, off)
                    os.pwrite(fd, bytes([byte[0] ^ (1 << 3)]), off)
                    flipped = True
            finally:
                os.close(fd)
        return flipped

    def corruption(self) -> int:
        return int(self.tier.stats().corruption) if self.tier is not None else 0

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- the in-process backend -----------------------------------------------------------------


class InProcessBackend:
    """CacheState + per-shard block stores + a disk tier, all in this process."""

    name = "inprocess"

    def __init__(
        self,
        spec: CacheSpec,
        shapes: Mapping[str, tuple[int, ...]],
        *,
        shards: int = 2,
        pool_blocks: int = 256,
        misaligned_shard: bool = False,
        disk_budget: int = 1 << 30,
    ) -> None:
        self.spec = spec
        self.shapes = dict(shapes)
        self.pool_blocks = pool_blocks
        self.lock = threading.RLock()
        self.shard_ids = [ShardId(f"shard-{i}") for i in range(shards)]
        self.odd_shard = ShardId("shard-odd") if misaligned_shard else None
        self.disk_owner = ShardId("disk-0")
        self.disk = _Disk(disk_budget)
        self.slots: dict[tuple[str, int, int], _Slot] = {}
        self.by_oid: dict[int, tuple[str, int, int]] = {}
        self.where: dict[tuple[bytes, str], tuple[str, int, int]] = {}  # key -> mem slot
        self.meta: dict[tuple[bytes, str], _Meta] = {}
        self.on_disk: dict[tuple[bytes, str], _DiskRec] = {}
        self.disk_by_oid: dict[int, tuple[bytes, str]] = {}
        self.inflight: list[tuple[int, int]] = []  # (disk oid, settle at tick) slow loads
        self.tick = 0
        self.epoch = 0
        self.incarnation: dict[str, int] = {}
        self.retired: Counter[str] = Counter()  # transition counts of views before a restart
        self.retired_downgrades: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.state = self._new_state()
        self._seq = 0

    # ---- setup ------------------------------------------------------------------------------

    def _pools(self, base_align: int, odd: bool = False) -> dict[str, PoolConfig]:
        pools = pools_for(Layout(self.spec), self.pool_blocks, base_align)
        if odd:  # misaligned_handle: every block of this shard starts 32 bytes off
            pools = {n: PoolConfig(p.num_blocks, p.stride + 32, p.base_align)
                     for n, p in pools.items()}
        return pools

    def _new_state(self) -> CacheState:
        state = CacheState(self.spec)
        for s in self.shard_ids:
            self.incarnation[s] = state.register_owner(s, self._pools(4096))
        if self.odd_shard is not None:
            self.incarnation[self.odd_shard] = state.register_owner(
                self.odd_shard, self._pools(32, odd=True)
            )
        self.incarnation[self.disk_owner] = state.register_owner(self.disk_owner, {})
        return state

    @property
    def layout(self) -> Any:
        return self.state.layout

    def close(self) -> None:
        self.disk.close()

    # ---- the owners learn what the view did -------------------------------------------------

    def _drain(self) -> None:
        """Free the bytes of objects the view evicted, lost or dropped (as a shard is told)."""
        events = self.state.events_since(self._seq, limit=1 << 30)
        if events:
            self._seq = events[-1].seq
        for ev in events:
            if ev.kind is Kind.DISK:
                if ev.state in TERMINAL_STATES:
                    key = self.disk_by_oid.pop(ev.object_id, None)
                    if key is not None:
                        self.on_disk.pop(key, None)
                if ev.state in TERMINAL_STATES or ev.state is State.ON_DISK:
                    self._free(ev.object_id)
            elif ev.state in TERMINAL_STATES:
                self._free(ev.object_id)

    def _free(self, oid: int) -> None:
        loc = self.by_oid.pop(oid, None)
        if loc is None:
            return
        slot = self.slots.get(loc)
        if slot is not None and slot.object_id == oid:
            del self.slots[loc]
            if self.where.get(slot.key) == loc:
                del self.where[slot.key]

    def _put_slot(self, h: Handle, data: np.ndarray, key: tuple[bytes, str], good: bool,
                  state: State, disk: bool = False) -> None:
        loc = (h.shard, h.column, h.block)
        old = self.slots.get(loc)
        if old is not None:
            self.by_oid.pop(old.object_id, None)
            if self.where.get(old.key) == loc:
                del self.where[old.key]
        self.slots[loc] = _Slot(h.object_id, h.generation, data, key, good, state, disk)
        self.by_oid[h.object_id] = loc
        if not disk:
            self.where[key] = loc

    # ---- lookup / load / read ---------------------------------------------------------------

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        resume_tokens: int,
        reader_abi: Mapping[str, int] | None = None,
        lease: bool = True,
    ) -> Lookup:
        with self.lock:
            self.tick += 1
            self._settle_loads()
            self._drain()
            req = LookupRequest(
                hashes, resume_tokens, dict(reader_abi) if reader_abi else None, ALIGNMENT,
                LEASE_TTL_S if lease else 0.0,
            )
            m = self.state.lookup(req)
            usable, handles = m.usable_tokens, dict(m.handles)
            if layer3_disabled() and not reader_abi:
                usable = self._hash_level_hit(hashes, resume_tokens)
                handles = self._unsafe_handles(hashes, usable)
            return Lookup(m, usable, hashes, self.epoch, dict(self.incarnation), handles,
                          m.lease_id)

    def _key_of_handle(self, h: Handle) -> tuple[bytes, str] | None:
        loc = self.by_oid.get(h.object_id)
        if loc is not None and loc in self.slots:
            return self.slots[loc].key
        return self.disk_by_oid.get(h.object_id)

    def _hash_level_hit(self, hashes: Sequence[BlockHash], limit: int) -> int:
        """TEST ONLY: tokens whose hash blocks the view knows at all, cut to whole LCM blocks."""
        n = 0
        while n < limit // self.layout.hash_block and hashes[n] in self.state.index:
            n += 1
        return int((n * self.layout.hash_block // self.layout.lcm) * self.layout.lcm)

    def _unsafe_handles(self, hashes: Sequence[BlockHash], usable: int
                        ) -> dict[str, tuple[Handle, ...]]:
        """TEST ONLY: every object at the needed positions, whatever its state."""
        out: dict[str, list[Handle]] = {}
        lay = self.layout
        for d in range(usable // lay.hash_block):
            e = self.state.index.get(hashes[d])
            if e is None:
                break
            for col in _needed_columns(lay, d, usable):
                rec = e.mem[col] or (e.disk[col] if e.disk else None)
                if rec is not None:
                    out.setdefault(lay.columns[col].name, []).append(self.state._handle(rec))
        return {k: tuple(v) for k, v in out.items()}

    def load(self, lk: Lookup, slow: bool = False) -> list[str]:
        """Bring the disk objects ``lk`` needs back into memory. Returns failure reasons.

        ``slow``: leave the loads in flight (ON_DISK_INFLIGHT) until a later lookup settles them.
        """
        reasons: list[str] = []
        with self.lock:
            self._drain()
            load = lk.match.load if not layer3_disabled() else tuple(
                h for col in lk.handles.values() for h in col if h.block < 0  # a DISK copy at rest
            )
            for h in load:
                rec = self.state.objects.get(h.object_id)
                if rec is None or rec.state is not State.ON_DISK:
                    continue
                try:
                    got = self.state.begin_load(h.object_id, self._roomiest())
                except HkvError:
                    reasons.append(Reason.ADMISSION.value)
                    continue
                if slow:
                    shape = self._shape(got.group)
                    key = self.disk_by_oid[h.object_id]
                    # the block is reserved but holds no bytes yet: zeros
                    self._put_slot(got, np.zeros(shape, np.float32), key, False,
                                   State.ON_DISK_INFLIGHT, disk=True)
                    self.inflight.append((h.object_id, self.tick + 3))
                    continue
                reason = self._finish_load(h.object_id, got)
                if reason:
                    reasons.append(reason)
            self._drain()
        return reasons

    def _finish_load(self, oid: ObjectId | int, got: Handle) -> str | None:
        key = self.disk_by_oid[oid]
        rec = self.state.objects[ObjectId(oid)]
        try:
            raw = self.disk.get(key, rec.inner or Kind.DISK, self._abi(rec.column))
        except _Corrupt:
            self.state.transition(ObjectId(oid), Event.MARK_CORRUPT)
            self.events["corrupt_load"] += 1
            self._drain()
            return Reason.CORRUPT.value
        shape = self._shape(got.group)
        data = np.frombuffer(raw, np.float32).reshape(-1, *shape[1:]).copy()
        self._put_slot(got, data, key, self.on_disk[key].good, State.ON_DISK_READY, disk=True)
        self.state.transition(ObjectId(oid), Event.LOAD_VERIFIED)
        return None

    def settle(self) -> list[str]:
        """Finish every load left in flight now (the reader waited for them); returns why
        any failed (a flipped bit: CORRUPT)."""
        with self.lock:
            self.tick += 1 << 20
            reasons = self._settle_loads()
            self.tick -= 1 << 20
            self._drain()
            return reasons

    def _settle_loads(self) -> list[str]:
        keep, reasons = [], []
        for oid, at in self.inflight:
            rec = self.state.objects.get(ObjectId(oid))
            if rec is None or rec.state is not State.ON_DISK_INFLIGHT:
                continue
            if at > self.tick:
                keep.append((oid, at))
                continue
            reason = self._finish_load(oid, self.state._handle(rec))
            if reason:
                reasons.append(reason)
        self.inflight = keep
        return reasons

    def _abi(self, column: int) -> int:
        return int(self.layout.columns[column].group.abi.fingerprint())

    def _shape(self, column: str) -> tuple[int, ...]:
        return self.shapes[column]

    def read(self, lk: Lookup) -> ReadResult:
        """Bytes of every handle, in token order, after the owner's generation re-check.

        Per handle: the view's ``check_read`` (lease, generation, state) and the shard's own
        re-check of the slot; per column, one copy of the bytes (see :func:`place_column`)."""
        lay = self.layout
        unsafe = layer3_disabled()  # TEST ONLY: readiness not re-validated
        blocks: Blocks = {}
        tails: Tails = {}
        with self.lock:
            if lk.epoch != self.epoch:
                return ReadResult(reason=Reason.STALE_HANDLE.value)  # the view was rebuilt
            self._drain()
            shards = {h.shard for handles in lk.handles.values() for h in handles if h.shard}
            if any(self.incarnation.get(s) != lk.incarnations.get(s) for s in shards):
                return ReadResult(reason=Reason.OWNER_LOST.value)
            check_read, slots, meta = self.state.check_read, self.slots, self.meta
            lease = lk.lease_id
            for col_name, handles in lk.handles.items():
                col = lay.columns[lay.by_name[col_name]]
                depths: list[int] = []
                arrays: list[np.ndarray] = []
                for h in handles:
                    if not unsafe:
                        try:
                            check_read(h, lease)
                        except HkvError:  # StaleHandle, LeaseExpired, ...
                            return ReadResult(reason=Reason.STALE_HANDLE.value)
                    slot = slots.get((h.shard, h.column, h.block))
                    if slot is None and unsafe:
                        data = np.zeros(self._shape(col_name), np.float32)  # never written
                        key = self._key_of_handle(h)
                    elif slot is None or slot.generation != h.generation or (
                        slot.object_id != h.object_id
                    ):
                        return ReadResult(reason=Reason.STALE_HANDLE.value)
                    else:
                        data, key = slot.data, slot.key
                    if key is None:
                        return ReadResult(reason=Reason.STALE_HANDLE.value)
                    depths.append(meta[key].depth)
                    arrays.append(data)
                # copied under the lock, as a shard copies out while the generation holds
                place_column(blocks, tails, lay, col, depths, arrays, lk.usable)
        return ReadResult(blocks, tails)

    def release(self, lk: Lookup) -> None:
        with self.lock:
            if lk.lease_id is not None and lk.epoch == self.epoch:
                with contextlib.suppress(HkvError):
                    self.state.release_lease(lk.lease_id)

    # ---- write ------------------------------------------------------------------------------

    def write(
        self,
        hashes: Sequence[BlockHash],
        blocks: Mapping[int, Mapping[str, torch.Tensor]],
        tails: Mapping[int, Mapping[str, tuple[torch.Tensor, int]]],
        opts: WriteOptions = WriteOptions(),
    ) -> WriteReport:
        rep = WriteReport()
        lay = self.layout
        last = max(set(blocks) | set(tails), default=-1)
        # A faulty KV/indexer is the first new one: every later reader of the prefix walks
        # through it. A stalled tail is the newest one, the tail still being appended: where
        # the next turn of the conversation resumes.
        stalled_tail = max(tails, default=-1)
        first = min(set(blocks) | set(tails), default=-1)
        written: list[int] = []

        def place(d: int) -> ShardId:
            # a misaligned writer's last MISALIGNED_DEPTHS entries land on the odd shard
            if opts.owner and d > last - MISALIGNED_DEPTHS:
                return ShardId(opts.owner)
            return self._roomiest()

        with self.lock:
            self._drain()
            for d in sorted(set(blocks) | set(tails)):
                cols: dict[str, Any] = dict(blocks.get(d, {}))
                for g, (t, n) in tails.get(d, {}).items():
                    cols[f"{g}.tail"] = (t, n)
                order = sorted(cols, key=lambda c: lay.columns[lay.by_name[c]].kind is Kind.INDEXER)
                here = WriteOptions(
                    partial_tail=opts.partial_tail and d == stalled_tail,
                    stale_indexer=opts.stale_indexer and d == first,
                )
                if not self._write_entry(hashes, d, order, cols, place(d), here, rep):
                    break
                written.append(d)
            self._drain()
            self._write_through([bytes(hashes[d]) for d in written])
        return rep

    def _write_entry(self, hashes: Sequence[BlockHash], d: int, order: list[str],
                     cols: Mapping[str, Any], owner: ShardId | None, opts: WriteOptions,
                     rep: WriteReport) -> bool:
        lay = self.layout
        versions: dict[str, int] = {}
        new: list[ObjectId] = []
        allocs = []
        for name in order:
            try:
                a = self.state.allocate(hashes[: d + 1], [AllocRequest(d, name)], owner)[0]
            except PoolExhausted:
                rep.pool_exhausted += 1
                for oid in new:  # give back what this entry reserved but never wrote
                    if oid in self.state.objects:
                        self.state.transition(oid, Event.EVICT)
                return False
            allocs.append((name, a))
            if not a.existing:
                new.append(a.handle.object_id)
        parent = bytes(hashes[d - 1]) if d else None
        key_of = {name: (bytes(hashes[d]), name) for name in order}
        for name, a in allocs:
            col = lay.columns[lay.by_name[name]]
            h, key = a.handle, key_of[name]
            rec = self.state.objects.get(h.object_id)
            if col.kind is Kind.COMPRESSED and rec is not None:
                versions[name] = rec.version
            if a.existing and not self._repairable(a, col, versions):
                rep.existing += 1
                continue
            if col.kind is Kind.TAIL:
                tensor, n = cols[name]
                data = tensor.numpy().astype(np.float32, copy=True)
                if opts.partial_tail and n >= 2 and col.group.name == "c4" and not a.existing:
                    half = n // 2
                    data[half:] = 0.0  # the stalled writer never wrote these rows
                    self._put_slot(h, data, key, False, State.TAIL_PARTIAL)
                    self.state.transition(h.object_id, Event.TAIL_APPEND, Params(tail_len=half))
                    self.meta[key] = _Meta(parent, d, hi=half)
                    rep.faults["partial_tail"] += 1
                    continue
                self._put_slot(h, data, key, True, State.TAIL_COMPLETE)
                self.state.transition(h.object_id, Event.TAIL_DONE, Params(tail_len=n))
                self.meta[key] = _Meta(parent, d, hi=n)
            elif col.kind is Kind.INDEXER:
                data = cols[name].numpy().astype(np.float32, copy=True)
                kv = lay.columns[col.indexes or 0].name
                version = versions.get(kv)
                if opts.stale_indexer and not a.existing and not self._disk_copy(d, hashes, col):
                    # the KV was rewritten after these keys were computed: old bytes, no sync
                    old = np.roll(data, 1, axis=0) * 0.5
                    self._put_slot(h, old, key, False, State.INDEXER_WRITTEN)
                    self.state.transition(h.object_id, Event.WRITE_DONE)
                    self.meta[key] = _Meta(parent, d)
                    rep.faults["stale_indexer"] += 1
                    continue
                if version is None:
                    continue
                if not a.existing or a.state is State.INDEXER_SYNCED:
                    try:  # keys (re)written; refused while a reader holds them
                        self.state.transition(h.object_id, Event.WRITE_DONE)
                    except IllegalTransition:
                        continue
                if a.existing:
                    rep.repaired += 1
                self._put_slot(h, data, key, True, State.INDEXER_SYNCED)
                self.state.transition(h.object_id, Event.INDEXER_SYNC, Params(version=version))
                self.meta[key] = _Meta(parent, d, version=version)
            else:
                data = cols[name].numpy().astype(np.float32, copy=True)
                ready = State.SWA_VALID if col.kind is Kind.SWA else State.COMPRESSED_READY
                self._put_slot(h, data, key, True, ready)
                # a KV's version is its content version, as the data plane reports it
                p = Params(version=content_version(data)) if col.kind is Kind.COMPRESSED \
                    else Params()
                res = self.state.transition(h.object_id, Event.WRITE_DONE, p)
                if col.kind is Kind.COMPRESSED:
                    versions[name] = res.version
                r = self.state.objects[h.object_id]
                self.meta[key] = _Meta(parent, d, version=res.version, lo=r.lo, hi=r.hi)
            rep.written += 1
        return True

    def _roomiest(self) -> ShardId:
        """The regular shard with the most free blocks (never the misaligned one)."""
        return max(
            self.shard_ids,
            key=lambda s: min(p.free_count() for p in self.state.owners[s].pools.values()),
        )

    def _disk_copy(self, d: int, hashes: Sequence[BlockHash], col: Column) -> bool:
        """A disk copy of this slot exists: a reader would load it (correctly) past any bad
        memory copy, so a fault injected in memory here would never be seen."""
        e = self.state.index.get(hashes[d])
        return e is not None and e.disk is not None and e.disk[col.index] is not None

    def _repairable(self, a: Allocation, col: Column, versions: Mapping[str, int]) -> bool:
        """A stalled tail or an unsynced indexer is completed by the next writer with fresh
        bytes; so is an indexer synced to a KV version that moved on (its KV was evicted and
        rewritten while the indexer was held): left alone it would be INDEXER_STALE forever."""
        if a.state in (State.TAIL_PARTIAL, State.INDEXER_WRITTEN):
            return True
        if col.kind is not Kind.INDEXER or a.state is not State.INDEXER_SYNCED:
            return False
        kv = versions.get(self.layout.columns[col.indexes or 0].name)
        rec = self.state.objects.get(a.handle.object_id)
        return kv is not None and rec is not None and rec.version != kv

    # ---- write-through to the disk tier -----------------------------------------------------

    def _write_through(self, block_hashes: Sequence[bytes]) -> None:
        """Copy every readable object of the entries just written to the disk tier, in batches
        (one LMDB commit each). Memory copies stay; when the view evicts them under pool
        pressure the disk copy remains and a later reader loads it back."""
        todo = []
        for bh in block_hashes:
            e = self.state.index.get(BlockHash(bh))
            if e is None:
                continue
            for rec in e.mem:
                if rec is None or rec.state in TERMINAL_STATES:
                    continue
                key = (bh, self.layout.columns[rec.column].name)
                loc = self.by_oid.get(rec.object_id)
                slot = self.slots.get(loc) if loc else None
                if slot is not None and key not in self.on_disk:
                    todo.append((rec, key, slot))
        for i in range(0, len(todo), OFFLOAD_BATCH):
            self._offload_batch(todo[i : i + OFFLOAD_BATCH])
        self._drain()

    def _offload_batch(self, batch: list[tuple[Any, tuple[bytes, str], _Slot]]) -> None:
        started = []
        for rec, key, slot in batch:
            try:
                dh = self.state.begin_offload(rec.object_id, self.disk_owner)
            except HkvError:  # not readable (partial tail, stale indexer) or admission refused
                continue
            started.append((rec, key, slot, dh))
        if not started:
            return
        try:
            self.disk.put_many(
                [(key, rec.kind, self._abi(rec.column), slot.data.tobytes())
                 for rec, key, slot, _ in started]
            )
        except Exception as err:  # any disk failure rolls the copies back
            self.events[f"offload_failed:{type(err).__name__}"] += 1
            for *_, dh in started:
                self.state.transition(dh.object_id, Event.OFFLOAD_FAILED)
            return
        for rec, key, slot, dh in started:
            self.state.transition(dh.object_id, Event.OFFLOAD_COMMITTED)
            self.on_disk[key] = _DiskRec(dh.object_id, slot.good, rec.version, rec.lo, rec.hi)
            self.disk_by_oid[dh.object_id] = key
        self.events["offloaded"] += len(started)

    # ---- faults -----------------------------------------------------------------------------

    def inject_evict_race(self, lk: Lookup, pick: int) -> bool:
        """Evict one matched memory block after the lookup and let another writer reuse it."""
        with self.lock:
            cands = [h for col in lk.handles.values() for h in col if h.kind is not Kind.DISK]
            cands = [h for h in cands if h.object_id in self.state.objects]
            if not cands:
                return False
            h = cands[pick % len(cands)]
            try:
                self.state.evict(h.object_id)
            except HkvError:
                return False
            self._drain()
            loc = (h.shard, h.column, h.block)
            noise = np.random.default_rng(pick).standard_normal(self._shape(h.group))
            owner = self.state.owners.get(h.shard)
            pool = owner.pools.get(h.column) if owner is not None else None
            if pool is None:
                return True
            self.slots[loc] = _Slot(-1, pool.generation[h.block], noise.astype(np.float32),
                                    (b"", h.group), False, State.ALLOCATED)
            return True

    def inject_disk_bitflip(self, lk: Lookup, pick: int) -> bool:
        """Flip a bit of a block at rest that ``lk`` needs to load (its checksum must catch it)."""
        with self.lock:
            lay = self.layout
            cands = []
            for h in lk.match.load:
                key = self.disk_by_oid.get(h.object_id)
                col = lay.columns[h.column]
                if key is None or col.kind not in (Kind.COMPRESSED, Kind.SWA) or col.nbytes < 2048:
                    continue
                if self.on_disk[key].good:
                    cands.append(key)
            if not cands:
                return False
            key = sorted(cands)[pick % len(cands)]
            rec = self.state.objects[ObjectId(self.on_disk[key].object_id)]
            try:
                payload = self.disk.get(key, rec.inner or Kind.DISK, self._abi(rec.column))
            except _Corrupt:  # an earlier flip of identical bytes already hit this record
                self.on_disk[key].good = False
                return False
            if not self.disk.flip(key, payload):
                return False
            self.on_disk[key].good = False
            return True

    def inject_shard_kill(self, lk: Lookup) -> bool:
        """The shard holding a matched block dies; it comes back empty (new incarnation)."""
        with self.lock:
            shards = sorted({h.shard for col in lk.handles.values() for h in col if h.shard})
            if not shards:
                return False
            s = ShardId(shards[0])
            self.state.mark_owner_lost(s)
            for loc in [loc for loc in self.slots if loc[0] == s]:
                slot = self.slots.pop(loc)
                self.by_oid.pop(slot.object_id, None)
                if self.where.get(slot.key) == loc:
                    del self.where[slot.key]
            odd = s == self.odd_shard
            self.incarnation[s] = self.state.register_owner(
                s, self._pools(32 if odd else 4096, odd=odd)
            )
            self._drain()
            return True

    def inject_service_restart(self) -> None:
        """Rebuild the view from what the owners report; nothing else is trusted."""
        with self.lock:
            self._drain()
            old = self.state.stats()
            self.retired.update(_counts(old["transitions"]))
            self.retired_downgrades.update(_counts(old["downgrades"]))
            # loads in flight are rolled back: their reserved blocks hold nothing
            for oid, _ in self.inflight:
                self._free(oid)
            self.inflight = []
            for loc in [loc for loc, s in self.slots.items() if s.disk or s.object_id < 0]:
                slot = self.slots.pop(loc)
                self.by_oid.pop(slot.object_id, None)
            self.epoch += 1
            self.state = self._new_state()
            self._seq = 0
            by_owner: dict[str, list[ObjectReport]] = {}
            for loc, slot in self.slots.items():
                m = self.meta.get(slot.key)
                if m is None:
                    continue
                by_owner.setdefault(loc[0], []).append(ObjectReport(
                    BlockHash(slot.key[0]), BlockHash(m.parent) if m.parent else None, m.depth,
                    slot.key[1], slot.state, loc[2], slot.generation, m.version, m.lo, m.hi,
                ))
            for key, d in self.on_disk.items():
                m = self.meta.get(key)
                if m is None:
                    continue
                by_owner.setdefault(self.disk_owner, []).append(ObjectReport(
                    BlockHash(key[0]), BlockHash(m.parent) if m.parent else None, m.depth,
                    key[1], State.ON_DISK, version=d.version, lo=d.lo, hi=d.hi,
                ))
            for owner, reports in by_owner.items():
                self.state.confirm(ShardId(owner), reports, self.incarnation[owner])
            # re-key the owners' books by the ids the new view gave out
            self.by_oid.clear()
            self.disk_by_oid.clear()
            kept: dict[tuple[str, int, int], _Slot] = {}
            for rec in list(self.state.objects.values()):
                name = self.layout.columns[rec.column].name
                key = (bytes(rec.entry.block_hash), name)
                if rec.kind is Kind.DISK:
                    self.on_disk[key].object_id = rec.object_id
                    self.disk_by_oid[rec.object_id] = key
                    continue
                loc = (rec.shard, rec.column, rec.block)
                slot = self.slots[loc]
                slot.object_id, slot.generation = rec.object_id, rec.generation
                kept[loc] = slot
                self.by_oid[rec.object_id] = loc
            self.slots = kept
            self.where = {s.key: loc for loc, s in kept.items()}
            self.on_disk = {k: v for k, v in self.on_disk.items() if v.object_id in
                            self.disk_by_oid}
            log = self.state.events_since(0, limit=1 << 30)
            self._seq = log[-1].seq if log else 0

    # ---- oracle -----------------------------------------------------------------------------

    def safe_prefix(self, hashes: Sequence[BlockHash], limit: int, abi_ok: bool = True) -> int:
        """Longest L-aligned p <= limit whose needed blocks are all held, complete and unfaulted,
        from the owners' own books (never from the funnel)."""
        if not abi_ok:
            return 0
        lay = self.layout
        hb, lcm = lay.hash_block, lay.lcm
        with self.lock:
            self._drain()
            for k in range(limit // lcm, 0, -1):
                p = k * lcm
                if all(
                    self._safe(bytes(hashes[d]), lay.columns[c].name)
                    for d in range(p // hb)
                    for c in _needed_columns(lay, d, p)
                ):
                    return int(p)
        return 0

    def _safe(self, h: bytes, col: str) -> bool:
        key = (h, col)
        loc = self.where.get(key)
        if loc is not None:
            slot = self.slots.get(loc)
            if loc[0] == self.odd_shard:
                return False  # a misaligned memory copy is what a reader would be handed
            if slot is not None and slot.good:
                return True
        d = self.on_disk.get(key)
        if d is None or not d.good:
            return False
        rec = self.state.objects.get(ObjectId(d.object_id))
        return rec is not None and rec.state in (State.ON_DISK, State.ON_DISK_READY)

    # ---- stats ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.lock:
            snap = self.state.stats()
            transitions = Counter(self.retired)
            transitions.update(_counts(snap["transitions"]))
            downgrades = Counter(self.retired_downgrades)
            downgrades.update(_counts(snap["downgrades"]))
            return {
                "backend": self.name,
                "disk": self.disk.kind,
                "transitions": dict(sorted(transitions.items())),
                "downgrades": dict(sorted(downgrades.items())),
                "gauges": snap["gauges"],
                "events": dict(self.events),
                "disk_corruption": self.disk.corruption(),
                "epoch": self.epoch,
            }
