"""One inference worker step per request: hash -> lookup -> (load) -> read -> import -> extend
-> (check against a full recompute) -> write the new blocks and tails back.

Any output that differs from ``forward_full`` beyond LOGITS_RTOL/ATOL after reusing cached
state is a *silent error*: the cache said "safe" and it was not.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.layout import Layout
from hkv_service.core.states import Kind
from hkv_service.refmodel import LOGITS_ATOL, LOGITS_RTOL, RefModel
from hkv_service.refmodel.cache import ModelCache

from .backend import DemoBackend, WriteOptions
from .faults import FaultPlan
from .workload import Request

__all__ = ["Totals", "Worker", "run_request"]


@dataclass
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    oracle_tokens: int = 0
    silent_errors: int = 0
    checked: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    time_s: Counter[str] = field(default_factory=Counter)
    per_request: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, row: dict[str, Any], reasons: set[str]) -> None:
        with self.lock:
            self.requests += 1
            self.prompt_tokens += row["prompt_tokens"]
            self.reused_tokens += row["reused_tokens"]
            self.recomputed_tokens += row["recomputed_tokens"]
            self.oracle_tokens += row["oracle_tokens"]
            self.silent_errors += row["silent_error"]
            self.checked += row["checked"]
            for r in reasons:
                self.fallbacks[r] += 1
            for stage in ("lookup", "transfer", "compute", "writeback", "full"):
                self.time_s[stage] += row[f"{stage}_s"]
            self.per_request.append(row)


class Worker:
    def __init__(self, model: RefModel, backend: DemoBackend, faults: FaultPlan,
                 check: bool) -> None:
        self.model = model
        self.backend = backend
        self.faults = faults
        self.check = check
        self.layout = Layout(model.spec)
        self.extra = ExtraKeys(model.spec.model_id)

    def run(self, req: Request, totals: Totals) -> None:
        row, reasons = run_request(self, req)
        totals.add(row, reasons)


def _segments(model: RefModel, cache: ModelCache, tokens: torch.Tensor, lcm: int
              ) -> tuple[torch.Tensor, ModelCache, dict[int, dict[str, tuple[torch.Tensor, int]]]]:
    """extend() in pieces ending at every multiple of ``lcm``, exporting both tails there.

    The model cuts its chunks at the same multiples, so the logits are those of one extend."""
    outs: list[torch.Tensor] = []
    tails: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
    start, pos = 0, cache.length
    # the groups whose tails are objects (a group without overlap carries nothing at a
    # resume point: it has no TAIL column, and import needs none)
    groups = [c.group.name for c in Layout(model.spec).columns if c.kind is Kind.TAIL]
    while start < tokens.shape[0]:
        end = min(tokens.shape[0], start + lcm - pos % lcm)
        logits, cache = model.extend(cache, tokens[start:end])
        outs.append(logits)
        pos, start = cache.length, end
        if pos % lcm == 0:
            tails[pos] = {g: model.export_tail(cache, g) for g in groups}
    return torch.cat(outs), cache, tails


def run_request(w: Worker, req: Request) -> tuple[dict[str, Any], set[str]]:
    lay, model, be, fp = w.layout, w.model, w.backend, w.faults
    hb, lcm = lay.hash_block, lay.lcm
    T = len(req.tokens)
    tokens = torch.from_numpy(req.tokens)
    reasons: set[str] = set()
    fp.start()
    t0 = time.perf_counter()
    hashes = hash_blocks(req.tokens, hb, w.extra)
    limit = ((T - 1) // lcm) * lcm
    hashed = time.perf_counter()
    # the oracle reads the owners' own books; it is the bench's yardstick, not hkv's work, so
    # its time is left out of the lookup phase
    safe = be.safe_prefix(hashes, limit)
    t0 += time.perf_counter() - hashed
    # a reader of another kernel ABI is a fault only where there is something to refuse it
    abi_bad = safe > 0 and fp.roll("abi_mismatch")
    reader_abi: dict[str, int] | None = None
    if abi_bad:
        g = model.spec.groups[0]
        reader_abi = {str(g.name): g.abi.fingerprint() ^ 1}
        fp.count("abi_mismatch")
    oracle = 0 if abi_bad else safe
    race = fp.roll("evict_race")
    lk = be.lookup(hashes, limit, reader_abi, lease=not race)
    reasons.update(d.reason.value for d in lk.match.downgrades)
    lk = _with_loads(w, lk, hashes, limit, reader_abi, not race, reasons, faults=True)
    if race and lk.usable and be.inject_evict_race(lk, fp.choice(1 << 30)):
        fp.count("evict_race")
    if lk.usable and fp.roll("shard_kill") and be.inject_shard_kill(lk):
        fp.count("shard_kill")
    if lk.usable and fp.roll("service_restart"):
        be.inject_service_restart()
        fp.count("service_restart")
    t1 = time.perf_counter()
    usable, cache = 0, model.empty_cache()
    for attempt in range(2):  # a stale read is answered "recompute"; look up once more
        if not lk.usable:
            break
        res = be.read(lk)
        if res.ok and res.blocks is not None and res.tails is not None:
            try:
                cache = model.import_cache(lk.usable, res.blocks, res.tails)
                usable = lk.usable
            except ValueError:
                reasons.add("IMPORT_FAILED")
            break
        if res.reason:
            reasons.add(res.reason)
        be.release(lk)
        if attempt == 0:
            lk = be.lookup(hashes, limit, reader_abi, lease=True)
            lk = _with_loads(w, lk, hashes, limit, reader_abi, True, reasons, faults=False)
    be.release(lk)
    t2 = time.perf_counter()
    logits, final, tails = _segments(model, cache, tokens[usable:], lcm)
    t3 = time.perf_counter()
    silent, checked, full_s = 0, 0, 0.0
    if w.check:
        full = model.forward_full(tokens)
        full_s = time.perf_counter() - t3
        checked = 1
        if not torch.allclose(logits, full[usable:], rtol=LOGITS_RTOL, atol=LOGITS_ATOL):
            silent = 1
    t4 = time.perf_counter()
    if not abi_bad and not silent:
        _write_back(w, req, hashes, usable, final, tails)
    t5 = time.perf_counter()
    row = {
        "rid": req.rid,
        "kind": req.kind,
        "prompt_tokens": T,
        "reused_tokens": usable,
        "recomputed_tokens": T - usable,
        "oracle_tokens": oracle,
        "silent_error": silent,
        "checked": checked,
        "lookup_s": t1 - t0,
        "transfer_s": t2 - t1,
        "compute_s": t3 - t2,
        "full_s": full_s,
        "writeback_s": t5 - t4,
        "reasons": sorted(reasons),
    }
    return row, reasons


def _with_loads(w: Worker, lk: Any, hashes: list[Any], limit: int, reader_abi: Any,
                lease: bool, reasons: set[str], faults: bool) -> Any:
    """Load what the match needs from disk, then look up again. A load left in flight
    (slow_disk_load) shows as DISK_INFLIGHT; the reader then waits for it and looks up again."""
    be, fp = w.backend, w.faults
    if faults and lk.usable and not lk.match.needs_load and fp.owed("disk_bitflip"):
        # an owed bit flip needs a disk load to land in: the memory copy of a matched block
        # whose disk copy the write-through made goes, and the lookup is asked again
        be.release(lk)
        if be.push_to_disk(lk, fp.choice(1 << 30)):
            lk = be.lookup(hashes, limit, reader_abi, lease=lease)
            reasons.update(d.reason.value for d in lk.match.downgrades)
    if not (lk.match.needs_load or (lk.usable and any(
            h.block < 0 for c in lk.handles.values() for h in c))):
        return lk
    if faults and fp.roll("disk_bitflip") and be.inject_disk_bitflip(lk, fp.choice(1 << 30)):
        fp.count("disk_bitflip")
    slow = faults and fp.roll("slow_disk_load")
    reasons.update(be.load(lk, slow=slow))
    be.release(lk)
    # our own slow load is in flight: the lookup must see it so (not wait it away)
    lk = be.lookup(hashes, limit, reader_abi, lease=lease, wait_in_flight=not slow)
    reasons.update(d.reason.value for d in lk.match.downgrades)
    if slow:
        fp.count("slow_disk_load")
        reasons.update(be.settle())  # the slow loads land (checksum-verified) meanwhile
        be.release(lk)
        lk = be.lookup(hashes, limit, reader_abi, lease=lease)
        reasons.update(d.reason.value for d in lk.match.downgrades)
        if lk.match.needs_load:
            reasons.update(be.load(lk))
            be.release(lk)
            lk = be.lookup(hashes, limit, reader_abi, lease=lease)
    return lk


def _write_back(w: Worker, req: Request, hashes: list[Any], usable: int, final: ModelCache,
                tails: dict[int, dict[str, tuple[torch.Tensor, int]]]) -> None:
    lay, model, fp = w.layout, w.model, w.faults
    hb = lay.hash_block
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    tail_by_depth: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
    for d in range(usable // hb, len(hashes)):
        end = (d + 1) * hb
        cols: dict[str, torch.Tensor] = {}
        for c in lay.attached[d % lay.period]:
            col = lay.columns[c]
            if col.kind.value == "TAIL":
                continue
            cols[col.name] = model.export_block(final, col.group.name,
                                                end // col.group.block_size - 1)
        blocks[d] = cols
        if end in tails:
            tail_by_depth[d] = tails[end]
    opts = WriteOptions(
        owner=_odd_owner(w) if fp.roll("misaligned_handle") else None,
        partial_tail=fp.roll("partial_tail"),
        stale_indexer=fp.roll("stale_indexer"),
    )
    rep = w.backend.write(hashes, blocks, tail_by_depth, opts)
    for name, n in rep.faults.items():
        fp.count(name, n)
    if opts.owner and rep.written:
        fp.count("misaligned_handle")


def _odd_owner(w: Worker) -> str | None:
    return getattr(w.backend, "odd_shard", None)

