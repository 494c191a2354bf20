"""The demo's cache on the real system: ``hkv serve`` + Ray shard actors + their LMDB tiers.

:class:`SystemBackend` starts the embedded system with :func:`workers.launcher.start_system`
(a local Ray instance it owns, ``hkv serve`` as a subprocess on 127.0.0.1, shards pinned to
the node, each with its disk tier under ``data_dir``) and drives it the way an inference worker
would:

* lookup -> ``MetadataClient.lookup`` (gRPC), with a lease unless the worker races an evict;
* load -> ``DataPlane.load`` (the shards' verified disk loads), read -> ``DataPlane.read`` (the
  shard re-checks generation and occupant right before copying; a :class:`Recompute` becomes a
  ``ReadResult`` carrying its reason);
* write -> ``DataPlane.write_prefix`` (COMPRESSED/SWA/TAIL committed first, then indexers
  WRITE_DONE + INDEXER_SYNC at the KV version), then a write-through ``DataPlane.offload`` of
  what was written to the shard's disk tier (memory copies stay);
* safe_prefix -> the backend's own books of what it wrote completely, kept current by a
  ``Watch`` stream of transitions (evictions, losses, re-confirmations), never the funnel.

Faults that map onto the real system: ``evict_race``, ``partial_tail``, ``stale_indexer``,
``shard_kill``, ``abi_mismatch``, ``pool_pressure``. The others (:data:`UNSUPPORTED_FAULTS`)
are not injected here: ``run.py`` takes them out of the plan and the report says so.

Attaching to an existing endpoint is not supported: reads and writes need the shards' Ray
actor handles, which a bare gRPC endpoint does not give (see :data:`ENDPOINT_NOTE`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hkv_service.core.errors import HkvError
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.ids import BlockHash, ObjectId
from hkv_service.core.layout import Layout
from hkv_service.core.records import Handle
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import AllocRequest
from hkv_service.core.states import TERMINAL_STATES, Event, Kind, Reason
from hkv_service.core.transitions import Params

from .backend import (
    ALIGNMENT,
    LEASE_TTL_S,
    OFFLOAD_BATCH,
    Blocks,
    Lookup,
    ReadResult,
    Tails,
    WriteOptions,
    WriteReport,
    _needed_columns,
    place_column,
)

__all__ = ["ENDPOINT_NOTE", "UNSUPPORTED_FAULTS", "SystemBackend"]

Emit = Callable[[str], None]
Key = tuple[bytes, str]  # (block hash, column name)
Slot = tuple[int, str]  # (depth, column name)

UNSUPPORTED_FAULTS: dict[str, str] = {
    "service_restart": "restarting `hkv serve` under live shards is not wired in the demo",
    "disk_bitflip": "the shards' LMDB files are not patched from the demo",
    "slow_disk_load": "shard loads complete within the call; none is left in flight",
    "misaligned_handle": "every shard's pools are 256-byte aligned; no odd shard exists",
}
ENDPOINT_NOTE = (
    "--endpoint: attaching to a running service is not supported by the demo (reads and "
    "writes need the shards' Ray actor handles, which an endpoint does not give); starting "
    "an embedded system instead"
)
RESTART_WAIT_S = 60.0
_EMPTY_OBJECT = -1  # the pool's "no occupant" object id
_NO_OPTS = WriteOptions()


class _Books:
    """What this backend wrote completely, and which live objects still hold it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.good: set[Key] = set()
        self.mem: dict[Key, dict[int, str]] = {}  # key -> {object id: shard}
        self.disk: dict[Key, set[int]] = {}
        self.key_of: dict[int, Key] = {}
        self.dead: set[int] = set()

    def add_mem(self, key: Key, oid: int, shard: str) -> None:
        with self.lock:
            if oid in self.dead:
                return
            self.mem.setdefault(key, {})[oid] = shard
            self.key_of[oid] = key

    def add_disk(self, key: Key, oid: int) -> None:
        with self.lock:
            if oid in self.dead:
                return
            self.disk.setdefault(key, set()).add(oid)
            self.key_of[oid] = key

    def gone(self, oid: int) -> None:
        with self.lock:
            self.dead.add(oid)
            key = self.key_of.pop(oid, None)
            if key is None:
                return
            self.mem.get(key, {}).pop(oid, None)
            self.disk.get(key, set()).discard(oid)

    def lose_shard(self, shard: str) -> None:
        with self.lock:
            for held in self.mem.values():
                for oid in [o for o, s in held.items() if s == shard]:
                    del held[oid]

    def known(self) -> set[int]:
        with self.lock:
            return set(self.key_of) | self.dead

    def safe(self, key: Key) -> bool:
        return key in self.good and bool(self.mem.get(key) or self.disk.get(key))


class SystemBackend:
    """The CacheBackend over a self-started hkv system (metadata service + Ray shards)."""

    name = "system"
    odd_shard = None  # misaligned_handle is not injected on this backend

    def __init__(
        self,
        spec: CacheSpec,
        shapes: Mapping[str, tuple[int, ...]],
        *,
        pool_blocks: int = 192,
        shards_per_node: int = 2,
        data_dir: str | os.PathLike[str] = "hkv-data",
        disk_budget: int = 1 << 30,
        emit: Emit | None = None,
        start_timeout_s: float = 90.0,
    ) -> None:
        import ray

        from workers.launcher import (
            NAMESPACE,
            SystemConfig,
            init_local_ray,
            start_system,
            worker_pythonpath,
        )

        self.spec = spec
        self.shapes = dict(shapes)
        self.layout = Layout(spec)
        self.say = emit or (lambda _msg: None)
        self.events: Counter[str] = Counter()
        self.books = _Books()
        self.lock = threading.RLock()  # allocations + block reuse by this process
        self.incarnation: dict[str, int] = {}
        self.faulty: dict[Key, int] = {}  # partial tails / unsynced indexers we left behind
        self.system: Any = None
        self.client: Any = None
        self.dp: Any = None
        self.pids: list[int] = []
        self.alignment = ALIGNMENT
        self._ray_started = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._data_dir = Path(data_dir).resolve()
        self._shard_dirs: list[Path] = []
        self._closed = False
        try:
            if not ray.is_initialized():
                self.say("starting a local Ray instance")
                init_local_ray(address="local", include_dashboard=False, log_to_driver=False,
                               namespace=NAMESPACE, num_cpus=max(2, os.cpu_count() or 2),
                               runtime_env={"env_vars": {"PYTHONPATH": worker_pythonpath()}})
                self._ray_started = True
                self.pids += _ray_pids()
            config = SystemConfig(
                data_dir=str(self._data_dir), blocks_per_group=pool_blocks,
                disk_budget_bytes=disk_budget, shards_per_node=shards_per_node,
                max_restarts=1000, device="auto", start_timeout_s=start_timeout_s,
                heartbeat_timeout_s=30.0,
            )
            self.system = start_system(config, self.say)
            if self.system.service is not None:
                self.pids.append(self.system.service.pid)
            self.client = self.system.metadata()
            self.dp = self.system.dataplane(timeout_s=15.0)
            names = {c.name for c in self.dp.layout.columns}
            if names != {c.name for c in self.layout.columns}:
                raise RuntimeError(f"the service runs another cache spec (columns {names})")
            for sid, actor in self.system.shards.items():
                info = ray.get(actor.ping.remote(), timeout=start_timeout_s)
                self.incarnation[sid] = int(info["incarnation"])
                self._shard_dirs.append(self._data_dir / sid)
            self._watcher = threading.Thread(target=self._watch, name="hkv-demo-watch",
                                             daemon=True)
            self._watcher.start()
        except BaseException:
            self.close()
            raise

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the watcher, the shards, the service and Ray (if ours); remove the shards'
        data directories this run created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5.0)
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        if self.system is not None:
            with contextlib.suppress(Exception):
                self.system.stop(self.say)
        import ray

        if self._ray_started and ray.is_initialized():
            ray.shutdown()
        for d in self._shard_dirs:
            shutil.rmtree(d, ignore_errors=True)
        with contextlib.suppress(OSError):
            self._data_dir.rmdir()  # only if this run left it empty

    def _watch(self) -> None:
        """Follow the transition log: objects evicted, lost or corrupt leave the books; disk
        records re-confirmed after a shard restart come back into them."""
        from hkv_service.client import MetadataClient

        assert self.system is not None
        seq = 0
        with MetadataClient(self.system.endpoint, token=self.system.token) as watcher:
            while not self._stop.is_set():
                try:
                    for ev in watcher.watch(seq, timeout_s=1.0):
                        seq = max(seq, ev.seq)
                        if ev.state in TERMINAL_STATES:
                            self.books.gone(int(ev.object_id))
                        elif ev.kind is Kind.DISK:
                            key = (bytes(ev.block_hash), str(ev.column))
                            if key in self.books.good:
                                self.books.add_disk(key, int(ev.object_id))
                        if self._stop.is_set():
                            return
                except Exception as exc:  # service going down at close, or a hiccup
                    self.events[f"watch_error:{type(exc).__name__}"] += 1
                    self._stop.wait(0.5)

    # ---- lookup / load / read ---------------------------------------------------------------

    def lookup(
        self,
        hashes: Sequence[BlockHash],
        resume_tokens: int,
        reader_abi: Mapping[str, int] | None = None,
        lease: bool = True,
    ) -> Lookup:
        req = LookupRequest(list(hashes), resume_tokens, dict(reader_abi) if reader_abi else None,
                            self.alignment, LEASE_TTL_S if lease else 0.0)
        incarnations = dict(self.incarnation)
        m = self.client.lookup(req)
        for _ in range(2):
            # DISK_INFLIGHT here means another worker's load is running (loads finish within
            # one shard call, under self.lock): wait for it to land rather than recompute.
            if not any(d.reason is Reason.DISK_INFLIGHT for d in m.downgrades):
                break
            if m.lease_id is not None:
                with contextlib.suppress(Exception):
                    self.client.release_lease(m.lease_id)
            with self.lock:
                self.events["waited_for_inflight_load"] += 1
            m = self.client.lookup(req)
        return Lookup(m, m.usable_tokens, hashes, 0, incarnations, dict(m.handles), m.lease_id)

    def load(self, lk: Lookup, slow: bool = False) -> list[str]:
        """Load the match's disk objects on the shards (``slow`` is not supported here)."""
        from workers.dataplane import Recompute

        if not lk.match.needs_load:
            return []
        with self.lock:
            got = self.dp.load(lk.match, list(lk.hashes))
        if isinstance(got, Recompute):
            self.events[f"load_failed:{got.reason.value}"] += 1
            return [got.reason.value]
        self.events["loaded"] += len(got)
        return []

    def settle(self) -> list[str]:
        """Loads finish within ``load``: nothing is left in flight."""
        return []

    def read(self, lk: Lookup) -> ReadResult:
        from workers.dataplane import Recompute

        for hs in lk.handles.values():
            for h in hs:
                if h.shard and self.incarnation.get(h.shard) != lk.incarnations.get(h.shard):
                    return ReadResult(reason=Reason.OWNER_LOST.value)  # died since the lookup
        out = self.dp.read(lk.match, list(lk.hashes), release=False)
        if isinstance(out, Recompute):
            self.events[f"read_recompute:{out.reason.value}"] += 1
            return ReadResult(reason=out.reason.value)
        lay = self.layout
        blocks: Blocks = {}
        tails: Tails = {}
        for name, arrays in out.items():
            col = lay.columns[lay.by_name[name]]
            depths = lay.needed_depths(lay.by_name[name], lk.usable)
            if len(depths) != len(arrays):
                return ReadResult(reason=Reason.MISSING_COMPONENT.value)
            shape = self.shapes[name]
            # views of the shard's bytes; place_column copies each column once
            views = [np.ascontiguousarray(arr).view(np.float32).reshape(-1, *shape[1:])
                     for arr in arrays]  # a tail: exactly its rows
            place_column(blocks, tails, lay, col, depths, views, lk.usable)
        return ReadResult(blocks, tails)

    def release(self, lk: Lookup) -> None:
        if lk.lease_id is not None:
            with contextlib.suppress(Exception):
                self.client.release_lease(lk.lease_id)

    # ---- write ------------------------------------------------------------------------------

    def write(
        self,
        hashes: Sequence[BlockHash],
        blocks: Mapping[int, Mapping[str, torch.Tensor]],
        tails: Mapping[int, Mapping[str, tuple[torch.Tensor, int]]],
        opts: WriteOptions = _NO_OPTS,
    ) -> WriteReport:
        from workers.ports import Commit

        rep = WriteReport()
        hashes = list(hashes)
        first = min(set(blocks) | set(tails), default=-1)
        first_tail = min(tails, default=-1)
        data: dict[Slot, np.ndarray] = {}
        tail_data: dict[Slot, tuple[np.ndarray, int]] = {}
        for d, cols in blocks.items():
            for name, t in cols.items():
                data[(d, name)] = _as_bytes(t)
        for d, tcols in tails.items():
            for g, (t, n) in tcols.items():
                tail_data[(d, f"{g}.tail")] = (_as_bytes(t[:n]), n)  # exactly its rows
        special: dict[Slot, tuple[np.ndarray, Commit, str]] = {}
        # a stalled c4 tail writer: half the rows, TAIL_APPEND, never TAIL_DONE
        slot = (first_tail, "c4.tail")
        if opts.partial_tail and slot in tail_data and tail_data[slot][1] >= 2:
            arr, n = tail_data.pop(slot)
            half = n // 2
            rows = tails[first_tail]["c4"][0].numpy()[:half].astype(np.float32, copy=True)
            special[slot] = (_as_bytes(rows), Commit((Event.TAIL_APPEND,),
                                                     (Params(tail_len=half),)), "partial_tail")
        # an indexer whose keys are old bytes: WRITE_DONE, never INDEXER_SYNC
        slot = (first, "idx")
        if opts.stale_indexer and slot in data:
            old = np.roll(blocks[first]["idx"].numpy().astype(np.float32), 1, axis=0) * 0.5
            data.pop(slot)
            special[slot] = (_as_bytes(old), Commit((Event.WRITE_DONE,)), "stale_indexer")
        with self.lock:
            wr = self.dp.write_prefix(hashes, data, tail_data)
            rep.written += wr.written
            rep.existing += wr.existing
            if wr.failed:
                self.events["write_failed"] += len(wr.failed)
                rep.pool_exhausted += sum("xhaust" in r.detail for r in wr.failed.values())
            done: list[tuple[Slot, Handle]] = []
            known = self.books.known() | set(self.faulty.values())
            for s, h in sorted(wr.handles.items()):
                if s in wr.failed or int(h.object_id) in known:
                    continue  # failed, or an object that was already there
                key = (bytes(hashes[s[0]]), s[1])
                self.books.good.add(key)
                self.books.add_mem(key, int(h.object_id), h.shard)
                done.append((s, h))
            for s, (arr, commit, fault) in sorted(special.items()):
                if self._write_special(hashes, s, arr, commit):
                    rep.faults[fault] += 1
            repaired = self._repair(hashes, data, tail_data, wr)
            rep.repaired += len(repaired)
            done += repaired
            self._write_through(hashes, done)
        return rep

    def _write_special(self, hashes: list[BlockHash], s: Slot, arr: np.ndarray,
                       commit: Any) -> bool:
        """Allocate one slot and write it with ``commit`` (a fault: never readable)."""
        from workers.ports import BlockTag

        d, name = s
        try:
            a = self.client.allocate(hashes, [AllocRequest(d, name)], None)[0]
        except HkvError:
            return False
        if a.existing:
            return False  # someone else's complete object: leave it
        tag = BlockTag(hashes[d], hashes[d - 1] if d else None, d)
        res = self._call(a.handle, "write_blocks", [a.handle], [arr], [tag], [commit])
        if res is None or not res[0].ok:
            with contextlib.suppress(Exception):
                self.client.evict(a.handle.object_id)
            return False
        key = (bytes(hashes[d]), name)
        with self.books.lock:
            # the bad bytes are in memory only; a disk copy of good bytes (written through
            # earlier) still serves a reader, who loads it past the bad memory object
            if not self.books.disk.get(key):
                self.books.good.discard(key)
        self.faulty[key] = int(a.handle.object_id)
        return True

    def _repair(self, hashes: list[BlockHash], data: Mapping[Slot, np.ndarray],
                tail_data: Mapping[Slot, tuple[np.ndarray, int]], wr: Any
                ) -> list[tuple[Slot, Handle]]:
        """A later writer completes a stalled tail or an unsynced indexer with fresh bytes."""
        from hkv_service.core.states import State
        from workers.ports import BlockTag, Commit

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
            reqs = [AllocRequest(d, s[1])]
            kv_name = lay.columns[col.indexes].name if col.indexes is not None else None
            if kv_name is not None:
                reqs.append(AllocRequest(d, kv_name))
            try:
                allocs = self.client.allocate(hashes, reqs, None)
            except HkvError:
                continue
            a = allocs[0]
            if not a.existing:  # gone meanwhile: give the fresh block back
                for x in allocs:
                    if not x.existing:
                        with contextlib.suppress(Exception):
                            self.client.evict(x.handle.object_id)
                continue
            tag = BlockTag(hashes[d], hashes[d - 1] if d else None, d)
            if a.state is State.TAIL_PARTIAL and s in tail_data:
                arr, n = tail_data[s]
                commit = Commit((Event.TAIL_DONE,), (Params(tail_len=n),))
            elif a.state is State.INDEXER_WRITTEN and kv_name is not None and s in data:
                kv = allocs[1]
                if not kv.existing:
                    with contextlib.suppress(Exception):
                        self.client.evict(kv.handle.object_id)
                    continue
                version = wr.versions.get((d, kv_name), kv.version)
                arr = data[s]
                commit = Commit((Event.INDEXER_SYNC,), (Params(version=version),))
            else:
                continue
            res = self._call(a.handle, "write_blocks", [a.handle], [arr], [tag], [commit])
            if res is not None and res[0].ok:
                self.books.good.add(key)
                self.books.add_mem(key, int(a.handle.object_id), a.handle.shard)
                out.append((s, a.handle))
        return out

    def _write_through(self, hashes: list[BlockHash], done: list[tuple[Slot, Handle]]) -> None:
        """Copy what was just written to the holding shard's disk tier; memory copies stay."""
        if not done:
            return
        results: list[Any] = []
        for i in range(0, len(done), OFFLOAD_BATCH):  # stay under the admission cap
            results += self.dp.offload([h for _, h in done[i : i + OFFLOAD_BATCH]])
        ok = 0
        for (s, _), res in zip(done, results, strict=True):
            if res.ok and res.handle is not None:
                self.books.add_disk((bytes(hashes[s[0]]), s[1]), int(res.handle.object_id))
                ok += 1
            else:
                self.events[f"offload_failed:{res.outcome.value}"] += 1
        self.events["offloaded"] += ok

    def _call(self, h: Handle, method: str, *args: Any) -> Any:
        import ray

        actor = self.system.shards.get(h.shard)
        if actor is None:
            return None
        try:
            return ray.get(getattr(actor, method).remote(*args), timeout=15.0)
        except Exception as exc:
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
                self.client.evict(h.object_id)
            except HkvError:
                return False
            noise = np.random.default_rng(pick).integers(0, 256, h.nbytes, dtype=np.uint8)
            reuse = dataclasses.replace(h, generation=h.generation + 1,
                                        object_id=ObjectId(_EMPTY_OBJECT))
            res = self._call(reuse, "write_blocks", [reuse], [noise])
            ok = res is not None and bool(res[0].ok)
            self.events["evict_race_reused" if ok else "evict_race_not_reused"] += 1
            return True  # evicted either way: the read must not serve it

    def inject_disk_bitflip(self, lk: Lookup, pick: int) -> bool:
        return False  # not injected on this backend (UNSUPPORTED_FAULTS)

    def inject_shard_kill(self, lk: Lookup) -> bool:
        """Kill the Ray actor of the shard holding a matched block; Ray restarts it (it comes
        back empty, re-registers, its objects are marked lost, its disk records re-confirmed)."""
        import ray

        shards = sorted({h.shard for hs in lk.handles.values() for h in hs if h.shard})
        if not shards or self.system is None:
            return False
        sid = shards[0]
        actor = self.system.shards.get(sid)
        if actor is None:
            return False
        with self.lock:
            before = self.incarnation.get(sid, 0)
            ray.kill(actor, no_restart=False)
            self.books.lose_shard(sid)
            deadline = time.monotonic() + RESTART_WAIT_S
            while time.monotonic() < deadline:
                try:
                    info = ray.get(actor.ping.remote(), timeout=10)
                    if int(info["incarnation"]) > before:
                        self.incarnation[sid] = int(info["incarnation"])
                        break
                except Exception:
                    pass
                time.sleep(0.2)
            else:
                self.incarnation[sid] = before + 1  # never came back: reads still refuse
            self.events["shard_kill"] += 1
            return True

    def inject_service_restart(self) -> None:
        """Not injected on this backend (run.py removes the fault from the plan)."""

    # ---- oracle and stats -------------------------------------------------------------------

    def safe_prefix(self, hashes: Sequence[BlockHash], limit: int, abi_ok: bool = True) -> int:
        """Longest LCM-aligned p <= limit whose needed blocks this backend wrote completely and
        some live object still holds (its own books, never the funnel)."""
        if not abi_ok:
            return 0
        lay = self.layout
        hb, lcm = lay.hash_block, lay.lcm
        with self.books.lock:
            for k in range(limit // lcm, 0, -1):
                p = k * lcm
                if all(
                    self.books.safe((bytes(hashes[d]), lay.columns[c].name))
                    for d in range(p // hb)
                    for c in _needed_columns(lay, d, p)
                ):
                    return int(p)
        return 0

    def stats(self) -> dict[str, Any]:
        snap = self.client.stats()
        return {
            "backend": self.name,
            "disk": "lmdb",
            "transitions": dict(sorted(_counts(snap.get("transitions")).items())),
            "downgrades": dict(sorted(_counts(snap.get("downgrades")).items())),
            "gauges": snap.get("gauges", {}),
            "events": dict(self.events),
            "disk_corruption": 0,
            "epoch": 0,
            "endpoint": self.system.endpoint if self.system is not None else None,
            "shards": sorted(self.incarnation),
        }


def _counts(value: object) -> dict[str, int]:
    return {str(k): int(v) for k, v in value.items()} if isinstance(value, Mapping) else {}


def _as_bytes(t: Any) -> np.ndarray:
    arr = t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return np.ascontiguousarray(arr, dtype=np.float32).view(np.uint8).reshape(-1)


def _ray_pids() -> list[int]:
    """Pids of the Ray processes (gcs, raylet, ...) this driver's ray.init started."""
    try:
        import ray

        node: Any = ray._private.worker._global_node
        out = []
        for infos in node.all_processes.values():
            for info in infos:
                if info.process is not None:
                    out.append(int(info.process.pid))
        return out
    except Exception:
        return []
