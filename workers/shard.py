"""The cache shard: one per node, owner of a torch block pool per column and of the node's
disk tier. It moves bytes; the metadata service decides states. Made a Ray actor by the
launcher (``ray.remote(max_restarts=...)(ShardActor)``) or run in-process behind a
:class:`~workers.link.InProcessLink`; it imports no Ray.

Lifecycle::

    __init__  spec <- metadata.get_spec(); pools built; disk tier opened (inside the actor);
              register_owner(pools) -> incarnation  (a known owner coming back is marked
              lost first: a restarted shard comes back empty); confirm(ON_DISK reports from
              the disk tier's tags, for records of this spec's ABI only); heartbeat thread
              started.
    heartbeat UnknownOwner (metadata restarted or declared us lost) -> every block but the
              intact ones (tagged object still there) reset to empty, re-register,
              confirm_objects(the intact memory blocks, then the disk tier) in batches; each
              kept block takes its object's new id. A restarted service is back with its
              hits in one pass over what the shard holds.

Data plane (all batched, per-item :class:`~workers.ports.ItemResult`, never raises per item):

* ``write_blocks``: copy all in -> wait readable -> report every item's :class:`Commit`
  in one ``transition_many`` call (each object's events all or none). With
  ``report=False`` the caller reports them (the data plane: a whole request's, across
  shards, in one call) and then says how they went (``settle_blocks``: tags recorded for
  the commits that landed, the other blocks forgotten).
* ``read_blocks``: generation and occupant re-checked right before the copy; stale -> STALE.
* ``offload``: begin_offload -> read -> disk put (tag + payload, checksummed, committed) ->
  OFFLOAD_COMMITTED; failures -> OFFLOAD_FAILED with the reason (admission, disk full ...).
* ``load``: begin_load -> verified disk get (a batched ``get_many_into`` per chunk of items)
  -> write into the reserved block -> LOAD_VERIFIED; checksum mismatch -> MARK_CORRUPT (the
  tier quarantined it); gone -> LOAD_FAILED + EVICT.

Idempotency (a caller may send a call again after a timeout): writes of the same generation and
bytes are harmless; a commit already applied is remembered and not re-sent; a commit refused
because the object already is in the target state counts as done.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from hkv_service.core.api import AdmissionCap, Handle, ObjectReport, Params, PoolConfig
from hkv_service.core.contracts import CONTRACTS
from hkv_service.core.errors import HkvError, Unavailable, UnknownOwner
from hkv_service.core.ids import BlockHash, ObjectId, ShardId
from hkv_service.core.inputs import check_report
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import partition_of_id, partition_of_route
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Event, Kind, State
from hkv_service.settings import SYSTEM_DEFAULTS, SystemSettings, TlsConfig
from storage import CorruptEntry, DiskKey, DiskTier, NotOnDisk

from .commits import commit_many, commit_one, failure
from .control import ControlServer
from .generations import next_floor
from .local import connect
from .partitioned import (
    PartitionedMetadata,
    PartitionsLost,
    partition_count,
    partition_of_block_of,
    pool_ranges,
)
from .pool import BlockPool, HandleBatch, PoolSet, StaleRead, StaleWrite
from .ports import Commit, ItemResult, Outcome, PackedRead, payload_bytes, size_refusal
from .shm import MetaLockTimeout, SegmentInfo, Writer, writer_alive
from .tags import TAG, BlockTag, decode_tagged, encode_tagged, tag_bytes

__all__ = ["PACK_BELOW", "REGISTER_ATTEMPTS", "ShardActor", "ShardConfig", "new_instance"]

PACK_BELOW = 32 * 1024  # read spans smaller than this are packed into one buffer per call
LOAD_CHUNK = 8  # disk loads begun, read and finished together (see ShardActor.load)
CONFIRM_BATCH = 256  # reports per confirm call when the shard registers again
# the stats count of registrations that landed: what a service restart waits for
REGISTRATIONS = "registrations"
REGISTER_ATTEMPTS = 5  # registrations a shard tries before it gives up (see _register)
REGISTER_BACKOFF_S = 0.05  # times the attempt: late loss reports land meanwhile
# A starting shard waits this long for a service it cannot reach (one restarting while Ray
# restarts the shard) before its constructor fails: Ray never restarts an actor whose
# constructor failed, so giving up at once lost the shard for good.
REGISTER_UNREACHABLE_S = 60.0
_WRITTEN = ItemResult(Outcome.OK)  # one shared object: a batch of them pickles as memo refs
_UNREAD = ItemResult(Outcome.FAILED, "not read")  # placeholder while a read is assembled

log = logging.getLogger(__name__)


_HELD = {k: c.ready_state for k, c in CONTRACTS.items()}  # what a block is vouched for in


def heartbeat_interval_s(timeout_s: float) -> float:
    """How often a shard heartbeats a service that declares an owner lost after ``timeout_s``
    of silence: four beats a timeout, at most five a second."""
    return max(0.2, timeout_s / 4)


def new_instance() -> int:
    """A shard process's own id: random, never 0, fits a proto uint64 and a Python int."""
    return secrets.randbits(62) + 1


@dataclass(frozen=True, slots=True)
class ShardConfig:
    shard_id: str
    metadata: Any  # "host:port" (gRPC), a MetadataActor handle, or a MetadataPort
    data_dir: str
    blocks_per_group: int = SYSTEM_DEFAULTS.blocks_per_group
    disk_budget_bytes: int = SYSTEM_DEFAULTS.disk_budget_bytes
    admission: AdmissionCap = field(default_factory=AdmissionCap)  # (the service's defaults)
    heartbeat_interval_s: float = 2.0
    device: str = SYSTEM_DEFAULTS.device
    token: str | None = None
    metadata_timeout_s: float = 10.0
    tls: TlsConfig | None = None  # reaching the service over TLS: roots (+ client cert, mTLS)
    node_id: str = ""  # the node the launcher pinned this shard to (reported by ping)
    # Host pools in a shared-memory segment that workers on this node copy to and from
    # directly (workers.shm, workers.shared); off: every byte goes through Ray.
    shared_memory: bool = True
    # A worker on this node claims the blocks it writes itself, under the pools' locks
    # (workers.pool.Slots), instead of asking this shard on its control socket: a write then
    # calls no other process. Off: every claim is the shard's (one round trip each).
    worker_claims: bool = True
    # Bytes of padding after every pool block. Not 0 only to make a shard whose block stride
    # is no multiple of a reader's alignment (the demo's misaligned_handle fault, tests).
    pool_stride_pad: int = 0

    @classmethod
    def from_settings(cls, settings: SystemSettings, shard_id: str, metadata: Any, *,
                      token: str | None = None, tls: TlsConfig | None = None,
                      node_id: str = "", pool_stride_pad: int = 0) -> ShardConfig:
        """The config of a shard ``hkv up``'s settings place: the one place its pools, disk
        tier, admission cap and heartbeat are derived from them. ``metadata``, ``token`` and
        ``tls``: how it reaches the service (``System.endpoint``/``token``/``tls``)."""
        return cls(
            shard_id, metadata, str(Path(settings.data_dir).resolve()),
            blocks_per_group=settings.blocks_per_group,
            disk_budget_bytes=settings.disk_budget_bytes,
            admission=AdmissionCap(settings.max_inflight_objects, settings.max_inflight_bytes),
            heartbeat_interval_s=heartbeat_interval_s(settings.heartbeat_timeout_s),
            device=settings.device, token=token, tls=tls, node_id=node_id,
            pool_stride_pad=pool_stride_pad,
        )


class ShardActor:
    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.shard_id = ShardId(config.shard_id)
        self.meta: MetadataPort = connect(config.metadata, config.token, config.metadata_timeout_s,
                                          config.tls)
        self.layout = Layout(self.meta.get_spec())
        self.pools = PoolSet(
            {c.name: c.nbytes for c in self.layout.columns}, config.blocks_per_group, config.device,
            config.pool_stride_pad, config.shared_memory,
        )
        path = Path(config.data_dir) / config.shard_id
        path.mkdir(parents=True, exist_ok=True)
        self.disk = DiskTier(path, config.disk_budget_bytes, config.admission)
        self._scratch = np.empty(0, dtype=np.uint8)  # see _scratch_view
        self._lock = threading.RLock()
        self._tags: dict[tuple[str, int], tuple[int, BlockTag]] = {}  # (column, block)
        self._disk_ids: dict[DiskKey, ObjectId] = {}
        self._counts: dict[str, int] = {}
        self.incarnation = 0
        self.floor = 0  # the generation floor of the last registration (workers.generations)
        # this process's own id, registered with the owner: a loss report names the process
        # its failed call went to, never a successor (CacheState.mark_owner_lost)
        self.instance = new_instance()
        self.confirmed = 0
        self._register(unreachable_s=REGISTER_UNREACHABLE_S)
        self._control: ControlServer | None = None  # claims of writers on this node
        if self.pools.segment is not None:
            self._control = ControlServer(self, f"hkv-ctl-{self.pools.segment.nonce.hex()}")
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, name="hkv-heartbeat",
                                      daemon=True)
        self._beat.start()

    # -- registration -----------------------------------------------------------------------

    def _register(self, partitions: frozenset[int] | None = None,
                  unreachable_s: float = 0.0) -> None:
        """Register (again) and vouch for what this shard still holds (``_register_once``).
        Declared lost before its confirms were done, it registers again: a loss report of
        the incarnation before names the owner, not the incarnation, and may land just
        after this one registered (the data plane saw the old process die while Ray was
        starting this one), or the service restarted meanwhile. Raised out of ``__init__``
        the error would end the actor for good: Ray does not restart an actor whose
        constructor failed. Bounded: a service that drops every registration is an error.
        ``unreachable_s``: how long a service that cannot be reached is asked again (the
        constructor's registration; a rejoin is asked again at the next heartbeat instead)."""
        last: UnknownOwner | None = None
        for attempt in range(1, REGISTER_ATTEMPTS + 1):
            try:
                self._register_reachable(partitions, unreachable_s)
                # counted once it landed: a restart waits for this, and a registration that
                # a newer view refused is retried here, not by another rejoin
                self._bump(REGISTRATIONS)
                return
            except UnknownOwner as exc:
                last = exc
                if partitions is not None and isinstance(exc, PartitionsLost):
                    partitions = partitions | exc.partitions  # re-register with those too
            log.warning("shard %s declared lost while registering (attempt %d of %d): %s",
                        self.shard_id, attempt, REGISTER_ATTEMPTS, last)
            time.sleep(REGISTER_BACKOFF_S * attempt)
        raise UnknownOwner(f"shard {self.shard_id} was declared lost during each of its "
                           f"{REGISTER_ATTEMPTS} registrations; is another process "
                           f"registering as {self.shard_id!r}? (last: {last})")

    def _register_reachable(self, partitions: frozenset[int] | None,
                            unreachable_s: float) -> None:
        """``_register_once``, asked again while the service cannot be reached (it is
        restarting) for up to ``unreachable_s``; a registration that reached it is the same
        as a rejoin's, so asking again is safe."""
        deadline = time.monotonic() + unreachable_s
        pause = 0.1
        while True:
            try:
                self._register_once(partitions)
                return
            except Unavailable as exc:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("shard %s cannot reach the metadata service (%s); registering "
                            "again in %.1f s", self.shard_id, exc, pause)
            time.sleep(pause)
            pause = min(2 * pause, 2.0)

    def _register_once(self, partitions: frozenset[int] | None) -> None:
        """Register (again) and vouch for what this shard still holds: the memory blocks whose
        bytes are intact (a service restart, or a loss the service declared while this
        process lived on), then the disk tier. ``partitions``: only those metadata partitions
        lost us (one restarted); what the others hold is left as it is."""
        with self._lock:
            mine = self._in_partitions(partitions)
            self.floor = next_floor(self.floor, (int(p.generation.max())
                                                 for p in self.pools.pools.values()))
            held = [(g, replace(r, generation=self.floor)) for g, r in self._memory_reports()
                    if mine.block(g, r.block)]
            self._reset_pools({(g, r.block) for g, r in held}, mine)
            pools = {name: replace(cfg, generation_floor=self.floor)
                     for name, cfg in self.pools.configs().items()}
            if partitions is None:
                self.incarnation = self.meta.register_owner(self.shard_id, pools, self.instance)
            else:
                assert isinstance(self.meta, PartitionedMetadata)
                self.incarnation = self.meta.register_owner(
                    self.shard_id, pools, self.instance, partitions=partitions)
            memory = self._confirm_memory(held)
            disk = self._confirm_disk(mine)
            self.confirmed = memory + disk
            which = "" if partitions is None else f" with partitions {sorted(partitions)}"
            log.info("shard %s registered%s (incarnation %d; %d memory and %d disk objects "
                     "confirmed)", self.shard_id, which, self.incarnation, memory, disk)

    def _in_partitions(self, partitions: frozenset[int] | None) -> _Mine:
        return _Mine(partitions, partition_count(self.meta), self.pools.configs())

    def _memory_reports(self) -> list[tuple[str, ObjectReport]]:
        """A report per block whose tagged object still occupies it: written, committed and
        not overwritten since (a write claims the block's object id before it copies, a
        refused commit forgets it, so a block whose id no longer matches its tag may hold
        other bytes and is never vouched for). Only what a confirm takes (``check_report``):
        an indexer never synced, a tail short of its boundary are left out."""
        out = []
        for (group, block), (oid, tag) in self._tags.items():
            pool = self.pools.get(group)
            if pool is None or int(pool.object_id[block]) != oid:
                continue
            col = self.layout.by_name[group]
            report = ObjectReport(tag.block_hash, tag.parent_hash, tag.depth, group,
                                  _HELD[self.layout.columns[col].kind], block,
                                  int(pool.generation[block]), tag.version, tag.lo, tag.hi,
                                  tag.route)
            try:
                check_report(self.layout, report)
            except HkvError:
                continue
            out.append((group, report))
        return out

    def _reset_pools(self, keep: set[tuple[str, int]], mine: _Mine) -> None:
        """Every block of the partitions re-registering to this registration's generation
        floor, as the new registration's fresh pool twin on the service hands it out: empty,
        but ``keep`` (re-confirmed at the floor with the object they hold). No claim handed
        out before is at or above the floor (workers.generations): its write is refused as
        older, in an emptied block and a kept one alike."""
        for group, pool in self.pools.pools.items():
            lo, hi = mine.blocks(group)
            kept = [b for g, b in keep if g == group]
            with pool.slots.lock:  # (a worker on this node may be claiming meanwhile)
                saved = pool.object_id[kept].copy()
                for a, b in zip(lo, hi, strict=True):
                    pool.generation[a:b] = self.floor
                    pool.object_id[a:b] = -1
                pool.object_id[kept] = saved
        self._tags = {k: v for k, v in self._tags.items()
                      if k in keep or not mine.block(k[0], k[1])}
        self._disk_ids = {k: oid for k, oid in self._disk_ids.items() if not mine.object(oid)}

    def _confirm_memory(self, held: list[tuple[str, ObjectReport]]) -> int:
        """Vouch for ``held`` in batches; each block takes the id its object has now, and a
        block the service did not take back is emptied (its bytes are no object's)."""
        total = 0
        for i in range(0, len(held), CONFIRM_BATCH):
            batch = held[i : i + CONFIRM_BATCH]
            ids = self.meta.confirm_objects(self.shard_id, [r for _, r in batch],
                                            self.incarnation)
            ids_of: dict[str, list[tuple[int, int]]] = {}  # group: (block, new id or -1)
            for (group, r), oid in zip(batch, ids, strict=True):
                ids_of.setdefault(group, []).append((r.block, -1 if oid is None else oid))
                if oid is None:  # (at the floor already: _reset_pools)
                    self._tags.pop((group, r.block), None)
                    continue
                self._tags[(group, r.block)] = (oid, self._tags[(group, r.block)][1])
                total += 1
            for group, pairs in ids_of.items():  # one lock per pool: a worker may claim
                pool = self.pools[group]
                with pool.slots.lock:
                    for block, new_id in pairs:
                        pool.object_id[block] = new_id
        return total

    def _confirm_disk(self, mine: _Mine) -> int:
        """Report every verified disk record (of the partitions re-registering) as ON_DISK,
        in batches."""
        reports: list[tuple[DiskKey, ObjectReport]] = []
        total = 0
        for meta in self.disk.scan():
            report = self._report_of(meta.key)
            if report is not None and mine.route(report.route):
                reports.append((meta.key, report))
            if len(reports) >= CONFIRM_BATCH:
                total += self._confirm_disk_batch(reports)
                reports = []
        if reports:
            total += self._confirm_disk_batch(reports)
        return total

    def _confirm_disk_batch(self, batch: list[tuple[DiskKey, ObjectReport]]) -> int:
        ids = self.meta.confirm_objects(self.shard_id, [r for _, r in batch], self.incarnation)
        for (key, _), oid in zip(batch, ids, strict=True):
            if oid is not None:
                self._disk_ids[key] = oid  # its tier evicting it later ends that object
        return sum(1 for oid in ids if oid is not None)

    def _report_of(self, key: DiskKey) -> ObjectReport | None:
        col = self.layout.by_name.get(key.group)
        if col is None:
            return None
        column = self.layout.columns[col]
        # Hashes do not cover the ABI: a record written under another dtype, layout or kernel
        # has this spec's block hash and group name. Its bytes are not this column's, and a
        # load would look under this column's key (NOT_HERE), so it is never vouched for.
        if key.abi_fingerprint != column.abi_fingerprint or key.kind != column.kind.value:
            return None
        try:
            tag, _ = decode_tagged(BlockHash(key.block_hash), self.disk.get(key, wait_s=5.0))
        except (HkvError, ValueError) as exc:  # corrupt (quarantined) or not ours: skip
            log.warning("disk record %s not confirmed: %s", key, exc)
            return None
        return ObjectReport(BlockHash(key.block_hash), tag.parent_hash, tag.depth, key.group,
                            State.ON_DISK, version=tag.version, lo=tag.lo, hi=tag.hi,
                            route=tag.route)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            try:
                self.meta.heartbeat(self.shard_id, self.incarnation)
            except PartitionsLost as lost:  # some metadata partitions restarted
                self._rejoin(lost.partitions)
            except UnknownOwner:
                self._rejoin()
            except Exception as exc:  # service briefly unreachable: try again next beat
                log.warning("heartbeat of %s failed: %s", self.shard_id, exc)

    def _rejoin(self, partitions: frozenset[int] | None = None) -> None:
        """The service (or some of its partitions) forgot us (restart) or declared us lost:
        register again, vouching for the blocks still intact (``_register``)."""
        with self._lock:
            self._bump("rejoins")
            try:
                self._register(partitions)
            except Exception as exc:
                log.warning("re-registering %s failed: %s", self.shard_id, exc)

    # -- writes -----------------------------------------------------------------------------

    def write_blocks(
        self,
        handles: Sequence[Handle],
        arrays: Sequence[Any],
        tags: Sequence[BlockTag | None] | None = None,
        commits: Sequence[Commit | None] | None = None,
        report: bool = True,
    ) -> list[ItemResult]:
        """Copy ``arrays[i]`` into ``handles[i]``'s block; once every copy is readable, report
        all the ``commits`` in one ``transition_many`` call (each object's events all or none).
        ``handles`` may be a :class:`~workers.pool.HandleBatch` (what the data plane sends).
        Results carry the KV version a commit issued, never the handle.

        ``report=False``: the caller reports the commits itself (the data plane, a whole
        request's across shards in one call) once this returns (every OK block is readable
        then); the commits here only size the blocks, and no tag is recorded until the caller
        says how its commits went (:meth:`settle_blocks`): a tag vouches only for bytes whose
        commit landed."""
        batch = HandleBatch.of(handles)
        if len(arrays) != len(batch):
            raise ValueError(f"{len(batch)} handles but {len(arrays)} arrays")
        groups = [c[3] for c in batch.columns]
        tag_of = list(tags) if tags else [None] * len(batch)
        commit_of = list(commits) if commits else [None] * len(batch)
        with self._lock:
            out: list[ItemResult] = []
            written: list[tuple[str, int]] = []
            for i, (slot, oid, gen, block, _) in enumerate(batch.rows.tolist()):
                res = self._sized(batch.columns[slot][1], groups[slot], tag_of[i], commit_of[i],
                                  payload_bytes(arrays[i]))
                if res is None:
                    res = self._copy_in(groups[slot], block, gen, oid, arrays[i])
                    if res.ok:
                        written.append((groups[slot], block))
                out.append(res)
            for group, block in written:  # commits are reported only once bytes are readable
                self.pools[group].wait(block)
            return self._written(batch, out, tag_of, commit_of, report)

    def _written(self, batch: HandleBatch, out: list[ItemResult],
                 tag_of: Sequence[BlockTag | None], commit_of: Sequence[Commit | None],
                 report: bool) -> list[ItemResult]:
        """The end of a write whose ``out`` items are readable: report their commits (or,
        ``report=False``, leave that to the caller), record the tags of those that landed.
        The caller holds the shard lock."""
        if not report:
            self._bump("writes", len(out))
            return out
        done = {i: batch[i] for i, res in enumerate(out)
                if res.ok and (tag_of[i] is not None or commit_of[i] is not None)}
        committed = iter(commit_many(
            self.meta, [(h, c) for i, h in done.items() if (c := commit_of[i]) is not None]))
        for i, h in done.items():
            c = commit_of[i]
            out[i] = self._after_write(h, tag_of[i], c, None if c is None else next(committed))
        self._bump("writes", len(out))
        return out

    def settle_blocks(
        self,
        handles: Sequence[Handle],
        tags: Sequence[BlockTag | None],
        commits: Sequence[Commit | None],
        results: Sequence[ItemResult],
    ) -> list[ItemResult]:
        """How the caller's reports of the commits of a ``write_blocks(report=False)`` went:
        ``results[i]`` is what reporting ``commits[i]`` gave. A block whose commit landed
        gets its tag recorded (as ``write_blocks`` records it), one whose commit was refused
        is forgotten. A block another object holds by now is left alone (its result says
        LOST)."""
        batch = HandleBatch.of(handles)
        if not len(batch) == len(tags) == len(commits) == len(results):
            raise ValueError(f"{len(batch)} handles, {len(tags)} tags, {len(commits)} commits "
                             f"and {len(results)} results")
        with self._lock:
            out = []
            for i in range(len(batch)):
                h = batch[i]
                pool = self.pools.get(h.group)
                if pool is None or not 0 <= h.block < pool.num_blocks:
                    out.append(ItemResult(Outcome.FAILED, f"bad handle: {h.group!r} block "
                                                          f"{h.block}"))
                    continue
                try:  # the read check: is (generation, object) still the block's?
                    pool.check(h.block, h.generation, h.object_id)
                except StaleRead:
                    out.append(ItemResult(Outcome.LOST, "the block holds another object now"))
                    continue
                out.append(self._after_write(h, tags[i], commits[i], results[i]))
            return out

    # -- writes by a worker on this node, straight into the shared segment ----------------

    def shared_pool(self) -> SegmentInfo | None:
        """How a worker on this node maps this shard's pools (:mod:`workers.shared`); None
        when they are not in shared memory (device pools, or ``shared_memory`` off)."""
        seg = self.pools.segment
        if seg is None:
            return None
        return seg.info(self.instance, "" if self._control is None else self._control.name,
                        self.config.worker_claims, self.layout)

    def claim_blocks(self, handles: Sequence[Handle], sizes: Sequence[int], writer: Writer,
                     tags: Sequence[BlockTag | None] | None = None,
                     commits: Sequence[Commit | None] | None = None
                     ) -> list[ItemResult] | None:
        """Let process ``writer`` copy ``sizes[i]`` bytes into ``handles[i]``'s block itself
        (``BlockPool.claim``: the write rules and size checks of :meth:`write_blocks` hold);
        :meth:`finish_blocks` then does what the rest of ``write_blocks`` does. Refused for a
        writer that is not a live process seen from here, or a shard without a shared
        segment: None (write through :meth:`write_blocks`)."""
        batch = HandleBatch.of(handles)
        if len(sizes) != len(batch):
            raise ValueError(f"{len(batch)} handles but {len(sizes)} sizes")
        if self.pools.segment is None or not writer_alive(writer):
            return None
        groups = [c[3] for c in batch.columns]
        tag_of = list(tags) if tags else [None] * len(batch)
        commit_of = list(commits) if commits else [None] * len(batch)
        with self._lock:
            out: list[ItemResult] = []
            for i, (slot, oid, gen, block, _) in enumerate(batch.rows.tolist()):
                res = self._sized(batch.columns[slot][1], groups[slot], tag_of[i], commit_of[i],
                                  int(sizes[i]))
                out.append(res or self._claim_one(groups[slot], block, gen, oid, int(sizes[i]),
                                                  writer))
            self._bump("claims", len(out))
            return out

    def _claim_one(self, group: str, block: int, gen: int, oid: int, nbytes: int,
                   writer: Writer) -> ItemResult:
        pool = self.pools.get(group)
        if pool is None:
            return ItemResult(Outcome.FAILED, f"bad handle: no column {group!r}")
        assert pool.shared, "claims need a pool in the shared segment"
        try:
            with pool.slots.lock:
                return pool.slots.claim_result(block, gen, oid, nbytes, writer)
        except MetaLockTimeout as exc:
            return ItemResult(Outcome.FAILED, str(exc))

    def finish_blocks(self, handles: Sequence[Handle], writer: Writer,
                      tags: Sequence[BlockTag | None] | None = None,
                      commits: Sequence[Commit | None] | None = None,
                      report: bool = True) -> list[ItemResult]:
        """``writer`` copied the bytes of its claims (:meth:`claim_blocks`): make them
        readable and go on as :meth:`write_blocks` does (the same ``report`` choice)."""
        batch = HandleBatch.of(handles)
        groups = [c[3] for c in batch.columns]
        tag_of = list(tags) if tags else [None] * len(batch)
        commit_of = list(commits) if commits else [None] * len(batch)
        with self._lock:
            out = [self._pool_step(groups[slot], lambda p, b=block, g=gen, o=oid:
                                   p.finish(b, g, o, writer))
                   for slot, oid, gen, block, _ in batch.rows.tolist()]
            return self._written(batch, out, tag_of, commit_of, report)

    def release_blocks(self, handles: Sequence[Handle], writer: Writer) -> None:
        """``writer`` gives its claims up (its copy failed): those blocks hold no object."""
        batch = HandleBatch.of(handles)
        with self._lock:
            for slot, oid, gen, block, _ in batch.rows.tolist():
                pool = self.pools.get(batch.columns[slot][3])
                if pool is not None and 0 <= block < pool.num_blocks:
                    pool.release(block, gen, oid, writer)

    def _pool_step(self, group: str, step: Any) -> ItemResult:
        pool = self.pools.get(group)
        if pool is None:
            return ItemResult(Outcome.FAILED, f"bad handle: no column {group!r}")
        try:
            step(pool)
        except StaleWrite as exc:
            return ItemResult(Outcome.STALE, str(exc))
        except (ValueError, IndexError, MetaLockTimeout) as exc:
            return ItemResult(Outcome.FAILED, str(exc))
        return _WRITTEN

    def _sized(self, column: int, group: str, tag: BlockTag | None, commit: Commit | None,
               got: int) -> ItemResult | None:
        return size_refusal(self.layout, column, group, tag.depth if tag else None, commit, got)

    def _copy_in(self, group: str, block: int, generation: int, oid: int,
                 data: Any) -> ItemResult:
        """Write one block; the caller waits until it is readable ("written" is not
        "readable")."""
        return self._pool_step(group, lambda p: p.write(block, generation, data, oid))

    def _after_write(self, h: Handle, tag: BlockTag | None, commit: Commit | None,
                     committed: ItemResult | None) -> ItemResult:
        """``committed``: what reporting ``commit`` gave (None without a commit)."""
        version = 0
        if committed is not None:
            if not committed.ok:
                self.pools[h.group].forget(h.block, h.object_id)
                return committed
            version = committed.version
        if tag is not None and committed is not None:
            # the record of a committed object: what an offload without a tag and a
            # re-confirm after a restart vouch for (never bytes whose commit did not land)
            self._tags[(h.group, h.block)] = (h.object_id, self._final_tag(h, tag, commit, version))
        return ItemResult(Outcome.OK, version=version) if version else _WRITTEN

    def _final_tag(self, h: Handle, tag: BlockTag, commit: Commit | None, version: int) -> BlockTag:
        lo, hi = tag.lo, tag.hi
        column = self.layout.columns[h.column]
        if column.kind is Kind.SWA and not hi:
            lo, hi = self.layout.block_range(h.column, tag.depth)
        m = commit.merged() if commit else Params()
        lo = m.lo if m.lo is not None else lo
        hi = m.hi if m.hi is not None else (m.tail_len if m.tail_len is not None else hi)
        version = m.version if m.version is not None else version
        return BlockTag(tag.block_hash, tag.parent_hash, tag.depth, version or tag.version, lo, hi,
                        tag.route)

    def _commit(self, oid: ObjectId, event: Event, params: Params | None = None,
                generation: int | None = None) -> ItemResult:
        return commit_one(self.meta, oid, event, params, generation)

    # -- reads ------------------------------------------------------------------------------

    def read_blocks(self, handles: Sequence[Handle]) -> PackedRead:
        """Bytes of each handle's block, or a STALE/FAILED result for that item.

        ``handles`` may be a :class:`~workers.pool.HandleBatch` (what the data plane sends: one
        array instead of a pickled object per handle). Every block is checked (readiness,
        then generation and occupant) right before its bytes are taken, under the shard lock.
        Blocks that sit next to each other in a pool, in request order, travel as one span:
        a view into a host pool, which Ray copies into its object store before this actor runs
        its next call (calls to one actor run in order), so no write can land between the
        check and the copy; a device pool's span is copied to the host and re-checked after
        the copy. Spans under ``PACK_BELOW`` bytes are packed into one buffer instead (Ray's
        per-buffer cost would dominate them), and every span of a pool in shared memory (claims
        over the control socket do not wait for Ray's copy of the answer).
        ``len(result) == len(handles)``."""
        batch = HandleBatch.of(handles)
        n = len(batch)
        spans: list[tuple[int, int, int] | ItemResult] = [_UNREAD] * n
        with self._lock:
            slot, blocks = batch.slot_of(), batch.field("block")
            gens, oids = batch.field("generation"), batch.field("object_id")
            pools = [self.pools.get(c[3]) for c in batch.columns]
            ok = np.zeros(n, dtype=bool)
            for s, pool in enumerate(pools):
                idx = np.flatnonzero(slot == s) if len(pools) > 1 else np.arange(n)
                if pool is None:
                    for i in idx.tolist():
                        spans[i] = ItemResult(Outcome.FAILED, f"bad handle: no column "
                                                              f"{batch.columns[s][3]!r}")
                    continue
                inside = (blocks[idx] >= 0) & (blocks[idx] < pool.num_blocks)
                for i in idx[~inside].tolist():
                    spans[i] = ItemResult(Outcome.FAILED, f"bad handle: block {blocks[i]} is "
                                                          f"outside {pool.name!r}")
                idx = idx[inside]
                ok[idx] = pool.readable(blocks[idx], gens[idx], oids[idx])
                self._stale(spans, pool, idx[~ok[idx]], blocks, gens, oids)
            buffers = self._take(spans, np.flatnonzero(ok), pools, slot, blocks, gens, oids)
            self._bump("reads", n)
            return PackedRead(buffers, spans)

    def _take(self, spans: list[tuple[int, int, int] | ItemResult], good: np.ndarray,
              pools: list[BlockPool | None], slot: np.ndarray, blocks: np.ndarray,
              gens: np.ndarray, oids: np.ndarray) -> list[np.ndarray]:
        """Fill ``spans`` for the readable items ``good``: runs of adjacent blocks of one pool
        become one span; returns the buffers (``[packed, *runs]``, no packed one if empty)."""
        if not len(good):
            return []
        b, sl = blocks[good], slot[good]
        joins = np.array([p is not None and p.coalesces() for p in pools])
        brk = np.ones(len(good), dtype=bool)
        brk[1:] = (sl[1:] != sl[:-1]) | (b[1:] != b[:-1] + 1) | ~joins[sl[1:]]
        starts = np.flatnonzero(brk).tolist()
        runs = list(zip(starts, [*starts[1:], len(good)], strict=True))
        small: list[tuple[int, int, int]] = []  # (run start, run end, offset in packed)
        packed = 0
        # A view is safe only while nothing writes between this call and Ray's copy of its
        # answer; claims over the control socket (workers.control) run beside Ray's calls, so
        # a shared pool's spans are all packed (copied, under the lock, into the reused buffer).
        pack_all = self.pools.segment is not None
        for lo, hi in runs:
            pool = pools[int(sl[lo])]
            assert pool is not None
            size = (hi - lo - 1) * pool.stride + pool.nbytes
            if size < PACK_BELOW or pack_all:
                small.append((lo, hi, packed))
                packed += size
        buffers = [self._scratch_view(packed)] if packed else []  # the packed one first
        items = good.tolist()
        small_at = {lo: off for lo, _, off in small}
        for lo, hi in runs:
            pool = pools[int(sl[lo])]
            assert pool is not None
            first, idx = int(b[lo]), good[lo:hi]
            # a shared pool: workers claim its blocks without this shard's lock; check again
            # and copy while none can (a device pool: a write may have raced the copy)
            try:
                with pool.slots.lock if pool.shared else contextlib.nullcontext():
                    data = pool.take(first, hi - lo)
                    if pool.shared or pool.device.type != "cpu":
                        fresh = pool.readable(blocks[idx], gens[idx], oids[idx])
                        self._stale(spans, pool, idx[~fresh], blocks, gens, oids)
                    if lo in small_at:
                        buf, base = 0, small_at[lo]
                        buffers[0][base : base + data.nbytes] = data
                    else:
                        buf, base = len(buffers), 0
                        buffers.append(data)
                    lengths = pool.length[b[lo:hi]].tolist()
            except MetaLockTimeout as exc:  # a stopped worker holds the pool: these items
                for i in items[lo:hi]:     # fail with a sentence, the call does not
                    spans[i] = ItemResult(Outcome.FAILED, str(exc))
                continue
            stride = pool.stride
            for i, blk, n in zip(items[lo:hi], b[lo:hi].tolist(), lengths, strict=True):
                if spans[i] is _UNREAD:  # exactly the object's bytes, never the block's rest
                    spans[i] = (buf, base + (blk - first) * stride, n)
        return buffers

    def _stale(self, spans: list[tuple[int, int, int] | ItemResult], pool: BlockPool,
               idx: np.ndarray, blocks: np.ndarray, gens: np.ndarray, oids: np.ndarray) -> None:
        for i in idx.tolist():
            self._bump("stale_reads")
            try:
                pool.check(int(blocks[i]), int(gens[i]), int(oids[i]))
                detail = "stale"
            except StaleRead as exc:
                detail = str(exc)
            spans[i] = ItemResult(Outcome.STALE, detail)

    def _scratch_view(self, nbytes: int) -> np.ndarray:
        """A reused packing buffer: a fresh 64 MiB array costs ~16k page faults per call.
        Reusing it is safe for the same reason views are: Ray copies a return value out
        before this actor runs its next call."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), dtype=np.uint8)
        return self._scratch[:nbytes]

    # -- offload ----------------------------------------------------------------------------

    def offload(
        self,
        handles: Sequence[Handle],
        tags: Sequence[BlockTag | None] | None = None,
        evict_memory: bool = False,
    ) -> list[ItemResult]:
        """Copy readable memory objects to this node's disk tier (see module docstring)."""
        with self._lock:
            results: list[ItemResult | None] = [None] * len(handles)
            # In chunks no larger than the in-transit cap: each chunk's tickets are returned
            # at commit, so a large batch never runs into the cap it holds itself.
            chunk = max(1, self.config.admission.max_objects)
            for first in range(0, len(handles), chunk):
                staged: list[tuple[int, Handle, DiskKey, bytearray]] = []
                for i in range(first, min(first + chunk, len(handles))):
                    stage = self._stage_offload(handles[i], tags[i] if tags else None)
                    if isinstance(stage, ItemResult):
                        results[i] = stage
                    else:
                        staged.append((i, *stage))
                for i, put in self._put(staged).items():
                    results[i] = put
            if evict_memory:
                for h, res in zip(handles, results, strict=True):
                    if res is not None and res.ok:
                        self._try_evict(h.object_id)
            self._bump("offloads", len(handles))
            return [r or ItemResult(Outcome.FAILED, "not processed") for r in results]

    def _stage_offload(self, h: Handle, tag: BlockTag | None
                       ) -> ItemResult | tuple[Handle, DiskKey, bytearray]:
        known = self._tags.get((h.group, h.block))
        if tag is None and known is not None and known[0] == h.object_id:
            tag = known[1]
        if tag is None:
            return ItemResult(Outcome.FAILED, "no block tag for this object; pass tags")
        try:
            data = self.pools[h.group].read(h.block, h.generation, h.object_id, copy=False)
        except StaleRead as exc:
            return ItemResult(Outcome.STALE, str(exc))
        except MetaLockTimeout as exc:
            return ItemResult(Outcome.FAILED, str(exc))
        try:
            dh = self.meta.begin_offload(h.object_id, self.shard_id)
        except Exception as exc:
            return failure(exc)
        key = DiskKey(bytes(tag.block_hash), h.group, h.kind.value, h.abi_fingerprint)
        return dh, key, encode_tagged(tag, data)

    def _put(self, staged: list[tuple[int, Handle, DiskKey, bytearray]]) -> dict[int, ItemResult]:
        if not staged:
            return {}
        try:
            metas = self.disk.put_many([(key, payload) for _, _, key, payload in staged])
            errors: list[Exception | None] = [None] * len(staged)
        except Exception:  # classify item by item (earlier batches may have committed)
            metas, errors = [], []
            for _, _, key, payload in staged:
                try:
                    metas.append(self.disk.put(key, payload))
                    errors.append(None)
                except Exception as exc:
                    errors.append(exc)
        out: dict[int, ItemResult] = {}
        for (i, dh, key, _), err in zip(staged, errors, strict=True):
            if err is not None:
                self._commit(dh.object_id, Event.OFFLOAD_FAILED)
                out[i] = failure(err)
                continue
            out[i] = self._commit(dh.object_id, Event.OFFLOAD_COMMITTED)
            if out[i].ok:
                self._disk_ids[key] = dh.object_id
                out[i] = ItemResult(Outcome.OK, handle=dh)
        self._report_disk_evictions([k for m in metas for k in m.evicted])
        return out

    def _report_disk_evictions(self, keys: Sequence[DiskKey]) -> None:
        """The tier evicted these records: end their DISK objects."""
        for key in keys:
            oid = self._disk_ids.pop(key, None)
            if oid is not None:
                self._record_gone(oid)

    def _record_gone(self, oid: ObjectId) -> None:
        """The tier no longer holds the record of DISK object ``oid``: end the object, not only
        its loaded copy. ``evict`` of a loaded one (ON_DISK_READY) drops the memory copy and
        leaves it ON_DISK, claiming bytes that are gone; the second ``evict`` ends it. Both are
        policy, refused while a reader holds the copy; this owner's next load of the object
        then ends it (``_begin_load``)."""
        self._try_evict(oid)
        self._try_evict(oid)

    def _try_evict(self, oid: ObjectId) -> None:
        try:
            self.meta.evict(oid)
        except HkvError as exc:  # leased, already gone ...: the policy keeps it; fine
            log.debug("evict %s refused: %s", oid, exc)

    # -- load -------------------------------------------------------------------------------

    def load(self, items: Sequence[tuple[Handle, BlockHash]], hold_s: float = 0.0
             ) -> list[ItemResult]:
        """Bring DISK objects at rest (``ON_DISK``) back into this shard's pools, verified.
        Each item is ``(disk handle, block hash)``; records this shard's tier lacks -> NOT_HERE.
        ``hold_s`` > 0 keeps the first chunk's begun loads in flight that long before reading
        them, as a slow device does (the demo's slow_disk_load fault: readers meanwhile see
        ON_DISK_INFLIGHT, never the reserved block's bytes).

        In chunks of :data:`LOAD_CHUNK` (fewer under a smaller in-transit cap): each chunk's
        loads begin together, its records come out of the tier in one verified batch
        (``get_many_into``, copied and checked on two threads), then each load finishes.
        Small chunks keep the metadata service's in-transit count, shared by every shard,
        far from its cap.
        """
        chunk = max(1, min(LOAD_CHUNK, self.config.admission.max_objects))
        with self._lock:
            out: list[ItemResult] = []
            for first in range(0, len(items), chunk):
                out += self._load_chunk(items[first : first + chunk], hold_s if not first else 0.0)
            self._bump("loads", len(items))
            return out

    def _load_chunk(self, items: Sequence[tuple[Handle, BlockHash]], hold_s: float = 0.0
                    ) -> list[ItemResult]:
        out: list[ItemResult | None] = [None] * len(items)
        begun: list[tuple[int, BlockHash, DiskKey, Handle]] = []
        for i, (dh, block_hash) in enumerate(items):
            began = self._begin_load(dh, block_hash)
            if isinstance(began, ItemResult):
                out[i] = began
            else:
                begun.append((i, block_hash, *began))
        if hold_s > 0 and begun:
            time.sleep(hold_s)
        fetched = self._fetch([key for _, _, key, _ in begun],
                              [TAG.size + mh.nbytes for _, _, _, mh in begun])
        for (i, block_hash, key, mh), record in zip(begun, fetched, strict=True):
            out[i] = self._end_load(mh, key, block_hash, record)
        return [r or ItemResult(Outcome.FAILED, "not processed") for r in out]

    def _begin_load(self, dh: Handle, block_hash: BlockHash
                    ) -> ItemResult | tuple[DiskKey, Handle]:
        key = DiskKey(bytes(block_hash), dh.group, dh.kind.value, dh.abi_fingerprint)
        if not self.disk.contains(key):
            if dh.shard == self.shard_id:
                # Ours, at rest, and the tier no longer has it (evicted while a reader held the
                # loaded copy, so the eviction report was refused): end the claim, or every
                # lookup would keep offering a load that cannot succeed.
                self._commit(dh.object_id, Event.LOSE)
            return ItemResult(Outcome.NOT_HERE, "this shard's disk tier has no such record")
        try:
            return key, self.meta.begin_load(dh.object_id, self.shard_id)
        except Exception as exc:
            return failure(exc)

    def _fetch(self, keys: list[DiskKey], sizes: list[int]) -> list[memoryview | Exception]:
        """Each key's verified record, or what went wrong with it. One batch read into one
        fresh buffer; a record that fails it is set aside (a corrupt one was quarantined by
        the tier) and the rest read again; anything else, and the loads are read one by one
        as exact-size copies, so every key gets its own verdict."""
        buffer = np.empty(sum(sizes), np.uint8)
        bounds = np.cumsum([0, *sizes])
        outs = [buffer[bounds[j] : bounds[j + 1]] for j in range(len(keys))]
        results: list[memoryview | Exception | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        while todo:
            try:
                got = self.disk.get_many_into([keys[j] for j in todo], [outs[j] for j in todo],
                                              wait_s=1.0)
            except CorruptEntry as exc:
                bad = [j for j in todo if keys[j].to_bytes() == exc.key]
                if not bad:
                    break
                results[bad[0]] = exc
                todo.remove(bad[0])
                continue
            except Exception:  # each key is classified below, one by one
                break
            for j, n in zip(todo, got, strict=True):
                results[j] = outs[j].data[:n]
            todo = []
        for j in todo:
            try:
                results[j] = memoryview(self.disk.get(keys[j], wait_s=1.0))
            except Exception as exc:
                results[j] = exc
        return [r if r is not None else RuntimeError("not read") for r in results]

    def _end_load(self, mh: Handle, key: DiskKey, block_hash: BlockHash,
                  record: memoryview | Exception) -> ItemResult:
        try:
            if isinstance(record, Exception):
                raise record
            tag, payload = decode_tagged(block_hash, record)
            want = tag_bytes(self.layout, mh.column, tag)
            if len(payload) != want:
                raise ValueError(f"payload is {len(payload)} bytes, its object has {want}")
        except (CorruptEntry, ValueError) as exc:
            self._bump("corrupt")
            self._commit(mh.object_id, Event.MARK_CORRUPT)
            self._disk_ids.pop(key, None)
            return ItemResult(Outcome.CORRUPT, str(exc))
        except Exception as exc:
            self._commit(mh.object_id, Event.LOAD_FAILED)
            if isinstance(exc, NotOnDisk):  # evicted since contains(): gone, like above
                self._record_gone(mh.object_id)
            return failure(exc)
        return self._finish_load(mh, key, tag, payload)

    def _finish_load(self, mh: Handle, key: DiskKey, tag: BlockTag,
                     payload: memoryview) -> ItemResult:
        pool = self.pools[mh.group]
        try:
            pool.write(mh.block, mh.generation, np.frombuffer(payload, np.uint8), mh.object_id)
        except StaleWrite as exc:
            self._commit(mh.object_id, Event.LOAD_FAILED)
            return ItemResult(Outcome.STALE, str(exc))
        pool.wait(mh.block)
        res = self._commit(mh.object_id, Event.LOAD_VERIFIED, None, mh.generation)
        if not res.ok:
            pool.forget(mh.block, mh.object_id)
            return res
        self._tags[(mh.group, mh.block)] = (mh.object_id, tag)
        self._disk_ids[key] = mh.object_id
        return ItemResult(Outcome.OK, handle=mh)

    # -- introspection ----------------------------------------------------------------------

    def ping(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id, "incarnation": self.incarnation,
                "instance": self.instance, "pid": os.getpid(),
                "node_id": self.config.node_id, "device": str(self.pools.device),
                "time": time.time()}

    def stats(self) -> dict[str, Any]:
        disk = self.disk.stats()
        return {
            "shard_id": self.shard_id,
            "incarnation": self.incarnation,
            "confirmed": self.confirmed,
            "device": str(self.pools.device),
            "pool_bytes": self.pools.nbytes(),
            "data_dir": str(Path(self.config.data_dir) / self.config.shard_id),
            "counts": self._all_counts(),
            "disk": {"entries": disk.entries, "bytes_used": disk.bytes_used,
                     "corruption": disk.corruption, "quarantined": disk.quarantined,
                     "puts": disk.puts, "gets": disk.gets},
        }

    def _all_counts(self) -> dict[str, int]:
        """This shard's counts, with the claims and finishes workers made themselves."""
        counts = dict(self._counts)
        if self.pools.segment is not None:
            claims, finishes = self.pools.segment.worker_counts()
            for name, n in (("claims", claims), ("writes", finishes)):
                if n:
                    counts[name] = counts.get(name, 0) + n
        return counts

    def shutdown(self) -> None:
        """Stop heartbeats and close the disk tier (the launcher calls this before a kill)."""
        self._stop.set()
        if threading.current_thread() is not self._beat:
            self._beat.join(self.config.metadata_timeout_s + 1.0)
        with self._lock:
            self.disk.close()
            if self.pools.segment is not None:  # workers let go at their next copy
                self.pools.segment.close()
            if self._control is not None:
                self._control.close()

    def _bump(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n


@dataclass(frozen=True, slots=True)
class _Mine:
    """Which blocks, records and ids belong to the metadata partitions re-registering
    (``partitions`` None: all of them, the whole service). Each partition's range of a pool
    is the one ``PartitionedMetadata`` registered it with (``pool_ranges``)."""

    partitions: frozenset[int] | None
    count: int
    pools: dict[str, PoolConfig]

    def block(self, group: str, block: int) -> bool:
        return self.partitions is None or partition_of_block_of(
            self.pools[group], block, self.count) in self.partitions

    def blocks(self, group: str) -> tuple[list[int], list[int]]:
        """The block ranges [lo, hi) of ``group``'s pool these partitions hand out."""
        which = range(self.count) if self.partitions is None else sorted(self.partitions)
        spans = [pool_ranges(self.pools, i, self.count)[group] for i in which]
        return [c.first for c in spans], [c.num_blocks for c in spans]

    def route(self, key: int) -> bool:
        return self.partitions is None or partition_of_route(key, self.count) in self.partitions

    def object(self, oid: int) -> bool:
        return self.partitions is None or partition_of_id(oid, self.count) in self.partitions
