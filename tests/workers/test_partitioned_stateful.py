"""The stateful property test of tests/core/test_stateful.py run through a
``PartitionedMetadata`` over 2 and 3 ``LocalMetadata`` partitions, against the same oracle.

The machine and the oracle are that module's (loaded here as a private copy, so this file can
give it its own prompts without touching the original's): every call the machine makes on
``self.state`` goes through :class:`PartitionedState`, which sends the port's methods through
the ``PartitionedMetadata`` and the ``CacheState``-only ones (reap, captures, memo, config,
objects, admission) to the partition that holds what they name. The two prompts have roots
on different partitions, so both the safety bound and the no-needless-miss bound are checked
on more than one partition at once.

Rules only partitions have:

* ``kill_partition``: a partition restarts empty (``LocalMetadata.swap``); the oracle forgets
  every object of the chains rooted there (nothing unconfirmed may be a hit), the others keep
  serving exactly what they held. Leases and captures of the restarted partition are unknown
  to it; the owners learn of the restart from a heartbeat (``PartitionsLost`` names exactly
  the restarted partitions) and re-register with those only, before writing there again.
* ``lookup_each_partition``: a lookup of a chain rooted on each partition agrees with the
  oracle, and the same lookup (or an allocation) sent straight to another partition raises
  ``WrongPartition``.
* an invariant: every partition hands out blocks only from its own range of each pool.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from hkv_service.core.api import AllocRequest, Handle, LookupRequest, StateConfig
from hkv_service.core.errors import PoolExhausted, UnknownCapture, UnknownLease, WrongPartition
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.partitions import (
    Partition,
    block_range,
    partition_of_id,
    partition_of_lease,
    partition_of_root,
)
from hkv_service.core.state_view import CacheState
from hkv_service.testing import pools_for
from workers.local import LocalMetadata
from workers.partitioned import PartitionedMetadata, PartitionsLost

_ORIGINAL = Path(__file__).resolve().parents[1] / "core" / "test_stateful.py"
_copies = itertools.count()


def _oracle_module(chains: Sequence[list[BlockHash]] | None = None) -> Any:
    """A private copy of tests/core/test_stateful.py (its FunnelMachine reads the module's
    ``CHAINS``, so each copy can be given its own prompts; pytest's own import of the
    original is untouched, and nothing here is collected from the copy)."""
    name = f"_hkv_stateful_oracle_{next(_copies)}"
    spec = importlib.util.spec_from_file_location(name, _ORIGINAL)
    assert spec is not None and spec.loader is not None
    mod: Any = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    if chains is not None:
        mod.CHAINS = list(chains)
    return mod


_base = _oracle_module()
SPEC, H, DEPTHS, SHARDS = _base.SPEC, _base.H, _base.DEPTHS, _base.SHARDS
POOL_BLOCKS = 64  # what the machine registers every owner with (pools_for(layout, 64))
COUNTS = (2, 3)


def _chain(seed: int, blocks: int) -> list[BlockHash]:
    tokens = np.random.default_rng(seed).integers(5000, 9000, blocks * H)
    return hash_blocks(tokens, H, ExtraKeys(SPEC.model_id))


A, B = _base.CHAINS  # the original's prompts: B shares A's first 4 blocks (and so its root)
# A prompt of the same length rooted elsewhere than A for every partition count tested
C = next(c for c in (_chain(seed, DEPTHS) for seed in itertools.count())
         if all(partition_of_root(c[0], n) != partition_of_root(A[0], n) for n in COUNTS))
# Short probes, one rooted on each partition, never written (a partition holding none of the
# machine's prompts is still looked up, and refuses what is not its own)
PROBES = {n: [next(c for c in (_chain(1000 * n + seed, 2) for seed in itertools.count())
                   if partition_of_root(c[0], n) == i) for i in range(n)] for n in COUNTS}


class _Memos:
    """``state.memo.capacity`` of every partition at once (the machine turns the memo off
    for its block-by-block comparison walk)."""

    def __init__(self, parts: list[LocalMetadata]) -> None:
        self._parts = parts

    @property
    def capacity(self) -> int:
        caps = {p.state.memo.capacity for p in self._parts}
        assert len(caps) == 1
        return caps.pop()

    @capacity.setter
    def capacity(self, value: int) -> None:
        for p in self._parts:
            p.state.memo.capacity = value


class _Objects:
    def __init__(self, parts: list[LocalMetadata]) -> None:
        self._parts = parts

    def get(self, object_id: int) -> Any:
        return self._parts[partition_of_id(object_id, len(self._parts))].state.objects.get(
            object_id)


class _Admission:
    def __init__(self, parts: list[LocalMetadata]) -> None:
        self._parts = parts

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(in_transit_objects=sum(
            p.state.admission.stats().in_transit_objects for p in self._parts))


class PartitionedState:
    """What the machine calls on ``self.state``: the port's methods through a
    ``PartitionedMetadata``; the rest to the partition that holds what they name. It also
    plays the owners' side: their incarnations, and the partitions that forgot them."""

    def __init__(self, count: int, config: StateConfig, range_blocks: int = 0,
                 spec: Any = SPEC) -> None:
        self.count, self.spec = count, spec
        self._config = replace(config, range_blocks=range_blocks)
        self.parts = [LocalMetadata(self.fresh(i)) for i in range(count)]
        self.meta = PartitionedMetadata(self.parts)
        self.layout = self.parts[0].state.layout
        self.memo = _Memos(self.parts)
        self.objects = _Objects(self.parts)
        self.admission = _Admission(self.parts)
        self.incarnations: dict[ShardId, int] = {}
        self.pools: dict[ShardId, Any] = {}
        self.lost: dict[ShardId, set[int]] = {}  # partitions restarted since it registered
        # our id -> (partition, its id) per partition the captured handles are on
        self._captures: dict[int, list[tuple[int, int]]] = {}
        self._capture_ids = itertools.count(1)

    def fresh(self, index: int) -> CacheState:
        return CacheState(self.spec, replace(self._config,
                                             partition=Partition(index, self.count)))

    def close(self) -> None:
        self.meta.close()

    # -- owners -----------------------------------------------------------------------------
    def register_owner(self, owner: ShardId, pools: Any) -> int:
        self.incarnations[owner] = self.meta.register_owner(owner, pools)
        self.pools[owner], self.lost[owner] = pools, set()
        return self.incarnations[owner]

    def heal(self) -> None:
        """Every owner heartbeats; a partition that forgot it is named in PartitionsLost
        (exactly those restarted since), and it re-registers with those only."""
        for owner, inc in self.incarnations.items():
            try:
                self.meta.heartbeat(owner, inc)
            except PartitionsLost as lost:
                assert lost.partitions == self.lost[owner], (lost.partitions, self.lost[owner])
                self.incarnations[owner] = self.meta.register_owner(
                    owner, self.pools[owner], partitions=lost.partitions)
                self.meta.heartbeat(owner, self.incarnations[owner])
            else:
                assert not self.lost[owner], f"{owner} not lost on {self.lost[owner]}"
            self.lost[owner] = set()

    def kill(self, index: int) -> None:
        """Partition ``index`` restarts empty."""
        self.parts[index].swap(self.fresh(index))
        for lost in self.lost.values():
            lost.add(index)

    # -- the port ---------------------------------------------------------------------------
    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[AllocRequest],
                 owner: ShardId | None = None) -> Any:
        k = partition_of_root(block_hashes[0], self.count)
        if any(k in lost for lost in self.lost.values()):
            if all(k in lost for lost in self.lost.values()):
                # a restarted partition knows no owner yet: it has no block to hand out
                with pytest.raises(PoolExhausted):
                    self.meta.allocate(block_hashes, requests, owner)
            self.heal()  # the writer's shards re-register there, then it writes
        return self.meta.allocate(block_hashes, requests, owner)

    def transition(self, *args: Any) -> Any:
        return self.meta.transition(*args)

    def evict(self, object_id: ObjectId) -> None:
        self.meta.evict(object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> Handle:
        return self.meta.begin_offload(object_id, disk_owner)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> Handle:
        return self.meta.begin_load(object_id, owner)

    def lookup(self, req: LookupRequest) -> Any:
        m = self.meta.lookup(req)
        if self._config.range_blocks and req.handles:
            self._check_columns(m)
        return m

    def _check_columns(self, m: Any) -> None:
        """A split chain's joined columns hold, in token order, one handle per depth a reader
        resuming at ``usable_tokens`` needs (layout.needed_depths), as one process's do."""
        for column in self.layout.columns:
            got = m.columns.get(column.name)
            depths = [self.objects.get(oid).entry.depth for oid in got.object_ids] if got else []
            assert depths == list(self.layout.needed_depths(column.index, m.usable_tokens)), (
                column.name, m.usable_tokens, depths)

    def release_lease(self, lease_id: LeaseId) -> None:
        self.meta.release_lease(lease_id)

    def check_read(self, handle: Handle, lease_id: LeaseId | None = None) -> None:
        self.meta.check_read(handle, lease_id)

    # -- CacheState only ----------------------------------------------------------------------
    @property
    def config(self) -> StateConfig:
        return self.parts[0].state.config

    @config.setter
    def config(self, value: StateConfig) -> None:
        for p in self.parts:
            p.state.config = replace(value, partition=p.state.config.partition)

    def reap(self, budget: int) -> bool:
        return any([p.state.reap(budget) for p in self.parts])

    def capture_partition(self, capture_id: int) -> int:
        (k,) = {k for k, _ in self._captures[capture_id]}
        return k

    def register_capture(self, handles: Sequence[Handle]) -> tuple[int, int]:
        """One capture per partition the handles are on (a chain split at depth ranges
        hands out handles of several; one rooted whole, of one)."""
        where: dict[int, list[Handle]] = {}
        for h in handles:
            where.setdefault(partition_of_id(h.object_id, self.count), []).append(h)
        assert self._config.range_blocks or len(where) == 1, \
            "a capture over one whole chain's handles is on one partition"
        held: list[tuple[int, Any]] = []
        epoch = 0
        try:
            for k, hs in sorted(where.items()):
                their_id, e = self.parts[k].state.register_capture(hs)
                held.append((k, their_id))
                epoch = max(epoch, e)
        except BaseException:
            for k, theirs in held:
                self.parts[k].state.release_capture(theirs)
            raise
        ours = next(self._capture_ids)
        self._captures[ours] = held
        return ours, epoch

    def release_capture(self, capture_id: int) -> None:
        for k, theirs in self._captures.pop(capture_id):
            self.parts[k].state.release_capture(theirs)  # type: ignore[arg-type]

    def capture_status(self, capture_id: int) -> tuple[bool, int]:
        each = [self.parts[k].state.capture_status(theirs)  # type: ignore[arg-type]
                for k, theirs in self._captures[capture_id]]
        return all(v for v, _ in each), max(e for _, e in each)


def machine(count: int, chains: Sequence[list[BlockHash]], spread: bool) -> Any:
    """FunnelMachine over ``count`` partitions with the prompts ``chains`` (``spread``: they
    must be rooted on at least 2 partitions)."""
    o = _oracle_module(chains)
    probes = PROBES[count]
    funnel_machine: Any = o.FunnelMachine

    class PartitionedFunnelMachine(funnel_machine):  # type: ignore[misc]
        state: PartitionedState
        oracle: Any
        leases: list[tuple[LeaseId, Any]]
        captures: list[tuple[int, Any]]

        def __init__(self) -> None:
            super().__init__()  # the oracle, the lists; its own CacheState is replaced here
            roots = {partition_of_root(c[0], count) for c in o.CHAINS}
            assert len(roots) >= (2 if spread else 1), f"prompts all on partition {roots}"
            self.state = PartitionedState(count, self.state.config)
            for s in SHARDS:
                self.state.register_owner(s, pools_for(self.state.layout, POOL_BLOCKS))

        def teardown(self) -> None:
            self.state.close()

        def _rooted_on(self, k: int) -> list[list[BlockHash]]:
            return [c for c in o.CHAINS if partition_of_root(c[0], count) == k]

        @rule(k=st.integers(0, count - 1), heal=st.booleans())
        def kill_partition(self, k: int, heal: bool) -> None:
            """Partition k restarts empty: what its chains held is gone (nothing unconfirmed
            may be a hit); the other partitions keep serving what they hold."""
            self.state.kill(k)
            hashes = {h for c in self._rooted_on(k) for h in c}
            for key in [key for key in self.oracle.slots if key[0] in hashes]:
                del self.oracle.slots[key]
            keep = []
            for lease_id, holds in self.leases:
                if partition_of_lease(lease_id, count) != k:
                    keep.append((lease_id, holds))
                    continue
                with pytest.raises(UnknownLease):  # the restarted partition has none yet
                    self.state.release_lease(lease_id)
            self.leases = keep
            caps = []
            for cap_id, held in self.captures:
                if self.state.capture_partition(cap_id) != k:
                    caps.append((cap_id, held))
                    continue
                with pytest.raises(UnknownCapture):
                    self.state.capture_status(cap_id)
            self.captures = caps
            self.lookup_each_partition()  # the others serve as before, k serves nothing
            if heal:
                self.heartbeats()

        @rule()
        def heartbeats(self) -> None:
            """The owners heartbeat; those a restarted partition forgot re-register there."""
            self.state.heal()

        @rule()
        def lookup_each_partition(self) -> None:
            """A lookup rooted on each partition agrees with the oracle; sent straight to
            another partition it is refused, and so is an allocation there."""
            for k in range(count):
                for hs in [*self._rooted_on(k), probes[k]]:
                    req = LookupRequest(hs)
                    m = self.state.lookup(req)
                    assert m.usable_tokens == self.oracle.safe_prefix(hs, len(hs) * H)
                    for column in m.handles.values():  # what it just handed out reads
                        for h in column:
                            if h.block >= 0:
                                self.state.check_read(h)
                    other = self.state.parts[(k + 1) % count]
                    with pytest.raises(WrongPartition) as err:
                        other.lookup(req)
                    assert err.value.expected == k
                    with pytest.raises(WrongPartition):
                        other.allocate(hs[:1], [AllocRequest(0, "c4")])

        @invariant()
        def blocks_from_own_range(self) -> None:
            """Each partition hands out only its own range of every shard's pool: no block is
            held by two partitions."""
            held: dict[tuple[str, int, int], int] = {}
            for k, part in enumerate(self.state.parts):
                lo, hi = block_range(POOL_BLOCKS, k, count)
                for name, owner in part.state.owners.items():
                    for pool in owner.pools.values():  # what it was registered with
                        got = (pool.config.first, pool.config.num_blocks)
                        assert got == (lo, hi), f"partition {k} was given {got} of {name}"
                for rec in part.state.objects.values():
                    if rec.block < 0:
                        continue
                    assert lo <= rec.block < hi, f"partition {k} holds block {rec.block}"
                    assert held.setdefault((rec.shard, rec.column, rec.block), k) == k

    PartitionedFunnelMachine.TestCase.settings = settings(
        max_examples=60 if spread else 25,
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    return PartitionedFunnelMachine


def test_prompts_spread_over_partitions() -> None:
    for n in COUNTS:
        assert partition_of_root(A[0], n) != partition_of_root(C[0], n)
        assert [partition_of_root(p[0], n) for p in PROBES[n]] == list(range(n))
    assert partition_of_root(A[0], 2) == partition_of_root(B[0], 2)  # shared prefix, one root


TestTwoPartitions = machine(2, [A, C], spread=True).TestCase
TestThreePartitions = machine(3, [A, C], spread=True).TestCase
# the original's prompts (a shared prefix, so one root) over 3 partitions: two hold nothing
TestSharedPrefixThreePartitions = machine(3, [A, B], spread=False).TestCase


def _shared_pair(seed: int) -> tuple[list[BlockHash], list[BlockHash]]:
    """Two prompts sharing their first 4 blocks (one root), as the original's do."""
    rng = np.random.default_rng(seed)
    a = rng.integers(5000, 9000, DEPTHS * H)
    b = np.concatenate([a[: 4 * H], rng.integers(5000, 9000, (DEPTHS - 4) * H)])
    return (hash_blocks(a, H, ExtraKeys(SPEC.model_id)),
            hash_blocks(b, H, ExtraKeys(SPEC.model_id)))


def _spread(chain: Sequence[BlockHash], n: int) -> bool:
    """Its 2-block ranges are on every one of n partitions."""
    return len({partition_of_root(chain[d], n) for d in range(0, DEPTHS, 2)}) == n


# A shared-prefix pair (one root: whole chains would sit on one partition) whose 2-block
# ranges are on every partition, for each count tested
SA, SB = next(pair for pair in map(_shared_pair, itertools.count(7))
              if all(_spread(c, n) for c in pair for n in COUNTS))


def _with_window(window: int) -> Any:
    """The reference spec with its SWA window widened to ``window`` tokens."""
    groups = tuple(replace(g, window=window) if g.window else g for g in SPEC.groups)
    return replace(SPEC, groups=groups)


def split_machine(count: int, range_blocks: int, window: int | None = None) -> Any:
    """FunnelMachine over ``count`` partitions with chains split every ``range_blocks``
    blocks (prompts sharing a prefix, so one root: without the split, one partition). Every
    answer is the oracle's, exactly: the client's fixed point over the ranges' partitions
    gives what one process holding the whole chain gives. ``window``: the SWA window (the
    spec's and the oracle's), wider than a range so windows reach into the range before."""
    o = _oracle_module([SA, SB])
    if window is not None:
        o.SPEC, o.W = _with_window(window), window
    funnel_machine: Any = o.FunnelMachine

    class SplitFunnelMachine(funnel_machine):  # type: ignore[misc]
        state: PartitionedState

        def __init__(self) -> None:
            super().__init__()
            self.state = PartitionedState(count, self.state.config, range_blocks, o.SPEC)
            assert self.state.meta.range_blocks == range_blocks
            for s in SHARDS:
                self.state.register_owner(s, pools_for(self.state.layout, POOL_BLOCKS))

        def teardown(self) -> None:
            self.state.close()

        @invariant()
        def each_range_in_its_anchors_partition(self) -> None:
            """Every entry lives in the partition of its range's first hash, and a range's
            first entry has no parent there."""
            for k, part in enumerate(self.state.parts):
                for e in part.state.index.values():
                    chain = next(c for c in o.CHAINS if c[e.depth] == e.block_hash)
                    anchor = chain[e.depth - e.depth % range_blocks]
                    assert partition_of_root(anchor, count) == k, (e.depth, k)
                    assert (e.parent is None) == (e.depth % range_blocks == 0)

    SplitFunnelMachine.TestCase.settings = settings(
        max_examples=40, stateful_step_count=50, deadline=None,
        suppress_health_check=[HealthCheck.too_slow])
    return SplitFunnelMachine


def test_split_prompts_spread_over_partitions() -> None:
    """The prompts' ranges (2 blocks each) land on more than one partition for each count
    tested (else the split would prove nothing)."""
    for n in COUNTS:
        for chain in (SA, SB):
            assert _spread(chain, n)
            assert partition_of_root(SA[0], n) == partition_of_root(SB[0], n)


# ranges of 2 blocks (the layout's period, L = 128 tokens): resume points fall on range
# boundaries, so a range's tail and monotone blocks decide with the others'; with the
# reference window (128) an SWA window stays in one range, with 320 (5 blocks) it reaches
# back into the two ranges before, on other partitions
TestSplitTwoPartitions = split_machine(2, 2).TestCase
TestSplitThreePartitions = split_machine(3, 2).TestCase
TestSplitWideWindowTwoPartitions = split_machine(2, 2, window=320).TestCase
TestSplitWideWindowThreePartitions = split_machine(3, 2, window=320).TestCase
