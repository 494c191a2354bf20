"""Stateful property test of every handle a lookup gives out, against a brute force.

Random interleavings of writes (whole or partial), evictions, offloads, loads, dropped copies,
re-allocated slots, KV rewrites with new versions, version-0 reports, owner loss and leased
lookups at byte alignments 1 / 256 / 4096 / 8192, over three specs and two owners (``s1``'s
pools have an odd-multiple-of-256 stride, so only some of its blocks are 4096-aligned).

Every Match is checked against this statement, written here over the raw records
(``state.index``, ``entry.mem``, ``entry.disk``, the owners' pools), with no code from
``contracts`` or ``funnel``:

For usable p > 0 and every column c, one handle per needed depth (COMPRESSED/INDEXER: every
block in [0, p); TAIL: the entry at p; SWA: blocks meeting [p - W_c, p)), each of which

1. names the live memory record or disk copy of its (entry, column) slot: memory in the
   readable state of its kind (``check_read`` passes); disk ON_DISK at rest (block -1) or
   ON_DISK_READY (its block and generation current, ``check_read`` passes);
2. if placed (block >= 0), is aligned: address and nbytes multiples of the request's
   alignment, and so is the block in its owner's pool;
3. SWA: its record covers [max(block start, p - W_c), block end);
4. INDEXER: its record's version equals that of the record its KV column's handle at the same
   depth names, and is not 0;
5. TAIL: its record is complete (holds what resuming at p needs);

and ``usable_tokens`` is the largest L-multiple p <= the resume limit with every hash of
[0, p/H) indexed for which copies satisfying 1-5 exist for every needed (depth, column)
(a KV and its indexers chosen jointly; an at-rest copy's alignment is not decided yet).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hkv_service.core.allocator import alignment
from hkv_service.core.api import (
    AllocRequest,
    Handle,
    LookupRequest,
    Match,
    ObjectReport,
    Params,
    PoolConfig,
    StateConfig,
)
from hkv_service.core.errors import HkvError, StaleHandle
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.records import ObjRecord, PrefixEntry
from hkv_service.core.spec import CacheSpec, spec_from_dict
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import TERMINAL_STATES, Event, Kind, State
from hkv_service.specs import default_spec
from hkv_service.testing import pools_for

# ---- specs ---------------------------------------------------------------------------------


def _abi(dtype: str, shape: list[int], version: str) -> dict[str, Any]:
    return {"dtype": dtype, "layout": "NHD", "head_shape": shape, "kernel_version": version}


TWO_SWA = spec_from_dict({
    "model_id": "two-swa-test",
    "hash_block_size": 64,
    "groups": [
        # element 4096 B: blocks and the tail ((3 + 4) * 4096 B) are 4096-aligned lengths
        {"name": "ckv", "kind": "COMPRESSED", "block_size": 128, "ratio": 4, "overlap": 4,
         "abi": _abi("float32", [32, 32], "c-1")},
        {"name": "near", "kind": "SWA", "block_size": 64, "window": 128,
         "abi": _abi("float16", [16, 16], "near-1")},
        # 320 = 2.5 blocks: the oldest block of the window is needed from its middle on
        {"name": "far", "kind": "SWA", "block_size": 128, "window": 320,
         "abi": _abi("float16", [16, 16], "far-1")},
        {"name": "kidx", "kind": "INDEXER", "block_size": 128, "ratio": 4, "indexes": "ckv",
         "abi": _abi("float32", [8, 32], "idx-1")},
    ],
})

LCM_192 = spec_from_dict({
    "model_id": "lcm-192-test",
    "hash_block_size": 32,
    "groups": [
        {"name": "c64", "kind": "COMPRESSED", "block_size": 64, "ratio": 4, "overlap": 4,
         "abi": _abi("float32", [32, 32], "c-1")},
        # L = lcm(64, 96) = 192, not a power of two; window 160 starts inside a block
        {"name": "w96", "kind": "SWA", "block_size": 96, "window": 160,
         "abi": _abi("float16", [8, 32], "w-1")},
    ],
})

ALIGNMENTS = (1, 256, 4096, 8192)
S0, S1, S2 = ShardId("s0"), ShardId("s1"), ShardId("s2")
OWNERS = (S0, S1)
POOL_BLOCKS = 20
REFILL = st.sampled_from(["none", "alloc", "part", "whole"])

_MEM_READY = {
    Kind.COMPRESSED: State.COMPRESSED_READY,
    Kind.SWA: State.SWA_VALID,
    Kind.TAIL: State.TAIL_COMPLETE,
    Kind.INDEXER: State.INDEXER_SYNCED,
}


def odd_stride_pools(layout: Layout, n: int) -> dict[str, PoolConfig]:
    """Pools whose stride is an odd multiple of 256: block k is 4096-aligned only when 16
    divides k (and its length allows)."""
    out = {}
    for c in layout.columns:
        stride = max(256, -(-c.nbytes // 256) * 256)
        if (stride // 256) % 2 == 0:
            stride += 256
        out[c.name] = PoolConfig(n, stride, 4096)
    return out


def pools_of(owner: ShardId, layout: Layout) -> dict[str, PoolConfig]:
    if owner == S1:
        return odd_stride_pools(layout, POOL_BLOCKS)
    return pools_for(layout, POOL_BLOCKS if owner == S0 else 8)


# ---- the brute force -----------------------------------------------------------------------


def raw_handle(state: CacheState, rec: ObjRecord) -> Handle:
    """The handle of ``rec`` from its raw fields: its memory owner's block (a DISK copy at
    rest: its disk owner, block -1, address 0), the address that block's offset in the
    current pool of that owner."""
    col = state.layout.columns[rec.column]
    at_rest = rec.kind is Kind.DISK and rec.block < 0 and rec.disk_owner is not None
    shard = rec.disk_owner if at_rest else rec.shard
    assert shard is not None
    address = 0
    if rec.block >= 0:
        address = rec.block * state.owners[shard].pools[rec.column].config.stride
    return Handle(rec.object_id, rec.generation, shard, col.index, rec.block, col.kind,
                  col.name, col.nbytes, col.abi_fingerprint, address)


def check_handle(state: CacheState, handle: Handle) -> None:
    """A handle an allocation, offload or load returned is its record's, field for field."""
    rec = state.objects.get(handle.object_id)
    assert rec is not None, handle
    assert handle == raw_handle(state, rec), (handle, raw_handle(state, rec))


def needed(layout: Layout, c: int, p: int) -> list[int]:
    """Depths whose ``c`` objects a reader resuming at ``p`` needs, from the geometry alone."""
    col, hb = layout.columns[c], layout.hash_block
    n = p // hb
    if col.kind is Kind.TAIL:
        return [n - 1] if n else []
    out = []
    for d in range(n):
        end = (d + 1) * hb
        if end % col.group.block_size:
            continue
        if col.kind is Kind.SWA and end <= p - col.group.window:
            continue
        out.append(d)
    return out


def copy_problem(state: CacheState, entry: PrefixEntry, c: int, rec: ObjRecord, disk: bool,
                 p: int, align: int) -> str | None:
    """Why ``rec`` (the memory record or the disk copy of ``entry``'s column ``c``) cannot
    serve a reader resuming at ``p`` with ``align``-aligned handles (rules 1, 2, 3, 5), or
    None. Rule 4 (indexer versions) is joint and checked by the caller."""
    layout = state.layout
    col = layout.columns[c]
    if disk:
        if rec.state is State.ON_DISK:
            placed = False
            if rec.block != -1:
                return f"disk copy at rest with block {rec.block}"
        elif rec.state is State.ON_DISK_READY:
            placed = True
        else:
            return f"disk copy {rec.state.value}"
    else:
        if rec.state is not _MEM_READY[col.kind]:
            return f"memory {rec.state.value}"
        placed = True
    if placed:
        owner = state.owners.get(rec.shard)
        pool = owner.pools.get(c) if owner is not None else None
        if owner is None or not owner.alive or pool is None:
            return f"placed at owner {rec.shard!r}, which is gone"
        if pool.owner_of(rec.block) is not rec:
            return f"block {rec.block} is not this record's"
        if pool.generation_of(rec.block) != rec.generation:
            return "generation moved on"
        cfg = pool.config
        if alignment(rec.block * cfg.stride, col.nbytes, cfg.base_align) < align:
            return "misaligned"
    if col.kind is Kind.SWA:
        start, end = layout.block_range(c, entry.depth)
        need_lo = max(start, p - col.group.window)
        if not (rec.lo <= need_lo and rec.hi >= end):
            return f"SWA [{rec.lo}, {rec.hi}) does not cover [{need_lo}, {end})"
    if col.kind is Kind.TAIL and rec.hi != col.tail_tokens_at(p):
        return f"tail holds {rec.hi} of {col.tail_tokens_at(p)} tokens"
    return None


def copies(state: CacheState, entry: PrefixEntry, c: int, p: int, align: int
           ) -> list[ObjRecord]:
    out = []
    mem = entry.mem[c]
    if mem is not None and copy_problem(state, entry, c, mem, False, p, align) is None:
        out.append(mem)
    dsk = entry.disk[c] if entry.disk else None
    if dsk is not None and copy_problem(state, entry, c, dsk, True, p, align) is None:
        out.append(dsk)
    return out


def feasible(state: CacheState, hashes: Sequence[BlockHash], p: int, align: int) -> bool:
    layout = state.layout
    entries = [state.index.get(h) for h in hashes[: p // layout.hash_block]]
    if any(e is None for e in entries):
        return False
    indexers = {k.index: [i.index for i in layout.columns if i.indexes == k.index]
                for k in layout.columns if k.kind is Kind.COMPRESSED}
    for col in layout.columns:
        c = col.index
        if col.kind is Kind.INDEXER:
            continue  # chosen with its KV below
        for d in needed(layout, c, p):
            e = entries[d]
            assert e is not None
            kv = copies(state, e, c, p, align)
            if not kv:
                return False
            idx = indexers.get(c, [])
            if idx:
                versions = [{r.version for r in copies(state, e, i, p, align)} for i in idx]
                if not any(r.version != 0 and all(r.version in v for v in versions)
                           for r in kv):
                    return False
    return True


def safe_usable(state: CacheState, hashes: Sequence[BlockHash], limit: int, align: int) -> int:
    lcm = state.layout.lcm
    top = min(limit, len(hashes) * state.layout.hash_block) // lcm * lcm
    for p in range(top, 0, -lcm):
        if feasible(state, hashes, p, align):
            return p
    return 0


def check_match(state: CacheState, hashes: Sequence[BlockHash], limit: int, align: int,
                m: Match) -> None:
    """Rules 1-5 on every handle of ``m``, then its length against the brute force."""
    layout = state.layout
    p = m.usable_tokens
    assert p % layout.lcm == 0 and 0 <= p <= limit, f"usable {p} (limit {limit})"
    if p == 0:
        assert not any(m.handles.values()), "[count] handles on a miss"
    served: dict[tuple[int, int], ObjRecord] = {}
    names = {col.name for col in layout.columns}
    assert set(m.handles) <= names, f"[count] unknown columns {set(m.handles) - names}"
    for col in layout.columns:
        c = col.index
        depths = needed(layout, c, p)
        hs = m.handles.get(col.name, ())
        assert len(hs) == len(depths), (
            f"[count] {col.name} at p={p}: {len(hs)} handles for depths {depths}")
        for d, h in zip(depths, hs, strict=True):
            e = state.index.get(hashes[d])
            assert e is not None
            assert (h.column, h.group, h.kind, h.nbytes) == (c, col.name, col.kind, col.nbytes)
            mem, dsk = e.mem[c], (e.disk[c] if e.disk else None)
            if mem is not None and mem.object_id == h.object_id:
                rec, disk = mem, False
            elif dsk is not None and dsk.object_id == h.object_id:
                rec, disk = dsk, True
            else:
                raise AssertionError(
                    f"[1 live] {col.name}@{d} p={p}: handle names object {h.object_id}, "
                    "neither the memory record nor the disk copy of its slot")
            where = f"{col.name}@{d} p={p} ({'disk' if disk else 'mem'} {rec.state.value})"
            if disk and rec.state is State.ON_DISK:
                assert (h.block, h.shard, h.generation) == (-1, rec.disk_owner, rec.generation), (
                    f"[1 live] {where}: at-rest handle {h}")
            else:
                ok = State.ON_DISK_READY if disk else _MEM_READY[col.kind]
                assert rec.state is ok, f"[1 readable] {where}: not readable"
                assert (h.block, h.generation, h.shard) == (
                    rec.block, rec.generation, rec.shard), f"[1 live] {where}: handle {h}"
                try:
                    state.check_read(h)
                except StaleHandle as err:
                    raise AssertionError(f"[1 check_read] {where}: {err}") from None
                pool = state.owners[rec.shard].pools[c]
                assert h.address == rec.block * pool.config.stride, f"[2 address] {where}"
                assert h.address % align == 0 and h.nbytes % align == 0 and (
                    alignment(h.address, col.nbytes, pool.config.base_align) >= align), (
                    f"[2 align] {where}: address {h.address} nbytes {h.nbytes} "
                    f"not {align}-aligned")
            if col.kind is Kind.SWA:
                start, end = layout.block_range(c, d)
                need_lo = max(start, p - col.group.window)
                assert rec.lo <= need_lo and rec.hi >= end, (
                    f"[3 swa] {where}: [{rec.lo}, {rec.hi}) served for [{need_lo}, {end})")
            if col.kind is Kind.TAIL:
                assert rec.hi == col.tail_tokens_at(p), (
                    f"[5 tail] {where}: {rec.hi} of {col.tail_tokens_at(p)} tokens")
            served[(c, d)] = rec
    for (c, d), rec in served.items():
        kv_col = layout.columns[c].indexes
        if kv_col is None:
            continue
        kv = served.get((kv_col, d))
        assert kv is not None, f"[4 idx] {layout.columns[c].name}@{d} served without its KV"
        what = (f"{layout.columns[c].name}@{d} p={p}: indexer version {rec.version} "
                f"({'disk' if rec.kind is Kind.DISK else 'mem'}), KV handle's version "
                f"{kv.version} ({'disk' if kv.kind is Kind.DISK else 'mem'} {kv.state.value})")
        assert rec.version == kv.version, f"[4 idx version] {what}"
        assert rec.version != 0, f"[4 idx version 0] {what}"
    safe = safe_usable(state, hashes, limit, align)
    assert p <= safe, f"[unsafe] usable {p} > brute-force {safe} (align {align})"
    if p < safe:
        kind, why = _miss_kind(state, hashes, align, m, safe)
        if kind.__name__ in ACCEPTED_MISSES:
            return
        raise kind(f"[needless miss: {why}] usable {p} < brute-force {safe} (align {align}, "
                   f"downgrades {[(d.reason.value, d.group, d.position) for d in m.downgrades]})")


_MISS_KINDS: dict[str, type[AssertionError]] = {}
# Misses the design accepts (docs/architecture.md, "Recovery contracts"): outside SWA, the
# copy that serves a column is chosen by readiness alone (memory, then a loaded disk copy, then
# one at rest), not by the alignment a request asks for, so one entry's gate serves every
# request. A misaligned served copy is a MISALIGNED downgrade even where another copy of the
# same block could have been loaded aligned. Reuse given up, never safety.
ACCEPTED_MISSES = frozenset({"MissMisalignedCopyHidesRestCopy",
                             "MissMisalignedCopyHidesPlacedCopy",
                             "MissMisalignedCopyHidesPlacedRestCopy",
                             "MissShrinkMisaligned"})


def _miss_kind(state: CacheState, hashes: Sequence[BlockHash], align: int, m: Match,
               safe: int) -> tuple[type[AssertionError], str]:
    """A needless miss, classified (one exception type per class, so hypothesis reports
    each class as a distinct failure with its own shortest example)."""
    layout = state.layout
    stop = m.matched_tokens // layout.hash_block
    reason = m.downgrades[0].reason.value if m.downgrades else "none"
    if stop < safe // layout.hash_block:
        e = state.index.get(hashes[stop])
        why = f"walk stopped at depth {stop}: {reason}"
        if e is not None and reason == "MISALIGNED":
            bad = []  # placed records at the stop below the alignment asked for
            for c in layout.attached[e.depth % layout.period]:
                if layout.columns[c].kind in (Kind.SWA, Kind.TAIL):
                    continue  # checked where needed, never in the walk's gate
                for rec, disk in ((e.mem[c], False), (e.disk[c] if e.disk else None, True)):
                    if rec is None or rec.block < 0:
                        continue
                    if copy_problem(state, e, c, rec, disk, safe, 1) == f"memory {rec.state.value}":
                        continue  # not readable at all: no gate is computed from it
                    pool = state.owners[rec.shard].pools[c]
                    if alignment(rec.block * pool.config.stride, layout.columns[c].nbytes,
                                 pool.config.base_align) < align:
                        usable = copy_problem(state, e, c, rec, disk, safe, 1) is None
                        bad.append((layout.columns[c].name, "disk" if disk else "mem",
                                    stop in needed(layout, c, safe), usable))
            if bad and not any(need for _, _, need, _ in bad):
                name = "MissUnneededBlockMisaligned"
                why = f"{why} on {bad} (column, copy, needed at {safe}, usable)"
            elif any(need and not usable for _, _, need, usable in bad):
                name = "MissGateFromUnservedCopy"
                why = f"{why} on {bad} (column, copy, needed at {safe}, usable)"
            elif bad:
                others = set()
                for n_, copy, _, _ in bad:
                    c = layout.by_name[n_]
                    other = e.disk[c] if copy == "mem" and e.disk else e.mem[c]
                    if other is not None:
                        others.add("Rest" if other.block < 0 else "Placed")
                name = f"MissMisalignedCopyHides{''.join(sorted(others))}Copy"
                why = f"{why} on {bad} (column, copy, needed at {safe}, usable)"
            else:
                name = "MissMisalignedOther"
        elif e is not None and reason == "INDEXER_STALE":
            kv_ready = [e.mem[k.indexes].state is State.COMPRESSED_READY
                        for k in layout.columns
                        if k.indexes is not None and e.mem[k.indexes] is not None]
            if kv_ready and all(kv_ready):
                name = "MissIndexerStaleMemKvHidesDiskPair"
                why = f"{why}: a readable memory KV at another version hides a disk KV copy"
            else:
                name = "MissIndexerStaleVsUnreadableKv"
                why = f"{why}: compared with an unreadable (or absent) memory KV"
        else:
            name = f"MissWalkStop{reason.title().replace('_', '')}"
    elif _tail_hidden(state, hashes, align, safe):
        name, why = "MissShrinkMisaligned", f"shrunk: the tail served at {safe} is misaligned"
    else:  # what refused the resume point the brute force takes
        at = [d.reason.value for d in m.downgrades if d.position == safe] or [reason]
        name, why = f"MissShrink{at[0].title().replace('_', '')}", f"shrunk: {at[0]}"
    kind = _MISS_KINDS.get(name)
    if kind is None:
        kind = _MISS_KINDS[name] = type(name, (AssertionError,), {})
    return kind, why


def _tail_hidden(state: CacheState, hashes: Sequence[BlockHash], align: int, p: int) -> bool:
    """A tail at ``p`` whose complete memory copy (the one served first) is placed below
    ``align``, while another copy of it could serve: the accepted miss of a tail."""
    layout = state.layout
    e = state.index.get(hashes[p // layout.hash_block - 1])
    for c in (e and layout.attached[e.depth % layout.period]) or ():
        mem = e.mem[c] if e is not None else None
        if layout.columns[c].kind is not Kind.TAIL or mem is None:
            continue
        if mem.state is State.TAIL_COMPLETE and copy_problem(state, e, c, mem, False, p,
                                                             align) == "misaligned":
            return True
    return False


# ---- the machine ---------------------------------------------------------------------------


class HandleMachine(RuleBasedStateMachine):
    SPEC: CacheSpec
    DEPTHS: int

    def __init__(self) -> None:
        super().__init__()
        lay = Layout(self.SPEC)
        self.state = CacheState(
            self.SPEC,
            StateConfig(memo_min_blocks=1, segment_blocks=2 * lay.period),
            clock=lambda: 1000.0,  # leases expire only when released
        )
        self.layout = self.state.layout
        self.H = self.layout.hash_block
        for o in OWNERS:
            self.state.register_owner(o, pools_of(o, self.layout))
        self.s2_incarnation: int | None = None
        rng = np.random.default_rng(7)
        a = rng.integers(0, 1000, self.DEPTHS * self.H)
        half = self.DEPTHS // 2 * self.H
        b = np.concatenate([a[:half], rng.integers(1000, 2000, self.DEPTHS * self.H - half)])
        self.chains = [hash_blocks(t, self.H, ExtraKeys(self.SPEC.model_id)) for t in (a, b)]
        # Ballast: another prompt's objects, allocated on s1 and never written, hold s1's
        # block 0 of every column (the one block there aligned to every power of two up to
        # 4096), so what s1 places is misaligned for 4096 until the ballast goes.
        ballast = hash_blocks(rng.integers(2000, 3000, self.layout.period * self.H), self.H,
                              ExtraKeys(self.SPEC.model_id))
        self.state.allocate(ballast, [
            AllocRequest(d, self.layout.columns[c].name)
            for d in range(self.layout.period) for c in self.layout.attached[d]], S1)
        self.leases: list[int] = []
        self._cache: dict[tuple[Any, ...], list[ObjRecord]] = {}
        self._steps = 0
        self.kinds = {k: [c.index for c in self.layout.columns if c.kind is k] for k in Kind}

    # ---- helpers -------------------------------------------------------------------------
    def _column(self, i: int, kind: Kind | None = None) -> int | None:
        cols = self.kinds[kind] if kind is not None else range(len(self.layout.columns))
        return cols[i % len(cols)] if cols else None

    def _depth(self, c: int, i: int) -> int:
        living = [d for d in range(self.DEPTHS) if self.layout.lives_at(c, d)]
        return living[i % len(living)]

    def _entry(self, chain: int, d: int) -> PrefixEntry | None:
        return self.state.index.get(self.chains[chain][d])

    def _alloc(self, chain: int, d: int, c: int, owner: int | None) -> ObjRecord | None:
        """The memory record of the slot, allocated if empty (None if refused)."""
        name = self.layout.columns[c].name
        shard = None if owner is None else OWNERS[owner]
        with suppress(HkvError):  # pool exhausted by leases, or the owner is down
            for a in self.state.allocate(self.chains[chain][: d + 1], [AllocRequest(d, name)],
                                         shard):
                check_handle(self.state, a.handle)
        e = self._entry(chain, d)
        return e.mem[c] if e is not None else None

    def _records(self, disk: bool, states: frozenset[State] | None = None
                 ) -> list[ObjRecord]:
        """Live memory records (or disk copies), in index order; cached until the view's
        next transition (preconditions ask for them on every step)."""
        log = self.state.log
        key = (disk, states, log[-1].seq if log else 0, len(self.state.objects))
        got = self._cache.get(key)
        if got is None:
            if len(self._cache) > 16:
                self._cache.clear()
            got = []
            for e in self.state.index.values():
                recs = (e.disk or []) if disk else e.mem
                got += [r for r in recs
                        if r is not None and (states is None or r.state in states)]
            self._cache[key] = got
        return got

    def _kv_version(self, e: PrefixEntry, kv_col: int) -> int:
        mem = e.mem[kv_col]
        if mem is not None and mem.state is State.COMPRESSED_READY:
            return mem.version
        dsk = e.disk[kv_col] if e.disk else None
        if dsk is not None and dsk.state is State.ON_DISK_READY:
            return dsk.version
        return mem.version if mem is not None else 1

    def _write(self, rec: ObjRecord, mode: int, version: int | None) -> None:
        """Move a memory record on to a written state; ``mode`` picks whole or partial."""
        col = self.layout.columns[rec.column]
        oid, tr = rec.object_id, self.state.transition
        with suppress(HkvError):  # illegal from this state, held, or a shrinking SWA range
            if col.kind is Kind.COMPRESSED:
                tr(oid, Event.WRITE_DONE, Params(version=version))
            elif col.kind is Kind.SWA:
                start, end = self.layout.block_range(rec.column, rec.entry.depth)
                lo = start + (mode % 4) * (col.group.block_size // 4 or 1) if mode >= 4 else start
                hi = end - 1 if mode in (1, 5) else end
                tr(oid, Event.WRITE_DONE, Params(lo=min(lo, hi), hi=hi))
            elif col.kind is Kind.TAIL:
                need = self.layout.tail_tokens(rec.column, rec.entry.depth)
                if mode % 2 and need > 1:
                    tr(oid, Event.TAIL_APPEND, Params(tail_len=need - 1))
                else:
                    tr(oid, Event.TAIL_DONE, Params(tail_len=need))
            else:
                tr(oid, Event.WRITE_DONE)
                if mode % 2 == 0:
                    kv_col = col.indexes
                    assert kv_col is not None
                    v = self._kv_version(rec.entry, kv_col)
                    tr(oid, Event.INDEXER_SYNC, Params(version=v))

    # ---- writers -------------------------------------------------------------------------
    @initialize(a=st.integers(0, 64), b=st.integers(0, 64), owner=st.sampled_from([None, 0, 1]))
    def start(self, a: int, b: int, owner: int | None) -> None:
        """Start from written prefixes (often whole chains): lookups then hit, and the rules
        that act on what a hit serves get their turn."""
        for chain, upto in enumerate((a, b)):
            self._write_prefix(chain, min(self.DEPTHS, upto % (self.DEPTHS + 4) + 1), owner)

    @rule(chain=st.integers(0, 1), upto=st.integers(1, 64),
          owner=st.sampled_from([None, 0, 1]))
    def write_prefix(self, chain: int, upto: int, owner: int | None) -> None:
        """Every column of depths [0, upto), whole: a prefix lookups hit."""
        self._write_prefix(chain, upto % self.DEPTHS + 1, owner)

    def _write_prefix(self, chain: int, upto: int, owner: int | None) -> None:
        for d in range(upto):
            for c in self.layout.attached[d % self.layout.period]:
                rec = self._alloc(chain, d, c, owner)
                if rec is not None and rec.state is State.ALLOCATED:
                    self._write(rec, 0, None)

    @rule(chain=st.integers(0, 1), i=st.integers(0, 63), c=st.integers(0, 15),
          owner=st.sampled_from([None, 0, 1]), mode=st.integers(0, 7),
          version=st.one_of(st.none(), st.integers(2**62, 2**63 - 1)))
    def write(self, chain: int, i: int, c: int, owner: int | None, mode: int,
              version: int | None) -> None:
        """One object, whole or partial (SWA short ranges, partial tails, unsynced indexers);
        an SWA record already valid may be rewritten over a wider range."""
        col = self._column(c)
        assert col is not None
        rec = self._alloc(chain, self._depth(col, i), col, owner)
        if rec is not None and (rec.state is State.ALLOCATED or rec.state is State.SWA_VALID
                                or rec.state is State.INDEXER_WRITTEN):
            self._write(rec, mode, version)

    @rule(chain=st.integers(0, 1), i=st.integers(0, 63), c=st.integers(0, 15),
          owner=st.sampled_from([None, 0, 1]))
    def reallocate(self, chain: int, i: int, c: int, owner: int | None) -> None:
        """An empty slot (evicted, its disk copy perhaps still there) allocated and left
        ALLOCATED: a writer started and has not finished."""
        col = self._column(c)
        assert col is not None
        self._alloc(chain, self._depth(col, i), col, owner)

    @rule(chain=st.integers(0, 1), i=st.integers(0, 63), c=st.integers(0, 15),
          owner=st.sampled_from([None, 0, 1]),
          how=st.sampled_from(["fresh", "view", "disk"]),
          version=st.integers(2**62, 2**63 - 1), resync=st.booleans())
    def rewrite_kv(self, chain: int, i: int, c: int, owner: int | None, how: str,
                   version: int, resync: bool) -> None:
        """A COMPRESSED block recomputed: evicted, written again with a new content version
        (or the view's, or its disk copy's: the same bytes again); its indexer maybe resynced."""
        col = self._column(c, Kind.COMPRESSED)
        if col is None:
            return
        d = self._depth(col, i)
        e = self._entry(chain, d)
        if e is not None and e.mem[col] is not None:
            with suppress(HkvError):  # held by a lease
                self.state.evict(e.mem[col].object_id)
        rec = self._alloc(chain, d, col, owner)
        if rec is None or rec.state is not State.ALLOCATED:
            return
        dsk = rec.entry.disk[col] if rec.entry.disk else None
        v = {"fresh": version, "view": None,
             "disk": dsk.version if dsk is not None else version}[how]
        self._write(rec, 0, v)
        if resync:
            for ic in self.kinds[Kind.INDEXER]:
                if self.layout.columns[ic].indexes == col:
                    irec = self._alloc(chain, d, ic, owner)
                    if irec is not None and irec.state in (State.ALLOCATED,
                                                           State.INDEXER_WRITTEN,
                                                           State.INDEXER_SYNCED):
                        if irec.state is State.INDEXER_SYNCED:
                            with suppress(HkvError):  # held
                                self.state.transition(irec.object_id, Event.WRITE_DONE)
                        self._write(irec, 0, None)

    # ---- version 0 (refused after the fix; if accepted, no Match may break the rules) ----
    @rule(chain=st.integers(0, 1), i=st.integers(0, 63), c=st.integers(0, 15),
          owner=st.sampled_from([None, 0, 1]), sync=st.booleans(), over_disk=st.booleans(),
          swap=st.booleans())
    def version_zero_write(self, chain: int, i: int, c: int, owner: int | None,
                           sync: bool, over_disk: bool, swap: bool) -> None:
        """A KV written with version 0 (``over_disk``: after its written block went to disk,
        whose copy keeps its version), its indexers maybe synced to 0, and then maybe all of
        them swapped out with their memory slots allocated again."""
        col = self._column(c, Kind.COMPRESSED)
        if col is None:
            return
        d = self._depth(col, i)
        e = self._entry(chain, d)
        if over_disk and e is not None and e.mem[col] is not None:
            self._swap([e.mem[col]], 0, None, "rest", "none")
        rec = self._alloc(chain, d, col, owner)
        if rec is not None and rec.state is State.ALLOCATED:
            with suppress(HkvError):
                self.state.transition(rec.object_id, Event.WRITE_DONE, Params(version=0))
        cols = [col] + [ic for ic in self.kinds[Kind.INDEXER]
                        if self.layout.columns[ic].indexes == col]
        for ic in cols[1:] if sync else ():
            irec = self._alloc(chain, d, ic, owner)
            if irec is None:
                continue
            if irec.state is State.ALLOCATED:
                with suppress(HkvError):
                    self.state.transition(irec.object_id, Event.WRITE_DONE)
            with suppress(HkvError):
                self.state.transition(irec.object_id, Event.INDEXER_SYNC, Params(version=0))
        e = self._entry(chain, d)
        if swap and e is not None:
            self._swap([r for k in cols if (r := e.mem[k]) is not None], 0, None, "rest",
                       "alloc")

    @rule(chain=st.integers(0, 1), i=st.integers(0, 63), c=st.integers(0, 15),
          disk=st.booleans())
    def version_zero_confirm(self, chain: int, i: int, c: int, disk: bool) -> None:
        """A third owner vouches for a KV (and its indexers) at version 0, in memory or at
        rest in its disk tier."""
        col = self._column(c, Kind.COMPRESSED)
        if col is None:
            return
        if self.s2_incarnation is None:
            self.s2_incarnation = self.state.register_owner(S2, pools_of(S2, self.layout))
        d = self._depth(col, i)
        hashes = self.chains[chain]
        cols = [col] + [ic for ic in self.kinds[Kind.INDEXER]
                        if self.layout.columns[ic].indexes == col]
        reports = []
        pools = self.state.owners[S2].pools
        for k in cols:
            kind = self.layout.columns[k].kind
            state = State.ON_DISK if disk else _MEM_READY[kind]
            block = -1 if disk else (pools[k].free[0] if pools[k].free else 0)
            reports.append(ObjectReport(hashes[d], hashes[d - 1] if d else None, d,
                                        self.layout.columns[k].name, state, block, 0, 0))
        with suppress(HkvError):
            self.state.confirm(S2, reports, self.s2_incarnation)

    # ---- eviction, disk ------------------------------------------------------------------
    @precondition(lambda self: bool(self._records(False)))
    @rule(i=st.integers(0, 10_000))
    def evict(self, i: int) -> None:
        recs = self._records(False)
        with suppress(HkvError):  # held, or a state eviction refuses
            self.state.evict(recs[i % len(recs)].object_id)

    @precondition(lambda self: bool(self._records(True)))
    @rule(i=st.integers(0, 10_000))
    def evict_disk(self, i: int) -> None:
        """A loaded copy is dropped (back at rest); a copy at rest is evicted."""
        recs = self._records(True)
        with suppress(HkvError):
            self.state.evict(recs[i % len(recs)].object_id)

    def _offload(self, rec: ObjRecord, disk_owner: int, outcome: str) -> ObjRecord | None:
        shard = OWNERS[disk_owner]
        if not self.state.owners[shard].alive:
            return None
        try:
            d = self.state.begin_offload(rec.object_id, shard)
        except HkvError:  # not readable, or admission
            return None
        check_handle(self.state, d)
        drec = self.state.objects.get(d.object_id)
        if drec is None or drec.state is not State.OFFLOADING:
            return drec
        if outcome == "commit":
            self.state.transition(d.object_id, Event.OFFLOAD_COMMITTED)
        elif outcome == "fail":
            self.state.transition(d.object_id, Event.OFFLOAD_FAILED)
        return self.state.objects.get(d.object_id)

    def _load(self, drec: ObjRecord, owner: int | None, outcome: str) -> None:
        try:
            t = self.state.begin_load(drec.object_id, None if owner is None else OWNERS[owner])
        except HkvError:  # no free block, admission
            return
        check_handle(self.state, t)
        if outcome == "verified":
            self.state.transition(t.object_id, Event.LOAD_VERIFIED)
        elif outcome == "failed":
            self.state.transition(t.object_id, Event.LOAD_FAILED)

    @precondition(lambda self: bool(self._records(False)))
    @rule(i=st.integers(0, 10_000), disk_owner=st.integers(0, 1),
          outcome=st.sampled_from(["commit", "fail", "inflight"]))
    def offload(self, i: int, disk_owner: int, outcome: str) -> None:
        recs = self._records(False)
        self._offload(recs[i % len(recs)], disk_owner, outcome)

    @precondition(lambda self: bool(self._records(True, frozenset({State.ON_DISK}))))
    @rule(i=st.integers(0, 10_000), owner=st.sampled_from([None, 0, 1]),
          outcome=st.sampled_from(["verified", "failed", "inflight"]))
    def load(self, i: int, owner: int | None, outcome: str) -> None:
        recs = self._records(True, frozenset({State.ON_DISK}))
        self._load(recs[i % len(recs)], owner, outcome)

    @precondition(lambda self: bool(self._records(
        True, frozenset({State.OFFLOADING, State.ON_DISK_INFLIGHT}))))
    @rule(i=st.integers(0, 10_000))
    def finish_transfer(self, i: int) -> None:
        recs = self._records(True, frozenset({State.OFFLOADING, State.ON_DISK_INFLIGHT}))
        rec = recs[i % len(recs)]
        ev = Event.OFFLOAD_COMMITTED if rec.state is State.OFFLOADING else Event.LOAD_VERIFIED
        self.state.transition(rec.object_id, ev)

    def _swap(self, recs: Sequence[ObjRecord], disk_owner: int, owner: int | None, back: str,
              refill: str) -> None:
        """Offload ``recs`` (committed), then evict them from memory, then maybe load the
        copies back, and refill the memory slots: allocated only, or written again in part
        or whole (a KV and its indexer go together)."""
        drecs = [(rec, self._offload(rec, disk_owner, "commit")) for rec in recs]
        drecs = [(rec, d) for rec, d in drecs if d is not None]
        for rec, _ in drecs:
            if rec.state not in TERMINAL_STATES:
                with suppress(HkvError):  # held
                    self.state.evict(rec.object_id)
        for rec, drec in drecs:
            if back != "rest" and drec.state is State.ON_DISK:
                self._load(drec, owner, back)
            entry, c = rec.entry, rec.column
            if refill != "none" and entry.mem[c] is None and (
                    self.state.index.get(entry.block_hash) is entry):
                chain = next(j for j, hs in enumerate(self.chains)
                             if entry.depth < len(hs) and hs[entry.depth] == entry.block_hash)
                # the other owner than the load's: the two copies' alignments then differ
                new = self._alloc(chain, entry.depth, c, None if owner is None else 1 - owner)
                if new is not None and refill != "alloc":
                    self._write(new, 0 if refill == "whole" else 5, None)

    @precondition(lambda self: bool(self._records(False)))
    @rule(i=st.integers(0, 10_000), disk_owner=st.integers(0, 1),
          owner=st.sampled_from([None, 0, 1]),
          back=st.sampled_from(["verified", "rest", "inflight"]), refill=REFILL)
    def swap_out(self, i: int, disk_owner: int, owner: int | None, back: str,
                 refill: str) -> None:
        """Offload a written object, evict it from memory, maybe load the copy back and maybe
        re-allocate the memory slot: the paths on which lookups serve disk copies."""
        recs = self._records(False)
        self._swap([recs[i % len(recs)]], disk_owner, owner, back, refill)

    @precondition(lambda self: any(r.kind is Kind.SWA for r in self._records(False)))
    @rule(i=st.integers(0, 10_000), owner=st.integers(0, 1),
          refill=st.sampled_from(["part", "whole"]))
    def swap_out_swa(self, i: int, owner: int, refill: str) -> None:
        """:meth:`swap_out` of an SWA block, loaded back on one owner and written again on the
        other, in part or whole: two readable copies of one slot at different alignments
        (and, in part, over different ranges)."""
        recs = [r for r in self._records(False) if r.kind is Kind.SWA]
        self._swap([recs[i % len(recs)]], 0, owner, "verified", refill)

    @precondition(lambda self: bool(self._records(False)))
    @rule(i=st.integers(0, 10_000), disk_owner=st.integers(0, 1),
          owner=st.sampled_from([None, 0, 1]), back=st.sampled_from(["verified", "rest"]),
          refill=REFILL)
    def swap_out_entry(self, i: int, disk_owner: int, owner: int | None, back: str,
                       refill: str) -> None:
        """:meth:`swap_out` of every memory record of one entry (a KV with its indexer)."""
        recs = self._records(False)
        entry = recs[i % len(recs)].entry
        self._swap([r for r in entry.mem if r is not None], disk_owner, owner, back, refill)

    # ---- owners --------------------------------------------------------------------------
    @rule(budget=st.integers(1, 64))
    def reap_some(self, budget: int) -> None:
        """Bury some of what lost owners left (an owner loss is O(1): until a slice or a
        touch reaches them, its objects linger, dead; nothing may serve or reuse them)."""
        self.state.reap(budget)

    @rule(i=st.integers(0, 2), back=st.booleans())
    def lose_owner(self, i: int, back: bool) -> None:
        shard = (S0, S1, S2)[i]
        if shard not in self.state.owners:
            return
        self.state.mark_owner_lost(shard)
        if back:
            inc = self.state.register_owner(shard, pools_of(shard, self.layout))
            if shard == S2:
                self.s2_incarnation = inc

    # ---- readers -------------------------------------------------------------------------
    @rule(chain=st.integers(0, 1), n=st.one_of(st.none(), st.integers(1, 64)),
          cut=st.one_of(st.none(), st.integers(0, 64)),
          align=st.sampled_from(ALIGNMENTS), lease=st.booleans(), repeat=st.integers(1, 3))
    def lookup(self, chain: int, n: int | None, cut: int | None, align: int, lease: bool,
               repeat: int) -> None:
        """The first ``n`` hashes of a chain (None: all), resuming at ``cut`` half-LCM blocks
        (None: every hashed token)."""
        n = self.DEPTHS if n is None else n % self.DEPTHS + 1
        hashes = self.chains[chain][:n]
        resume = None if cut is None else min(n * self.H, cut * self.layout.lcm // 2)
        limit = n * self.H if resume is None else resume
        req = LookupRequest(hashes, resume_tokens=resume, alignment=align,
                            lease_ttl_s=5.0 if lease else 0.0)
        for _ in range(repeat):  # a repeat may be answered by the memo
            m = self.state.lookup(req)
            check_match(self.state, hashes, limit, align, m)
            if m.lease_id is not None:
                self.leases.append(m.lease_id)

    @invariant()
    def every_state_looked_up(self) -> None:
        """After every step: both chains at every alignment (resuming at each resume point in
        turn, or at the end), checked the same way."""
        self._steps += 1
        points = [None, *range(self.layout.lcm, self.DEPTHS * self.H, self.layout.lcm)]
        for j, hashes in enumerate(self.chains):
            resume = points[(self._steps + j) % len(points)]  # each resume point in turn
            limit = len(hashes) * self.H if resume is None else resume
            for align in ALIGNMENTS:
                m = self.state.lookup(LookupRequest(hashes, resume, alignment=align))
                check_match(self.state, hashes, limit, align, m)

    @precondition(lambda self: bool(self.leases))
    @rule(i=st.integers(0, 10_000))
    def release_lease(self, i: int) -> None:
        self.state.release_lease(self.leases.pop(i % len(self.leases)))


def _machine(name: str, spec: CacheSpec, depths: int) -> type[HandleMachine]:
    cls = type(name, (HandleMachine,), {"SPEC": spec, "DEPTHS": depths})
    cls.TestCase.settings = settings(
        max_examples=int(os.environ.get("HKV_HANDLES_EXAMPLES", 30)),  # more: set it
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    return cls


ReferenceSpecMachine = _machine("ReferenceSpecMachine", default_spec(), 8)
TwoSwaMachine = _machine("TwoSwaMachine", TWO_SWA, 12)
Lcm192Machine = _machine("Lcm192Machine", LCM_192, 24)

TestHandlesReferenceSpec = ReferenceSpecMachine.TestCase
TestHandlesTwoSwaWindows = TwoSwaMachine.TestCase
TestHandlesLcm192 = Lcm192Machine.TestCase
