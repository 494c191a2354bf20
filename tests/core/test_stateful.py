"""Stateful property test: random interleavings of allocate / write / commit / evict / offload /
load / drop or evict disk copies / owner loss / reported loss and corruption / lease / capture /
lookup / read, checked against an independent oracle written here.

Safety: the funnel never reports a usable token the oracle says is unsafe.
No needless misses: it never reports less than the longest prefix the oracle says is safe.
(No exception is intended: with alignment 1 and the reader's own ABI both bounds are exact.)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hkv_service.core.api import AllocRequest, LookupRequest, Match, Params, StateConfig
from hkv_service.core.errors import IllegalTransition, StaleHandle, UnsetVersion
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event
from hkv_service.specs import demo_spec
from hkv_service.testing import pools_for

# the reference layout with a recurrent group ("gla": a state object at each resume point), so
# every kind of object is in the interleavings (issue 37)
SPEC = demo_spec()
H, L, W = 64, 128, 128
DEPTHS = 8
SHARDS = (ShardId("s0"), ShardId("s1"))
_rng = np.random.default_rng(1)
_a = _rng.integers(0, 1000, DEPTHS * H)
_b = np.concatenate([_a[: 4 * H], _rng.integers(1000, 2000, 4 * H)])  # shares 4 blocks with A
CHAINS = [hash_blocks(t, H, ExtraKeys(SPEC.model_id)) for t in (_a, _b)]
COLUMNS = tuple(c.name for c in CacheState(SPEC).layout.columns)  # c128 has no tail
AT_BOUNDARY = tuple(c for c in COLUMNS if c.endswith(".tail") or c == "gla")  # at p only


def lives_at(col: str, depth: int) -> bool:
    end = (depth + 1) * H
    if col in AT_BOUNDARY:
        return end % L == 0
    return end % (128 if col == "c128" else 64) == 0


@dataclass
class Slot:
    """Oracle view of one (hash, column): what was written, and where copies are."""

    oid: int | None = None
    status: str | None = None  # alloc / ready / partial / written / synced
    version: int = 0
    shard: ShardId | None = None
    disk_oid: int | None = None
    disk: str | None = None  # offloading / rest / inflight / ready
    disk_version: int = 0
    disk_copy_shard: ShardId | None = None
    disk_copy: tuple[int, int] | None = None  # (block, generation) of the last load's copy
    disk_partial: bool = False  # SWA copy of a short [lo, hi) range
    pins: int = 0  # leases and captures on the memory object
    disk_pins: int = 0  # ... and on the disk object (at rest or loaded)

    def live(self, oid: int, disk: bool) -> bool:
        """``oid`` is still this slot's memory object (or its disk object)."""
        return self.disk_oid == oid if disk else self.oid == oid

    def readable(self, oid: int, disk: bool, where: tuple[int, int]) -> bool:
        """A handle on ``oid`` at ``where`` (block, generation) still points at its bytes: a
        disk object's copy can be dropped and loaded again into another block."""
        return self.live(oid, disk) and (not disk or (self.disk == "ready"
                                                      and self.disk_copy == where))

    def pin(self, oid: int, disk: bool, n: int) -> None:
        if self.live(oid, disk):
            if disk:
                self.disk_pins = max(0, self.disk_pins + n)
            else:
                self.pins = max(0, self.pins + n)


# the slot, the object id held, whether it is the disk object, the handle's (block, generation)
Hold = tuple[Slot, int, bool, tuple[int, int]]


@dataclass
class Oracle:
    slots: dict[tuple[bytes, str], Slot] = field(default_factory=dict)

    def slot(self, h: bytes, col: str) -> Slot:
        return self.slots.setdefault((h, col), Slot())

    def versions(self, h: bytes, col: str, ready: str) -> set[int]:
        """Versions of the usable copies (memory in state ``ready``, disk at rest or loaded)."""
        s = self.slot(h, col)
        out = {s.version} if s.status == ready else set()
        return out | ({s.disk_version} if s.disk in ("rest", "ready") else set())

    def usable(self, h: bytes, col: str) -> bool:
        s = self.slot(h, col)
        if col in ("idx", "c4"):  # a KV and its indexer serve together, copies at one version
            both = self.versions(h, "c4", "ready") & self.versions(h, "idx", "synced")
            return bool(both - {0})
        return s.status == "ready" or (s.disk in ("rest", "ready") and not s.disk_partial)

    def safe_prefix(self, chain: list[bytes], resume: int) -> int:
        for p in range(resume // L * L, 0, -L):
            if self._safe_at(chain, p):
                return p
        return 0

    def _safe_at(self, chain: list[bytes], p: int) -> bool:
        for d in range(p // H):
            for col in ("c4", "c128", "idx"):
                if lives_at(col, d) and not self.usable(chain[d], col):
                    return False
            if (d + 1) * H > p - W and not self.usable(chain[d], "swa"):
                return False
        # the tails and the recurrent state as of exactly p
        return all(self.usable(chain[p // H - 1], t) for t in AT_BOUNDARY)


class FunnelMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # the lookup memo on for every length and walk segments of 2 blocks: repeated lookups
        # are answered from the memo, walks take certified runs whole, and every answer is
        # checked against the oracle and a block-by-block walk (memo and segments off) below
        self.state = CacheState(SPEC, StateConfig(memo_min_blocks=1, segment_blocks=2))
        for s in SHARDS:
            self.state.register_owner(s, pools_for(self.state.layout, 64))
        self.oracle = Oracle()
        self.leases: list[tuple[int, list[Hold]]] = []
        self.captures: list[tuple[int, list[Hold]]] = []
        self.handles: list = []

    # ---- writers -----------------------------------------------------------------------
    @rule(
        chain=st.integers(0, 1),
        depth=st.integers(0, DEPTHS - 1),
        col=st.sampled_from(COLUMNS),
        complete=st.booleans(),
    )
    def write(self, chain: int, depth: int, col: str, complete: bool) -> None:
        if not lives_at(col, depth):
            return
        hs = CHAINS[chain]
        slot = self.oracle.slot(hs[depth], col)
        (a,) = self.state.allocate(hs[: depth + 1], [AllocRequest(depth, col)])
        if slot.status is not None:
            assert a.existing and a.handle.object_id == slot.oid
            return
        assert not a.existing
        slot.oid, slot.status, slot.shard = a.handle.object_id, "alloc", a.handle.shard
        oid = a.handle.object_id
        if col.endswith(".tail"):
            need = self.state.layout.columns[a.handle.column].tail_tokens_at((depth + 1) * H)
            if complete or need == 0:
                self.state.transition(oid, Event.TAIL_DONE, Params(tail_len=need))
                slot.status = "ready"
            else:
                self.state.transition(oid, Event.TAIL_APPEND, Params(tail_len=need - 1 or 1))
                slot.status = "partial"
        elif col == "swa":
            hi = (depth + 1) * H if complete else (depth + 1) * H - 1
            self.state.transition(oid, Event.WRITE_DONE, Params(lo=depth * H, hi=hi))
            slot.status = "ready" if complete else "partial"
        elif col == "idx":
            self.state.transition(oid, Event.WRITE_DONE)
            slot.status = "written"
            if complete:
                self._sync(hs[depth], slot)
        else:
            slot.version = self.state.transition(oid, Event.WRITE_DONE).version
            slot.status = "ready"

    @initialize(a=st.integers(0, DEPTHS), b=st.integers(0, DEPTHS))
    def start_with_prefixes(self, a: int, b: int) -> None:
        """Often start from written prefixes (0 = none): lookups then hit, and the rules that
        act on what a hit hands out (leases and captures on loaded copies) get their turn."""
        for chain, upto in enumerate((a, b)):
            if upto:
                self.write_prefix(chain, upto)

    @rule(chain=st.integers(0, 1), upto=st.integers(1, DEPTHS))
    def write_prefix(self, chain: int, upto: int) -> None:
        """Every column of depths [0, upto), complete: a prefix whose walk completes (the
        lookup memo keeps only those)."""
        for depth in range(upto):
            for col in COLUMNS:
                self.write(chain, depth, col, True)

    def _sync(self, h: bytes, slot: Slot) -> None:
        kv = self.oracle.slot(h, "c4")
        assert slot.oid is not None
        if kv.status == "ready" or (kv.status is None and kv.disk == "ready"):
            v = kv.version if kv.status == "ready" else kv.disk_version
            self.state.transition(slot.oid, Event.INDEXER_SYNC, Params(version=v))
            slot.status, slot.version = "synced", v
        else:
            try:  # a KV never written has no version: 0 is refused as unset
                self.state.transition(slot.oid, Event.INDEXER_SYNC, Params(version=kv.version))
            except (IllegalTransition, UnsetVersion):
                return
            raise AssertionError("indexer synced although its KV is not COMPRESSED_READY")

    @rule(chain=st.integers(0, 1), depth=st.integers(0, DEPTHS - 1))
    def resync_indexer(self, chain: int, depth: int) -> None:
        slot = self.oracle.slot(CHAINS[chain][depth], "idx")
        if slot.status in ("written", "synced"):
            self._sync(CHAINS[chain][depth], slot)

    # ---- eviction ----------------------------------------------------------------------
    @rule(chain=st.integers(0, 1), depth=st.integers(0, DEPTHS - 1), col=st.sampled_from(COLUMNS))
    def evict(self, chain: int, depth: int, col: str) -> None:
        h = CHAINS[chain][depth]
        slot = self.oracle.slot(h, col)
        if slot.oid is None or slot.status is None:
            return
        allowed = slot.status in ("ready", "written", "synced") and not slot.pins
        if col.endswith(".tail") and slot.status == "partial":
            # a partial tail is retired when a rewrite replaces it (copy-on-write, 260d7f0)
            allowed = not slot.pins
        if col == "swa" and slot.status == "partial":
            allowed = True  # SWA_VALID with a short range is still a valid, evictable state
        try:
            self.state.evict(slot.oid)  # type: ignore[arg-type]
        except IllegalTransition:
            assert not allowed, f"evict of {col} refused though allowed"
            return
        assert allowed, f"evict of {col} in {slot.status} (pins {slot.pins}) went through"
        self._gone(slot)
        partner = {"c4": "idx", "idx": "c4"}.get(col)
        if partner:
            p = self.oracle.slot(h, partner)
            if p.status in ("ready", "written", "synced") and not p.pins:
                self._gone(p)

    def _gone(self, slot: Slot) -> None:
        slot.oid, slot.status, slot.shard, slot.pins = None, None, None, 0

    # ---- disk --------------------------------------------------------------------------
    @rule(
        chain=st.integers(0, 1),
        depth=st.integers(0, DEPTHS - 1),
        col=st.sampled_from(COLUMNS),
        commit=st.booleans(),
    )
    def offload(self, chain: int, depth: int, col: str, commit: bool) -> None:
        h = CHAINS[chain][depth]
        slot = self.oracle.slot(h, col)
        mem_ready = (
            slot.status == "ready"
            or (col == "swa" and slot.status == "partial")  # SWA_VALID with a short range
            or (col == "idx" and slot.status == "synced")  # its copy keeps its version
        )
        if slot.oid is None or slot.disk is not None:
            return
        try:
            d = self.state.begin_offload(slot.oid, SHARDS[0])  # type: ignore[arg-type]
        except IllegalTransition:
            assert not mem_ready
            return
        assert mem_ready
        slot.disk_oid, slot.disk, slot.disk_version = d.object_id, "offloading", slot.version
        slot.disk_partial = slot.status == "partial"
        if commit:
            self.state.transition(d.object_id, Event.OFFLOAD_COMMITTED)
            slot.disk = "rest"
        else:
            self.state.transition(d.object_id, Event.OFFLOAD_FAILED)
            slot.disk_oid, slot.disk = None, None

    @rule(
        chain=st.integers(0, 1),
        depth=st.integers(0, DEPTHS - 1),
        col=st.sampled_from(COLUMNS),
        outcome=st.sampled_from(["verified", "failed", "corrupt", "inflight"]),
    )
    def load(self, chain: int, depth: int, col: str, outcome: str) -> None:
        slot = self.oracle.slot(CHAINS[chain][depth], col)
        if slot.disk != "rest":
            return
        target = self.state.begin_load(slot.disk_oid)  # type: ignore[arg-type]
        slot.disk, slot.disk_copy_shard = "inflight", target.shard
        slot.disk_copy = (target.block, target.generation)
        if outcome == "verified":
            self.state.transition(target.object_id, Event.LOAD_VERIFIED)
            slot.disk = "ready"
        elif outcome == "failed":
            self.state.transition(target.object_id, Event.LOAD_FAILED)
            slot.disk = "rest"
        elif outcome == "corrupt":
            self.state.transition(target.object_id, Event.MARK_CORRUPT)
            self._disk_gone(slot)

    @rule(chain=st.integers(0, 1), depth=st.integers(0, DEPTHS - 1), col=st.sampled_from(COLUMNS))
    def finish_inflight(self, chain: int, depth: int, col: str) -> None:
        slot = self.oracle.slot(CHAINS[chain][depth], col)
        if slot.disk == "inflight":
            self.state.transition(slot.disk_oid, Event.LOAD_VERIFIED)  # type: ignore[arg-type]
            slot.disk = "ready"

    def _swappable(self) -> list[tuple[int, int, str]]:
        return [(c, d, col) for c in (0, 1) for d in range(DEPTHS) for col in COLUMNS
                if (s := self.oracle.slots.get((CHAINS[c][d], col))) is not None
                and s.status in ("ready", "synced") and s.disk is None and not s.pins]

    @precondition(lambda self: bool(self._swappable()))
    @rule(i=st.integers(0, 10_000))
    def swap_out_and_back(self, i: int) -> None:
        """Offload a ready object, evict it from memory, load the disk copy back: the path
        that makes lookups hand out loaded copies (rare from the separate rules alone)."""
        chain, depth, col = (options := self._swappable())[i % len(options)]
        self.offload(chain, depth, col, True)
        self.evict(chain, depth, col)
        self.load(chain, depth, col, "verified")

    def _on_disk(self) -> list[Slot]:
        return [s for s in self.oracle.slots.values() if s.disk in ("rest", "ready")]

    @precondition(lambda self: bool(self._on_disk()))
    @rule(i=st.integers(0, 10_000), held=st.booleans())
    def evict_disk(self, i: int, held: bool) -> None:
        """Policy on a disk object: a loaded copy is dropped (back at rest), one at rest is
        evicted; either is refused while a lease or a capture holds the disk object. Half
        the draws aim at a held one when there is any (rare otherwise)."""
        on_disk = self._on_disk()
        on_disk = [s for s in on_disk if s.disk_pins] if held else on_disk
        if not on_disk:
            return
        slot = on_disk[i % len(on_disk)]
        try:
            self.state.evict(slot.disk_oid)  # type: ignore[arg-type]
        except IllegalTransition:
            assert slot.disk_pins, f"disk {slot.disk}: evict refused without a hold"
            return
        assert not slot.disk_pins, f"disk {slot.disk} evicted under {slot.disk_pins} holds"
        if slot.disk == "ready":
            slot.disk = "rest"
        else:
            self._disk_gone(slot)

    def _disk_gone(self, slot: Slot) -> None:
        slot.disk_oid, slot.disk, slot.disk_pins = None, None, 0

    # ---- faults ------------------------------------------------------------------------
    @rule(budget=st.integers(1, 64))
    def reap_some(self, budget: int) -> None:
        """Bury some of what lost owners left (an owner loss is O(1): until a slice or a
        touch reaches them, its objects linger, dead; nothing may serve or reuse them)."""
        self.state.reap(budget)

    @rule(i=st.integers(0, 1))
    def restart_owner(self, i: int) -> None:
        shard = SHARDS[i]
        self.state.register_owner(shard, pools_for(self.state.layout, 64))
        for slot in self.oracle.slots.values():
            if slot.shard == shard:
                self._gone(slot)
            if slot.disk is not None and shard == SHARDS[0]:  # s0 also owns the disk copies
                self._disk_gone(slot)
            elif slot.disk in ("ready", "inflight") and slot.disk_copy_shard == shard:
                slot.disk = "rest"  # the copy is gone whatever holds it; the holds stay

    @rule(
        chain=st.integers(0, 1),
        depth=st.integers(0, DEPTHS - 1),
        col=st.sampled_from(COLUMNS),
        event=st.sampled_from([Event.LOSE, Event.MARK_CORRUPT]),
        disk=st.booleans(),
    )
    def report_fact(self, chain: int, depth: int, col: str, event: Event, disk: bool) -> None:
        """An owner reports an object lost or corrupt: applied whatever holds it (a fact)."""
        slot = self.oracle.slot(CHAINS[chain][depth], col)
        oid = slot.disk_oid if disk else slot.oid
        if oid is None or (disk and slot.disk == "offloading"):
            return
        try:
            self.state.transition(oid, event)  # type: ignore[arg-type]
        except IllegalTransition:
            # only a half-written object cannot be corrupt: nothing readable was there
            assert event is Event.MARK_CORRUPT and not disk and slot.status in ("alloc",
                                                                                "partial")
            return
        if disk:
            self._disk_gone(slot)
        else:
            self._gone(slot)

    # ---- readers -----------------------------------------------------------------------
    @rule(chain=st.integers(0, 1), resume=st.integers(0, DEPTHS * H), lease=st.booleans())
    def lookup(self, chain: int, resume: int, lease: bool) -> None:
        hs = CHAINS[chain]
        m = self.state.lookup(
            LookupRequest(hs, resume_tokens=resume, lease_ttl_s=10 if lease else 0)
        )
        safe = self.oracle.safe_prefix(hs, resume)
        assert m.usable_tokens <= safe, f"unsafe hit: {m.usable_tokens} > safe {safe}"
        assert m.usable_tokens >= safe, f"needless miss: {m.usable_tokens} < safe {safe}"
        holds = self._holds([h for hs_ in m.handles.values() for h in hs_])
        assert len(holds) == sum(len(v) for v in m.handles.values())
        if m.lease_id is not None:  # the lease holds every object whose handle it returned
            for s, oid, disk, _ in holds:
                s.pin(oid, disk, +1)
            self.leases.append((m.lease_id, holds))
        for name, column in m.handles.items():  # packed rows/snapshots never go stale
            for h in column:
                rec = self.state.objects.get(h.object_id)
                assert rec is not None and h.group == name
                assert (h.column, h.block, h.generation) == (rec.column, rec.block, rec.generation)
                assert h.shard in (rec.shard, rec.disk_owner)
        self.handles = [h for hs_ in m.handles.values() for h in hs_]
        self._same_as_walk(LookupRequest(hs, resume_tokens=resume), m)

    @rule(chain=st.integers(0, 1), depth=st.sampled_from((2, 4, DEPTHS)),
          handles=st.booleans())
    def lookup_again(self, chain: int, depth: int, handles: bool) -> None:
        """Few distinct keys, each looked up twice: the second of a complete walk makes a
        memo, and later calls are answered from it until a change on the path drops it."""
        req = LookupRequest(CHAINS[chain][:depth], handles=handles)
        for _ in range(2):
            m = self.state.lookup(req)
            assert m.usable_tokens == self.oracle.safe_prefix(CHAINS[chain][:depth], depth * H)
            self._same_as_walk(req, m)

    def _same_as_walk(self, req: LookupRequest, m: Match) -> None:
        """The answer (memo or walk) equals a fresh block-by-block walk of the same state,
        byte for byte."""
        memo, self.state.memo.capacity = self.state.memo.capacity, 0
        config = self.state.config
        self.state.config = replace(config, segment_blocks=0)
        try:
            fresh = self.state.lookup(req)
        finally:
            self.state.memo.capacity = memo
            self.state.config = config
        assert (m.usable_tokens, m.matched_tokens, m.downgrades) == (
            fresh.usable_tokens, fresh.matched_tokens, fresh.downgrades)
        assert {k: (c.records, c.strides, c.shard_names) for k, c in m.columns.items()} == {
            k: (c.records, c.strides, c.shard_names) for k, c in fresh.columns.items()}

    def _holds(self, handles: list) -> list[Hold]:  # type: ignore[type-arg]
        """The oracle's slot for each handle's object (memory or disk), where it still lives."""
        out: list[Hold] = []
        for h in handles:
            for s in self.oracle.slots.values():
                if s.live(h.object_id, False) or s.live(h.object_id, True):
                    out.append((s, h.object_id, s.disk_oid == h.object_id,
                                (h.block, h.generation)))
                    break
        return out

    @precondition(lambda self: bool(self.handles))
    @rule(n=st.integers(1, 6))
    def capture(self, n: int) -> None:
        """A worker captures a CUDA graph over some matched blocks (memory objects and loaded
        disk copies): they are pinned."""
        holds = self._holds(self.handles)
        readable = {(oid, where) for s, oid, disk, where in holds
                    if s.readable(oid, disk, where)}
        live = [h for h in self.handles
                if h.block >= 0 and (h.object_id, (h.block, h.generation)) in readable][:n]
        gone = [h for h in self.handles
                if h.block >= 0 and (h.object_id, (h.block, h.generation)) not in readable]
        if gone:  # a block freed (or a copy dropped) since the lookup: capturing is refused
            with pytest.raises(StaleHandle):
                self.state.register_capture(gone[:1])
        if not live:
            return
        cap_id, _ = self.state.register_capture(live)
        held = self._holds(live)
        for s, oid, disk, _ in held:
            s.pin(oid, disk, +1)
        self.captures.append((cap_id, held))

    @precondition(lambda self: bool(self.captures))
    @rule()
    def release_capture(self) -> None:
        cap_id, held = self.captures.pop(0)
        self.state.release_capture(cap_id)
        for s, oid, disk, _ in held:
            s.pin(oid, disk, -1)

    @invariant()
    def captures_invalid_only_when_their_bytes_went(self) -> None:
        for cap_id, held in self.captures:
            valid, _ = self.state.capture_status(cap_id)
            # valid while every captured block still holds its object's bytes
            assert valid == all(s.readable(oid, disk, where) for s, oid, disk, where in held)

    @precondition(lambda self: bool(self.leases))
    @rule()
    def release(self) -> None:
        lease_id, holds = self.leases.pop(0)
        self.state.release_lease(lease_id)
        for s, oid, disk, _ in holds:
            s.pin(oid, disk, -1)

    @precondition(lambda self: bool(self.handles))
    @rule(i=st.integers(0, 10_000))
    def read(self, i: int) -> None:
        h = self.handles[i % len(self.handles)]
        try:
            self.state.check_read(h)
        except StaleHandle:
            return
        # a read let through must be of bytes the oracle says are still there, at that block
        held = self._holds([h])
        assert h.block < 0 or (
            bool(held) and held[0][0].readable(h.object_id, held[0][2], (h.block, h.generation))
        ), f"read of {h} let through, but its bytes are gone"

    @invariant()
    def admission_balanced(self) -> None:
        inflight = sum(s.disk in ("offloading", "inflight") for s in self.oracle.slots.values())
        assert self.state.admission.stats().in_transit_objects == inflight


FunnelMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFunnelAgainstOracle = FunnelMachine.TestCase
