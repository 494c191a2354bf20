"""The connector's worker side: bytes between hkv's data plane and vLLM's paged KV tensors.

* :meth:`WorkerSide.load` carries out a step's LoadJobs: ``DataPlane.read`` (disk copies
  loaded first, the lease released after) and each block copied into vLLM's ``[B, H, N, C]``
  layer views at the block ids the scheduler planned. Any failure (a Recompute: stale handle,
  owner lost, corrupt, evicted from disk; an exception) fails the job: never old bytes.
* :meth:`WorkerSide.save` carries out SaveJobs: each block's pages gathered from the views and
  handed to ``DataPlane.write_prefix`` (allocate, write, commit after the bytes landed).

Both run synchronously inside the step; the scheduler treats loads as asynchronous (the
request waits a step), so no forward pass reads a block while it is being filled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from workers.dataplane import DataPlane, Recompute

from .geometry import Geometry, GroupMap
from .plan import LoadJob, SaveJob
from .stats import Counters

__all__ = ["Outcomes", "WorkerSide"]

log = logging.getLogger(__name__)
_FINISHED_STEPS = 64  # finished-request sets remembered: a save is matched within them


@dataclass(slots=True)
class Outcomes:
    """What the worker reports to vLLM after a step (``get_transfer_results``)."""

    recved: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    error_blocks: set[int] = field(default_factory=set)


class WorkerSide:
    def __init__(self, geo: Geometry, plane: DataPlane) -> None:
        self.geo = geo
        self.plane = plane
        self.stats = Counters()
        self.views: dict[str, list[torch.Tensor]] = {}  # group name -> layer views
        self._out = Outcomes()
        self._saved: set[str] = set()  # saved, waiting for vLLM to name them finished
        self._finished: deque[set[str]] = deque(maxlen=_FINISHED_STEPS)
        self._lock = threading.Lock()

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

    # -- load -------------------------------------------------------------------------------

    def load(self, jobs: tuple[LoadJob, ...]) -> None:
        for job in jobs:
            ok = self._load(job) if job.match is not None else False
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
            blocks = self.plane.read(job.match, job.hashes)
            if isinstance(blocks, Recompute):
                self.stats.add(f"load_failed.{blocks.reason.value}")
                log.info("hkv load of %s refused (%s): recomputing", job.req_id, blocks.reason)
                return False
            for c in job.copies:
                self._put(self._group(c.column), c.block_id, blocks[c.column][c.index])
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
        for job in jobs:
            start = time.perf_counter()
            try:
                blocks = {(it.depth, it.column): self._get(self._group(it.column), it.block_id)
                          for it in job.items}
                report = self.plane.write_prefix(job.hashes, blocks)
                self.stats.add("saved_blocks", report.written)
                self.stats.add("state_saves", sum(self._group(it.column).recurrent
                                                  for it in job.items))
                self.stats.add("existing_blocks", report.existing)
                if report.failed:
                    self.stats.add("save_failed", len(report.failed))
            except Exception as exc:  # a lost save is a future miss, nothing worse
                self.stats.add("save_failed", len(job.items))
                log.warning("hkv save of %s failed: %s", job.req_id, exc)
            finally:
                self.stats.add("write_s", time.perf_counter() - start)
            if job.held:
                with self._lock:
                    self._saved.add(job.req_id)

    def _get(self, g: GroupMap, block_id: int) -> np.ndarray:
        """The block's pages, layer after layer, in one buffer (numpy copies: ``torch.cat``
        of a block's pages took ~6 ms a block inside vLLM on 2 busy cores, 84% of a save)."""
        views = self.views[g.name]
        if views[0].device.type != "cpu":  # one device-to-host copy of the whole block
            pages = [v[block_id].contiguous().view(torch.uint8).reshape(-1) for v in views]
            return torch.cat(pages).cpu().numpy()
        out = np.empty(g.block_bytes, np.uint8)
        for i, v in enumerate(views):
            page = v[block_id].contiguous().view(torch.uint8).reshape(-1)
            out[i * g.page_bytes : (i + 1) * g.page_bytes] = page.numpy()
        return out

    # -- report -----------------------------------------------------------------------------

    def take(self, finished_req_ids: set[str]) -> Outcomes:
        """This step's outcomes. A save is reported once vLLM has named its request finished
        (in this call or an earlier one), as ``get_finished`` requires."""
        with self._lock:
            out, self._out = self._out, Outcomes()
            self._finished.append(set(finished_req_ids))
            out.sent = {r for r in self._saved if any(r in f for f in self._finished)}
            self._saved -= out.sent
            return out
