"""One inference worker step per request: hash -> lookup -> (load) -> read -> import -> extend
-> (check against a full recompute) -> write the new blocks, tails and recurrent states back.

A recurrent layer's state is written at resume points (every one the request computed, or with
``states="last"`` only its last, as vLLM's align mode keeps them), each as of exactly its
boundary; two faults hand over a wrong one there (the state one boundary earlier, or the
state in float16), which the writer's check must refuse (``workers.checkpoints``).

Any output that differs from ``forward_full`` beyond LOGITS_RTOL/ATOL after reusing cached
state is a *silent error*: the cache said "safe" and it was not.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.layout import Layout
from hkv_service.core.states import Kind, Reason
from hkv_service.refmodel import LOGITS_ATOL, LOGITS_RTOL, RefModel
from hkv_service.refmodel.cache import ModelCache
from workers.checkpoints import StateCheckpoint

from .backend import DemoBackend, Lookup, WriteOptions
from .faults import FaultPlan
from .workload import Request

__all__ = ["STATE_RETENTION", "Totals", "Worker", "run_request"]

# Which resume points a worker writes recurrent states at: every one it computed, or only the
# prompt's last (what vLLM's align mode leaves: one state per prompt, at its last boundary)
STATE_RETENTION = ("every", "last")
Checkpoints = dict[int, dict[str, StateCheckpoint]]  # position -> group -> its state there


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
                 check: bool, states: str = "every") -> None:
        if states not in STATE_RETENTION:
            raise ValueError(f"states must be one of {STATE_RETENTION}, got {states!r}")
        self.states = states
        self.model = model
        self.backend = backend
        self.faults = faults
        self.check = check
        self.layout = Layout(model.spec)
        self.extra = ExtraKeys(model.spec.model_id)

    def run(self, req: Request, totals: Totals) -> None:
        row, reasons = run_request(self, req)
        totals.add(row, reasons)


def _checkpoints(model: RefModel, cache: ModelCache, groups: Sequence[str]) -> dict[
        str, StateCheckpoint]:
    """Each recurrent group's state as of ``cache.length``, as a writer hands it over."""
    return {g: StateCheckpoint(tuple(p.numpy() for p in model.state_parts(cache, g)),
                               cache.length) for g in groups}


def _segments(model: RefModel, cache: ModelCache, tokens: torch.Tensor, lcm: int
              ) -> tuple[torch.Tensor, ModelCache, dict[int, dict[str, tuple[torch.Tensor, int]]],
                         Checkpoints]:
    """extend() in pieces ending at every multiple of ``lcm``, exporting both tails and the
    recurrent states there (and the states at the start, a resume point: a fault hands them
    over one boundary late).

    The model cuts its chunks at the same multiples, so the logits are those of one extend."""
    outs: list[torch.Tensor] = []
    tails: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
    start, pos = 0, cache.length
    # the groups whose tails are objects (a group without overlap carries nothing at a
    # resume point: it has no TAIL column, and import needs none)
    cols = Layout(model.spec).columns
    groups = [c.group.name for c in cols if c.kind is Kind.TAIL]
    recurrent = [c.group.name for c in cols if c.kind is Kind.STATE]
    states: Checkpoints = {pos: _checkpoints(model, cache, recurrent)} if recurrent else {}
    while start < tokens.shape[0]:
        end = min(tokens.shape[0], start + lcm - pos % lcm)
        logits, cache = model.extend(cache, tokens[start:end])
        outs.append(logits)
        pos, start = cache.length, end
        if pos % lcm == 0:
            tails[pos] = {g: model.export_tail(cache, g) for g in groups}
            if recurrent:
                states[pos] = _checkpoints(model, cache, recurrent)
    return torch.cat(outs), cache, tails, states


@dataclass
class Seen:
    """What a request's lookups said: every downgrade reason, and the longest position the
    funnel found no recurrent state at (NO_STATE_AT_BOUNDARY; 0: none)."""

    reasons: set[str] = field(default_factory=set)
    no_state_at: int = 0

    def take(self, lk: Lookup) -> None:
        for d in lk.match.downgrades:
            self.reasons.add(d.reason.value)
            if d.reason is Reason.NO_STATE_AT_BOUNDARY:
                self.no_state_at = max(self.no_state_at, d.position)


def run_request(w: Worker, req: Request) -> tuple[dict[str, Any], set[str]]:
    lay, model, be, fp = w.layout, w.model, w.backend, w.faults
    hb, lcm = lay.hash_block, lay.lcm
    T = len(req.tokens)
    tokens = torch.from_numpy(req.tokens)
    seen = Seen()
    reasons = seen.reasons
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
    seen.take(lk)
    lk = _with_loads(w, lk, hashes, limit, reader_abi, not race, seen, faults=True)
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
                cache = model.import_cache(lk.usable, res.blocks, res.tails, res.states)
                usable = lk.usable
            except ValueError:
                reasons.add("IMPORT_FAILED")
            break
        if res.reason:
            reasons.add(res.reason)
        be.release(lk)
        if attempt == 0:
            lk = be.lookup(hashes, limit, reader_abi, lease=True)
            lk = _with_loads(w, lk, hashes, limit, reader_abi, True, seen, faults=False)
    be.release(lk)
    t2 = time.perf_counter()
    logits, final, tails, states = _segments(model, cache, tokens[usable:], lcm)
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
        _write_back(w, req, hashes, usable, final, tails, states)
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
        # issue 37 item 3: the longest boundary the funnel found without a recurrent state
        # (it then resumed shorter, at reused_tokens, or recomputed all)
        "no_state_at": seen.no_state_at,
    }
    return row, reasons


def _with_loads(w: Worker, lk: Any, hashes: list[Any], limit: int, reader_abi: Any,
                lease: bool, seen: Seen, faults: bool) -> Any:
    """Load what the match needs from disk, then look up again. A load left in flight
    (slow_disk_load) shows as DISK_INFLIGHT; the reader then waits for it and looks up again."""
    be, fp = w.backend, w.faults
    if faults and lk.usable and not lk.match.needs_load and (
            fp.owed("disk_bitflip") or fp.overdue("slow_disk_load")):
        # an owed bit flip (or an overdue slow load) needs a disk load to land in: the memory
        # copy of a matched block whose disk copy the write-through made goes, and the lookup
        # is asked again
        be.release(lk)
        if be.push_to_disk(lk, fp.choice(1 << 30)):
            lk = be.lookup(hashes, limit, reader_abi, lease=lease)
            seen.take(lk)
    reasons = seen.reasons
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
    seen.take(lk)
    if slow:
        fp.count("slow_disk_load")
        reasons.update(be.settle())  # the slow loads land (checksum-verified) meanwhile
        be.release(lk)
        lk = be.lookup(hashes, limit, reader_abi, lease=lease)
        seen.take(lk)
        if lk.match.needs_load:
            reasons.update(be.load(lk))
            be.release(lk)
            lk = be.lookup(hashes, limit, reader_abi, lease=lease)
    return lk


def _write_back(w: Worker, req: Request, hashes: list[Any], usable: int, final: ModelCache,
                tails: dict[int, dict[str, tuple[torch.Tensor, int]]],
                states: Checkpoints) -> None:
    lay, model, fp = w.layout, w.model, w.faults
    hb = lay.hash_block
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    tail_by_depth: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}
    for d in range(usable // hb, len(hashes)):
        end = (d + 1) * hb
        cols: dict[str, torch.Tensor] = {}
        for c in lay.attached[d % lay.period]:
            col = lay.columns[c]
            if col.kind in (Kind.TAIL, Kind.STATE):
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
    state_by_depth = _states_to_write(w, usable, states, opts.partial_tail)
    rep = w.backend.write(hashes, blocks, tail_by_depth, opts, state_by_depth)
    for name, n in rep.faults.items():
        fp.count(name, n)
    if opts.owner and rep.written:
        fp.count("misaligned_handle")


def _odd_owner(w: Worker) -> str | None:
    return getattr(w.backend, "odd_shard", None)



def _states_to_write(w: Worker, usable: int, states: Checkpoints, partial_tail: bool
                     ) -> dict[int, dict[str, StateCheckpoint]]:
    """The recurrent states to write, by depth: at every resume point the request computed
    past ``usable`` (or its last only), each as of its boundary; or, as a fault, one of them
    wrong: the state one boundary earlier (``state_off_boundary``) or held in float16
    (``state_dtype``). The faulty one is at the last resume point, where the next turn of a
    chat resumes, unless the tail there is stalled (``partial_tail``): then the one before, so
    a reader meets both faults, each with its reason."""
    hb, lcm = w.layout.hash_block, w.layout.lcm
    ends = sorted(p for p in states if p > usable)
    if w.states == "last":
        ends = ends[-1:]
    out = {p // hb - 1: dict(states[p]) for p in ends}
    fp = w.faults
    target = ends[-2] if partial_tail and len(ends) >= 2 else ends[-1] if ends else None
    if target is None or (partial_tail and len(ends) < 2):
        return out
    d = target // hb - 1
    if fp.roll("state_off_boundary") and target - lcm in states:
        out[d] = dict(states[target - lcm])  # as of one boundary earlier, filed under target
        fp.count("state_off_boundary")
    elif fp.roll("state_dtype"):
        out[d] = {g: StateCheckpoint(tuple(p.astype(np.float16) for p in c.parts), c.position)
                  for g, c in states[target].items()}
        fp.count("state_dtype")
    return out
