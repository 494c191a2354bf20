"""The connector's worker side: bytes between hkv's data plane and vLLM's paged KV tensors.

Nothing here waits on hkv's I/O inside vLLM's step:

* :meth:`WorkerSide.save` (``wait_for_save``, after the forward) only *stages* each SaveJob:
  every block's pages copied out of vLLM's cache into a buffer of the connector's own (host
  memory; pinned, with the device-to-host copy queued on vLLM's stream, on a GPU). vLLM may
  overwrite those pages once the step returns (a preempted or finished request's blocks, a
  recurrent state block reused), so the copy is taken now. Allocate, shard writes and commit
  (``DataPlane.write_prefix``: commit only after every byte landed, fresh objects given back
  if not) run on the save :class:`.lane.Lane`. A finished request's save (``held``) keeps its
  blocks in vLLM until it landed (or failed): ``take`` reports it sent only then. A save the
  staging budget cannot take is dropped and counted (a later miss, never a stall).
* :meth:`WorkerSide.load` (``start_load_kv``) hands each LoadJob to the load lane:
  ``DataPlane.read`` and each block copied into vLLM's ``[B, H, N, C]`` views at the block ids
  the scheduler planned; ``take`` reports it received once done. vLLM keeps a loading
  request waiting (``WAITING_FOR_REMOTE_KVS``) and its blocks allocated until then, even if
  it is aborted, so nothing else reads or reuses them meanwhile. Any failure (a Recompute:
  stale handle, owner lost, corrupt, evicted from disk; an exception) fails the job: never
  old bytes.

Every job is settled exactly once (landed, failed, dropped or abandoned: counted), so vLLM is
always told; ``close`` drains for a bounded time and abandons the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from hkv_service.core.ids import BlockHash
from workers.dataplane import DataPlane, Recompute

from .geometry import Geometry, GroupMap
from .lane import Lane, Task
from .plan import LoadJob, SaveJob
from .stats import Counters

__all__ = ["Outcomes", "Staged", "WorkerSide"]

log = logging.getLogger(__name__)
_FINISHED_STEPS = 64  # finished-request sets remembered: a save is matched within them


@dataclass(slots=True)
class Outcomes:
    """What the worker reports to vLLM after a step (``get_transfer_results``)."""

    recved: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    error_blocks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class Staged:
    """One SaveJob's bytes, copied out of vLLM's cache in the step that handed it over."""

    job: SaveJob
    blocks: dict[tuple[int, str], Any]  # (depth, column) -> the block's bytes (host)
    nbytes: int
    ready: Any = None  # a CUDA event the device-to-host copies complete at (GPU only)


class WorkerSide:
    def __init__(self, geo: Geometry, plane: DataPlane, staging_bytes: int = 1 << 30,
                 drain_s: float = 10.0, min_sightings: int = 1) -> None:
        """``min_sightings``: a block is saved once offered that many times (the connector's
        ``save_min_sightings``; 1: always)."""
        self.geo = geo
        self.plane = plane
        self.stats = Counters()
        self.views: dict[str, list[torch.Tensor]] = {}  # group name -> layer views
        self._pages: dict[str, list[np.ndarray]] = {}  # ... as [blocks, page bytes] (CPU)
        self.staging_bytes = staging_bytes  # staged bytes in flight at most; past it, drop
        self.drain_s = drain_s  # how long ``close`` waits for saves in flight
        self.min_sightings = min_sightings
        self._out = Outcomes()
        self._staged_bytes = 0
        self._held: set[str] = set()  # finished requests whose save is in flight
        self._named: set[str] = set()  # ... of those, named finished by vLLM already
        self._saved: set[str] = set()  # held saves settled, waiting for vLLM to name them
        self._finished: deque[set[str]] = deque(maxlen=_FINISHED_STEPS)
        self._lock = threading.Lock()
        self._saves = Lane("save")
        self._loads = Lane("load")

    def register(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer ``[B, H, N, C]`` views; check each against the geometry."""
        for g in self.geo.groups:
            views = []
            for layer in g.layers:
                t = kv_caches[layer]
                if t.shape[0] != num_blocks:
                    raise ValueError(f"layer {layer}: {t.shape[0]} pages for {num_blocks} "
                                     "blocks: kernel-block splitting is not supported by hkv")
                page = t[0].numel() * t.element_size()
                if page != g.page_bytes:
                    raise ValueError(f"layer {layer}: a page is {page} bytes, the geometry "
                                     f"says {g.page_bytes}")
                views.append(t)
            self.views[g.name] = views
            if all(v.device.type == "cpu" and v.is_contiguous() for v in views):
                # numpy views of the pages, made once: a page copy is then one numpy slice
                # assignment (~1 us of Python) instead of five torch calls (~25 us)
                self._pages[g.name] = [v.view(torch.uint8).reshape(num_blocks, -1).numpy()
                                       for v in views]
        # the shards' segments mapped now, on the save lane (~40 ms each on a 2-core host,
        # paid before the first save instead of by it; a shard that does not answer holds
        # up that lane, never vLLM's start)
        self._saves.submit(Task(self._attach, lambda why: None))

    def _attach(self) -> None:
        start = time.perf_counter()
        mapped = self.plane.attach_shared()
        log.info("hkv connector: %d shard segments mapped in %.1f ms", mapped,
                 (time.perf_counter() - start) * 1e3)

    # -- load -------------------------------------------------------------------------------

    def load(self, jobs: tuple[LoadJob, ...]) -> None:
        """Hand this step's loads to the load lane (a job with nothing to read settles now)."""
        for job in jobs:
            if job.match is None:
                self._settle_load(job, False)
                continue
            self._loads.submit(Task(partial(self._run_load, job),
                                    partial(self._abandon_load, job)))

    def _run_load(self, job: LoadJob) -> None:
        self._settle_load(job, self._load(job))
        if job.match is not None:  # the bytes are in vLLM's pages and vLLM was told: the
            self.plane.release(job.match)  # lease's round trip is off the request's path

    def _abandon_load(self, job: LoadJob, why: str) -> None:
        self.stats.add("load_failed.abandoned")
        log.warning("hkv load of %s abandoned (%s): recomputing", job.req_id, why)
        self._settle_load(job, False)

    def _settle_load(self, job: LoadJob, ok: bool) -> None:
        with self._lock:
            self._out.recved.add(job.req_id)
            if job.error_blocks or (not ok and self.geo.block_errors):
                ids = {c.block_id for c in job.copies} if not ok else set()
                self._out.error_blocks.update(ids, job.error_blocks)
            elif not ok:
                self._out.failed.add(job.req_id)
        self.stats.add("load_ok" if ok and not job.error_blocks else "load_failed")
        if ok:
            self.stats.add("loaded_tokens", job.tokens)

    def _load(self, job: LoadJob) -> bool:
        assert job.match is not None
        start = time.perf_counter()
        try:
            blocks = self.plane.read(job.match, job.hashes, release=False)
            if isinstance(blocks, Recompute):
                self.stats.add(f"load_failed.{blocks.reason.value}")
                log.info("hkv load of %s refused (%s): recomputing", job.req_id, blocks.reason)
                return False
            moved = 0
            for c in job.copies:
                data = blocks[c.column][c.index]
                self._put(self._group(c.column), c.block_id, data)
                moved += data.nbytes
            self.stats.add("loaded_bytes", moved)
            self.stats.add("loaded_states", sum(self._group(c.column).recurrent
                                                for c in job.copies))
            return True
        except Exception as exc:  # a broken read is a recompute, never a crash of the step
            self.stats.add("load_failed.error")
            log.warning("hkv load of %s failed (%s): recomputing", job.req_id, exc)
            return False
        finally:
            self.stats.add("read_s", time.perf_counter() - start)

    def _group(self, name: str) -> GroupMap:
        return next(g for g in self.geo.groups if g.name == name)

    def _put(self, g: GroupMap, block_id: int, data: np.ndarray) -> None:
        raw = np.asarray(data).reshape(-1).view(np.uint8)
        if raw.nbytes != g.block_bytes:
            raise ValueError(f"{g.name}: {raw.nbytes} bytes read for a {g.block_bytes}-byte block")
        pages = self._pages.get(g.name)
        if pages is not None:
            rows = raw.reshape(len(pages), g.page_bytes)
            for i, p in enumerate(pages):
                p[block_id] = rows[i]
            return
        for i, view in enumerate(self.views[g.name]):
            dst = view[block_id]
            page = raw[i * g.page_bytes : (i + 1) * g.page_bytes]
            if dst.device.type == "cpu" and dst.is_contiguous():
                # numpy's memcpy: torch's copy_ of a small page goes through its thread pool,
                # which on a busy 2-core host costs milliseconds per call
                dst.view(torch.uint8).reshape(-1).numpy()[:] = page
            else:
                src = torch.from_numpy(page if page.flags.writeable else page.copy())
                dst.copy_(src.view(dst.dtype).reshape(dst.shape), non_blocking=False)

    # -- save -------------------------------------------------------------------------------

    def save(self, jobs: tuple[SaveJob, ...]) -> None:
        """Stage this step's saves (the only copy made inside the step) and hand them to the
        save lane."""
        for job in jobs:
            start = time.perf_counter()
            staged = self._stage(job)
            self.stats.add("stage_s", time.perf_counter() - start)
            if staged is None:
                continue
            self.stats.add("staged_bytes", staged.nbytes)
            self._saves.submit(Task(partial(self._write, staged),
                                    partial(self._give_up, staged)))

    def _stage(self, job: SaveJob) -> Staged | None:
        need = sum(self._group(it.column).block_bytes for it in job.items)
        with self._lock:
            fits = self._staged_bytes + need <= self.staging_bytes
            if fits:
                self._staged_bytes += need
            if job.held:
                self._held.add(job.req_id)
                if any(job.req_id in f for f in self._finished):
                    self._named.add(job.req_id)
        if not fits:  # hkv is behind: this save becomes a later miss, the step goes on
            self.stats.add("save_dropped", len(job.items))
            log.info("hkv save of %s dropped: %d bytes staged already", job.req_id,
                     self._staged_bytes)
            self._settle_save(job, 0)
            return None
        try:
            blocks = {(it.depth, it.column): self._get(self._group(it.column), it.block_id)
                      for it in job.items}
        except Exception as exc:  # a broken copy is a lost save, never a broken step
            self.stats.add("save_failed", len(job.items))
            log.warning("hkv save of %s not staged: %s", job.req_id, exc)
            self._settle_save(job, need)
            return None
        ready = None
        if any(isinstance(b, torch.Tensor) and b.is_pinned() for b in blocks.values()):
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
            ready.record()  # on vLLM's current stream, after the copies it queued
        return Staged(job, blocks, need, ready)

    def _write(self, st: Staged) -> None:
        """On the save lane: allocate, write, commit (after the bytes landed)."""
        job = st.job
        start = time.perf_counter()
        try:
            if st.ready is not None:
                st.ready.synchronize()
            blocks = {k: v.numpy() if isinstance(v, torch.Tensor) else v
                      for k, v in st.blocks.items()}
            hashes = job.hashes(self.geo.hash_block_size)
            blocks = self._admitted(hashes, blocks)
            if blocks:
                self._write_blocks(job, hashes, blocks)
        except Exception as exc:  # a lost save is a future miss, nothing worse
            self.stats.add("save_failed", len(job.items))
            log.warning("hkv save of %s failed: %s", job.req_id, exc)
        finally:
            self.stats.add("write_s", time.perf_counter() - start)
            self.stats.add("save_jobs")
        self._settle_save(job, st.nbytes)

    def _write_blocks(self, job: SaveJob, hashes: list[BlockHash],
                      blocks: dict[tuple[int, str], Any]) -> None:
        tokens = np.frombuffer(job.token_ids, "<i4").tolist()
        report = self.plane.write_prefix(hashes, blocks, token_ids=tokens)
        self.stats.add("saved_blocks", report.written)
        self.stats.add("state_saves", sum(self._group(column).recurrent
                                          for _, column in blocks))
        self.stats.add("existing_blocks", report.existing)
        if report.failed:
            self.stats.add("save_failed", len(report.failed))

    def _admitted(self, hashes: list[BlockHash], blocks: dict[tuple[int, str], Any]
                  ) -> dict[tuple[int, str], Any]:
        """The blocks the service admits (offered ``min_sightings`` times, by any engine);
        all of them when ``min_sightings`` is 1 (no call)."""
        if self.min_sightings <= 1 or not blocks:
            return blocks
        first = min(d for d, _ in blocks)  # before it: this request's earlier saves, or hits
        upto = self.plane.meta.admit_save(hashes, self.min_sightings, offered_from=first)
        kept = {slot: b for slot, b in blocks.items() if slot[0] < upto}
        if len(kept) < len(blocks):
            self.stats.add("save_unadmitted", len(blocks) - len(kept))
        return kept

    def _give_up(self, st: Staged, why: str) -> None:
        self.stats.add("save_abandoned", len(st.job.items))
        log.warning("hkv save of %s abandoned: %s", st.job.req_id, why)
        self._settle_save(st.job, st.nbytes)

    def _settle_save(self, job: SaveJob, nbytes: int) -> None:
        with self._lock:
            self._staged_bytes -= nbytes
            if job.held:
                self._held.discard(job.req_id)
                self._saved.add(job.req_id)

    def _get(self, g: GroupMap, block_id: int) -> np.ndarray | torch.Tensor:
        """A copy of the block's pages, layer after layer, in one buffer (numpy copies:
        ``torch.cat`` of a block's pages took ~6 ms a block inside vLLM on 2 busy cores, 84%
        of a save). On a GPU: one pinned host buffer, the copies queued on vLLM's stream."""
        views = self.views[g.name]
        if views[0].device.type != "cpu":
            out_t = torch.empty(g.block_bytes, dtype=torch.uint8, pin_memory=True)
            for i, v in enumerate(views):
                page = v[block_id].contiguous().view(torch.uint8).reshape(-1)
                out_t[i * g.page_bytes : (i + 1) * g.page_bytes].copy_(page, non_blocking=True)
            return out_t
        out = np.empty(g.block_bytes, np.uint8)
        pages = self._pages.get(g.name)
        if pages is not None:
            rows = out.reshape(len(pages), g.page_bytes)
            for i, p in enumerate(pages):
                rows[i] = p[block_id]
            return out
        for i, v in enumerate(views):
            page = v[block_id].contiguous().view(torch.uint8).reshape(-1)
            out[i * g.page_bytes : (i + 1) * g.page_bytes] = page.numpy()
        return out

    # -- report -----------------------------------------------------------------------------

    def take(self, finished_req_ids: set[str]) -> Outcomes:
        """This step's outcomes: loads settled since the last call, and each finished
        request's save once it settled and vLLM has named the request finished (in this call
        or an earlier one), as ``get_finished`` requires."""
        for lane in (self._saves, self._loads):
            lane.check()
        with self._lock:
            out, self._out = self._out, Outcomes()
            self._finished.append(set(finished_req_ids))
            self._named.update(self._held & finished_req_ids)
            out.sent = {r for r in self._saved
                        if r in self._named or any(r in f for f in self._finished)}
            self._saved -= out.sent
            self._named -= out.sent
            return out

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for every load and save handed over so far to settle."""
        deadline = time.monotonic() + timeout_s
        return all(lane.drain(max(0.0, deadline - time.monotonic()))
                   for lane in (self._loads, self._saves))

    def in_flight(self) -> int:
        return self._saves.pending() + self._loads.pending()

    def close(self) -> None:
        """Shutdown: saves in flight get ``drain_s`` to land; what is left is abandoned and
        counted (never committed: a commit follows only a whole write)."""
        left = self._loads.close(self.drain_s) + self._saves.close(self.drain_s)
        if left:
            log.warning("hkv connector closed with %d transfers abandoned", left)
