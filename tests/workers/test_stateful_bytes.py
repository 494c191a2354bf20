"""Every byte a Match's handles read, checked, through the real data plane, shards, pools and
LMDB tiers (issue 35, item 1): random writes, rewrites (copy-on-write through
``AllocRequest.replace``, and in-place attempts that must be refused), leased lookups and
reads, offloads, evictions, corruption, shard kills and service restarts, also between any
two steps of a write, on the reference spec and on a spec without any tail (full attention +
sliding windows, as every vLLM connector geometry).

What a read may return is stated from the outside, not from the code under test:

* an object's bytes never change: a handle whose object id this test saw written (or
  offloaded from such an object) reads exactly those bytes;
* any other handle (an object re-created by a re-confirm after a restart gets a new id)
  reads exactly the bytes of some write of its slot;
* an indexer is served beside the KV bytes of the same write (KV and keys of one write).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule

from hkv_service.core.api import AllocRequest, LookupRequest, Params
from hkv_service.core.errors import HkvError
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.spec import CacheSpec, spec_from_dict
from hkv_service.core.states import Event, Kind
from hkv_service.specs import default_spec, demo_spec
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessConfig, InProcessSystem
from workers.link import Pending
from workers.ports import Commit
from workers.tags import BlockTag

_ABI = {"dtype": "float16", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "k"}
NO_TAILS = spec_from_dict({"model_id": "full-swa", "hash_block_size": 8, "groups": [
    {"name": "full", "kind": "COMPRESSED", "block_size": 16, "ratio": 1, "abi": _ABI},
    {"name": "wide", "kind": "SWA", "block_size": 16, "window": 32, "abi": _ABI},
    {"name": "narrow", "kind": "SWA", "block_size": 8, "window": 8, "abi": _ABI}]})
# spec, blocks a prompt. "reference+state": the reference layout (every column of
# default_spec()) plus a recurrent group, a state object at each resume point: a state read at p
# must be one write's of p's own slot, never another boundary's (a superset of the reference
# spec, so it replaces it here: the test's time stays as it was)
SPECS = {"reference+state": (demo_spec(), 4), "no-tails": (NO_TAILS, 8)}
assert {c.name for c in Layout(default_spec()).columns} < {
    c.name for c in Layout(demo_spec()).columns}
GENERATIONS = 3  # writes of different bytes per slot
Slot = tuple[int, str]
# Which of the live objects a rule takes: drawn whatever the system holds, so every step draws
# the same (the real system's timing decides what is live; hypothesis must replay the draws)
PICK = st.integers(0, 1 << 16)


def _bytes(layout: Layout, chain: int, slot: Slot, gen: int) -> tuple[np.ndarray, int]:
    """Write ``gen``'s bytes of ``slot`` on ``chain`` (and a tail's raw tokens)."""
    d, name = slot
    c = layout.by_name[name]
    col = layout.columns[c]
    n = col.tail_tokens_at((d + 1) * layout.hash_block) if col.kind is Kind.TAIL else 0
    seed = int.from_bytes(hashlib.blake2b(repr((chain, slot, gen)).encode(), digest_size=8)
                          .digest(), "little")
    size = layout.object_bytes(c, d, tail_len=n) if n else layout.object_bytes(c, d)
    return np.random.default_rng(seed).integers(0, 256, size, np.uint8), n


class BytesMachine(RuleBasedStateMachine):
    spec: CacheSpec = default_spec()
    blocks = 4

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="hkv-bytes-"))
        self.system = InProcessSystem(self.spec, self.dir, InProcessConfig(
            shards=2, blocks_per_group=10, heartbeat_interval_s=0.05))
        self.plane = self.system.dataplane()
        self.layout = self.plane.layout
        self.chains = [self._prompt(i) for i in range(2)]
        # object id -> the bytes it was written with (never changes), its chain and slot
        self.known: dict[int, bytes] = {}
        self.leases: list[tuple[int, Any]] = []
        self.reads = 0

    def teardown(self) -> None:
        self.system.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _prompt(self, seed: int) -> list[BlockHash]:
        hb = self.layout.hash_block
        tokens = np.random.default_rng(seed).integers(0, 50_000, self.blocks * hb)
        return hash_blocks(tokens, hb, ExtraKeys(self.spec.model_id))

    def _slots(self) -> list[Slot]:
        lay = self.layout
        return [(d, lay.columns[c].name) for d in range(self.blocks)
                for c in lay.attached[d % lay.period]]

    def _payload(self, chain: int, gen: int, slots: list[Slot]
                 ) -> tuple[dict[Slot, np.ndarray], dict[Slot, tuple[np.ndarray, int]]]:
        blocks, tails = {}, {}
        for s in slots:
            arr, n = _bytes(self.layout, chain, s, gen)
            if n:
                tails[s] = (arr, n)
            else:
                blocks[s] = arr
        return blocks, tails

    def _write(self, plane: DataPlane, chain: int, gen: int, slots: list[Slot]) -> None:
        blocks, tails = self._payload(chain, gen, slots)
        with contextlib.suppress(HkvError):
            rep = plane.write_prefix(self.chains[chain], blocks, tails)
            for s in rep.wrote:  # (not the objects that were there already)
                h = rep.handles[s]
                if int(h.object_id) not in self.known:
                    arr = blocks[s] if s in blocks else tails[s][0]
                    self.known[int(h.object_id)] = arr.tobytes()

    # -- writes -----------------------------------------------------------------------------

    @initialize()
    def write_both_chains(self) -> None:
        for chain in range(len(self.chains)):
            self._write(self.plane, chain, 0, self._slots())

    @rule(chain=st.integers(0, 1), gen=st.integers(0, GENERATIONS - 1), data=st.data())
    def write(self, chain: int, gen: int, data: st.DataObject) -> None:
        """Every column at some depths (a KV and its indexer together), or some slots."""
        if data.draw(st.booleans()):
            depths = data.draw(st.sets(st.integers(0, self.blocks - 1), min_size=1))
            slots = [s for s in self._slots() if s[0] in depths]
        else:
            slots = data.draw(st.lists(st.sampled_from(self._slots()), min_size=1, unique=True))
        self._write(self.plane, chain, gen, sorted(slots))

    @rule(chain=st.integers(0, 1), gen=st.integers(0, GENERATIONS - 1),
          step=st.sampled_from(["allocate", "transition_many", "settle_blocks"]))
    def write_with_a_restart_in_it(self, chain: int, gen: int, step: str) -> None:
        """The service restarts (every shard rejoins) right before one step of a write."""
        plane = self.system.dataplane()
        fired: list[bool] = []

        def restart() -> None:
            if not fired:
                fired.append(True)
                self.system.restart_service()
                self.leases.clear()  # a new view knows none of them

        if step == "settle_blocks":
            for link in self.system.links.values():
                _before_submit(link, "settle_blocks", restart)
        else:
            plane.meta = _Before(plane.meta, step, restart)  # type: ignore[assignment]
        try:
            self._write(plane, chain, gen, self._slots())
        finally:
            for link in self.system.links.values():
                link.__dict__.pop("submit", None)

    @rule(chain=st.integers(0, 1), gen=st.integers(0, GENERATIONS - 1), pick=PICK)
    def replace_one(self, chain: int, gen: int, pick: int) -> None:
        """Copy-on-write of one object of any kind: retired (unless a reader holds it), a
        fresh object written and committed in its place."""
        m = self.system.meta.lookup(LookupRequest(self.chains[chain]))
        live = sorted(self._slotted(m).items(), key=lambda kv: kv[0])
        if not live:
            return
        slot, h = live[pick % len(live)]
        if h.block < 0:
            return
        try:
            (a,) = self.system.meta.allocate(self.chains[chain], [AllocRequest(
                slot[0], slot[1], replace=int(h.object_id))])
        except HkvError:
            return
        if a.existing:
            return  # held by a reader: left alone
        arr, n = _bytes(self.layout, chain, slot, gen)
        commit = _commit_for(self.layout, slot, arr, n, live, a)
        if commit is None:
            with contextlib.suppress(HkvError):
                self.system.meta.evict(a.handle.object_id)
            return
        d = slot[0]
        tag = BlockTag(self.chains[chain][d], self.chains[chain][d - 1] if d else None, d)
        res = self.system.links[a.handle.shard].submit(
            "write_blocks", [a.handle], [arr], [tag], [commit]).result(30)
        if res[0].ok:
            self.known[int(a.handle.object_id)] = arr.tobytes()

    @rule(chain=st.integers(0, 1), pick=PICK)
    def rewrite_in_place(self, chain: int, pick: int) -> None:
        """A writer naming an object that has bytes, with other bytes: refused, unchanged."""
        m = self.system.meta.lookup(LookupRequest(self.chains[chain]))
        live = sorted((h for h in self._slotted(m).values() if h.block >= 0),
                      key=lambda x: int(x.object_id))
        if not live:
            return
        h = live[pick % len(live)]
        link = self.system.links.get(h.shard)
        if link is None or not link.alive:
            return
        got = link.submit("read_blocks", [h]).result(30)
        arr = _one(got)
        if arr is None:
            return
        flipped = (np.frombuffer(arr, np.uint8) ^ 0x5A).astype(np.uint8)
        tag = BlockTag(self.chains[chain][0], None, 0)
        res = link.submit("write_blocks", [h], [flipped], [tag], report=False).result(30)
        assert not res[0].ok, "an object's bytes were rewritten in place"

    # -- reads ------------------------------------------------------------------------------

    @rule(chain=st.integers(0, 1), lease=st.booleans())
    def lookup(self, chain: int, lease: bool) -> None:
        with contextlib.suppress(HkvError):
            m = self.system.meta.lookup(LookupRequest(self.chains[chain],
                                                      lease_ttl_s=30.0 if lease else 0.0))
            self.leases.append((chain, m))

    @rule(pick=PICK)
    def read(self, pick: int) -> None:
        if not self.leases:
            return
        chain, m = self.leases.pop(pick % len(self.leases))
        out = self.plane.read(m, self.chains[chain])
        if isinstance(out, Recompute):
            return
        self.reads += 1
        self._check(chain, m, out)

    @rule()
    def release(self) -> None:
        if not self.leases:
            return
        _, m = self.leases.pop(0)
        if m.lease_id is not None:
            with contextlib.suppress(HkvError):
                self.system.meta.release_lease(m.lease_id)

    # -- the state moves under the readers --------------------------------------------------

    @rule(chain=st.integers(0, 1), evict_memory=st.booleans())
    def offload(self, chain: int, evict_memory: bool) -> None:
        m = self.system.meta.lookup(LookupRequest(self.chains[chain]))
        self.offload_handles([h for h in self._slotted(m).values() if h.block >= 0],
                             evict_memory)

    def offload_handles(self, handles: list[Any], evict_memory: bool) -> None:
        with contextlib.suppress(HkvError):
            for h, res in zip(handles, self.plane.offload(handles, evict_memory=evict_memory),
                              strict=True):
                if res.ok and res.handle is not None and int(h.object_id) in self.known:
                    self.known.setdefault(int(res.handle.object_id),
                                          self.known[int(h.object_id)])

    @rule(chain=st.integers(0, 1))
    def kv_moves_on(self, chain: int) -> None:
        """The KV blocks of a chain go to disk and their memory copies are found corrupt: the
        disk copies serve beside the indexers synced to them, and the next writer brings
        fresh KV with other bytes (its indexers are replaced then, never rewritten)."""
        m = self.system.meta.lookup(LookupRequest(self.chains[chain]))
        kvs = [h for (_, name), h in self._slotted(m).items() if h.block >= 0
               and self.layout.columns[self.layout.by_name[name]].kind is Kind.COMPRESSED]
        self.offload_handles(kvs, evict_memory=False)
        for h in kvs:
            with contextlib.suppress(HkvError):
                self.system.meta.transition(h.object_id, Event.MARK_CORRUPT)

    @rule(chain=st.integers(0, 1), event=st.sampled_from([Event.EVICT, Event.MARK_CORRUPT]),
          pick=PICK)
    def evict_or_corrupt(self, chain: int, event: Event, pick: int) -> None:
        m = self.system.meta.lookup(LookupRequest(self.chains[chain]))
        live = sorted(self._slotted(m).values(), key=lambda x: int(x.object_id))
        if live:
            h = live[pick % len(live)]
            with contextlib.suppress(HkvError):
                self.system.meta.transition(h.object_id, event)

    @rule()
    def restart_service(self) -> None:
        self.system.restart_service()
        self.leases.clear()

    @rule(shard=st.sampled_from(["shard-0", "shard-1"]))
    def kill_shard(self, shard: str) -> None:
        self.system.kill_shard(shard)

    # -- the check --------------------------------------------------------------------------

    def _slotted(self, m: Any) -> dict[Slot, Any]:
        out = {}
        for name, hs in m.handles.items():
            depths = self.layout.needed_depths(self.layout.by_name[name], m.usable_tokens)
            out.update({(d, name): h for d, h in zip(depths, hs, strict=True)})
        return out

    def _check(self, chain: int, m: Any, out: Mapping[str, list[np.ndarray]]) -> None:
        """Every byte read is an object's own (never changed), or one write's of its slot;
        an indexer beside the KV bytes of its own write."""
        gen_of: dict[Slot, int] = {}
        for (d, name), h in self._slotted(m).items():
            i = self.layout.needed_depths(self.layout.by_name[name], m.usable_tokens).index(d)
            got = out[name][i].tobytes()
            want = self.known.get(int(h.object_id))
            if want is not None and h.block >= 0:
                assert got == want, f"object {h.object_id} ({name}@{d}) changed its bytes"
            gens = [g for g in range(GENERATIONS)
                    if _bytes(self.layout, chain, (d, name), g)[0].tobytes() == got]
            assert gens, f"{name}@{d}: bytes of no write of this slot"
            gen_of[(d, name)] = gens[0]
        for (d, name), g in gen_of.items():
            kv = self.layout.columns[self.layout.by_name[name]].indexes
            if kv is not None:
                kv_name = self.layout.columns[kv].name
                assert gen_of[(d, kv_name)] == g, f"{name}@{d} served beside another KV"


def _commit_for(layout: Layout, slot: Slot, arr: np.ndarray, n: int, live: Mapping[Slot, Any],
                a: Any) -> Commit | None:
    kind = layout.columns[layout.by_name[slot[1]]].kind
    if kind is Kind.TAIL:
        return Commit((Event.TAIL_DONE,), (Params(tail_len=n),))
    if kind is Kind.INDEXER:
        return None  # an indexer's fresh keys need its KV's: the data plane's _replace does it
    if kind is Kind.COMPRESSED:
        from hkv_service.core.hashing import content_version

        return Commit((Event.WRITE_DONE,), (Params(version=content_version(arr.data)),))
    return Commit((Event.WRITE_DONE,))


def _one(packed: Any) -> bytes | None:
    """The bytes of a one-handle read_blocks answer, or None if it was refused."""
    from workers.ports import ItemResult

    first = packed[0]
    return None if isinstance(first, ItemResult) else bytes(np.asarray(first).tobytes())


class _Before:
    def __init__(self, inner: Any, method: str, action: Callable[[], None]) -> None:
        self.inner, self.method, self.action = inner, method, action

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != self.method:
            return attr

        def first(*args: Any, **kwargs: Any) -> Any:
            self.action()
            return attr(*args, **kwargs)
        return first


def _before_submit(link: Any, method: str, action: Callable[[], None]) -> None:
    submit = type(link).submit.__get__(link)

    def hooked(name: str, *args: Any, **kwargs: Any) -> Pending:
        if name == method:
            action()
        return submit(name, *args, **kwargs)
    link.submit = hooked


@pytest.mark.parametrize("which", sorted(SPECS))
def test_every_byte_read_is_one_writes(which: str) -> None:
    spec, blocks = SPECS[which]
    machine = type(f"BytesMachine_{which}", (BytesMachine,), {"spec": spec, "blocks": blocks})
    test = machine.TestCase
    test.settings = settings(max_examples=60, stateful_step_count=20, deadline=None,
                             derandomize=True, database=None,
                             suppress_health_check=list(HealthCheck))
    test().runTest()
