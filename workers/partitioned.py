"""One metadata port over N metadata partitions (``hkv up --service-replicas N``).

Each partition is a whole service (a ``hkv serve`` process, an actor, a ``LocalMetadata``)
holding the chains whose root routes to it (:mod:`hkv_service.core.partitions`). This class
is the :class:`~hkv_service.core.port.MetadataPort` its callers already use, so the data plane, the
shards and the connector do not change::

    lookup / allocate       -> the partition of block_hashes[0] (the root); with chains split
                               every R blocks (range_blocks), each range to the partition of
                               its first hash, a lookup's answer found as a fixed point over
                               them (workers/split.py)
    transition, evict, begin_offload, begin_load, check_read -> the partition of the object id
    transition_many         -> split by object id, one call per partition, answers in order
    release_lease           -> the partition of the lease id
    admit_save              -> the partition of the chain's root (its offers counted there)
    register_owner          -> every partition, each given its own range of every pool
    heartbeat               -> every partition; those that forgot the owner are named in
                               PartitionsLost, so the owner re-registers with those only
    confirm_objects         -> a memory report by its block's range, a disk record by the
                               route key its tag carries (ObjectReport.route)

The incarnation returned to an owner is this client's own number for the set of per-partition
incarnations it holds; a partition re-registered alone gives a new one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from hkv_service.core import api
from hkv_service.core.errors import HkvError, InvalidInput, UnknownOwner
from hkv_service.core.ids import BlockHash, LeaseId, ObjectId, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import (
    MAX_PARTITIONS,
    block_range,
    partition_of_block,
    partition_of_id,
    partition_of_lease,
    partition_of_root,
    partition_of_route,
    ranges,
)
from hkv_service.core.port import MetadataPort
from hkv_service.core.spec import CacheSpec
from hkv_service.core.states import Event

from . import split

__all__ = ["PartitionedMetadata", "PartitionsLost", "partition_count", "partition_of_block_of",
           "pool_ranges", "range_blocks_of"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class PartitionsLost(UnknownOwner):
    """Some partitions no longer know the owner (restarted, or declared it lost):
    ``partitions`` names them; re-register with those (``register_owner(..., partitions=)``)
    and vouch again for what is theirs."""

    def __init__(self, message: str, *, partitions: frozenset[int]) -> None:
        super().__init__(message)
        self.partitions = partitions


def partition_count(meta: object) -> int:
    """How many metadata partitions stand behind a port (1 for a plain one)."""
    return meta.count if isinstance(meta, PartitionedMetadata) else 1


def range_blocks_of(meta: object) -> int:
    """Where the chains behind a port are split (0: kept whole, as a plain port's are)."""
    return meta.range_blocks if isinstance(meta, PartitionedMetadata) else 0


class PartitionedMetadata:
    def __init__(self, parts: Sequence[MetadataPort], inline: bool = False) -> None:
        """``inline``: call the partitions one after another in the caller's thread instead
        of at once from a pool (partitions in this process: their calls hold one GIL, so
        threads would only add handoffs)."""
        if not 1 <= len(parts) <= MAX_PARTITIONS:
            raise InvalidInput(f"between 1 and {MAX_PARTITIONS} metadata partitions are "
                               f"supported, got {len(parts)}")
        self.parts = list(parts)
        self.count = len(parts)
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)
        # owner -> (the incarnation handed out, per-partition incarnations, whole pools)
        self._owners: dict[ShardId, tuple[int, list[int], dict[str, api.PoolConfig]]] = {}
        self._fan: Executor = (_Inline() if inline else ThreadPoolExecutor(
            max_workers=self.count, thread_name_prefix="hkv-part"))
        self._spec: CacheSpec | None = None
        # a split chain's match holds a lease per range: the match names the first, which
        # names the rest here, until released or past their time
        self._joint: dict[LeaseId, tuple[float, list[tuple[int, LeaseId]]]] = {}

    # -- routing ------------------------------------------------------------------------------

    def _root(self, hashes: Sequence[BlockHash]) -> MetadataPort:
        return self.parts[partition_of_root(hashes[0], self.count) if len(hashes) else 0]

    def _of_anchor(self, anchor: BlockHash) -> int:
        return partition_of_root(anchor, self.count)

    @functools.cached_property
    def range_blocks(self) -> int:
        """Where chains are split (every partition's stats ``range_blocks``; they must
        agree): 0, chains kept whole in their root's partition."""
        answers = self._each(lambda _i, p: _stats_of(p).get("range_blocks", 0) or 0)
        each: set[int] = {int(r) for _, r in answers  # type: ignore[call-overload]
                          if not isinstance(r, BaseException)}
        if not each:  # none reachable: the first one's error (nothing is cached)
            self._raising(answers)
        if len(each) > 1:
            raise InvalidInput(f"the metadata partitions split chains at different depths "
                               f"({sorted(each)}): start every replica with the same "
                               "--range-blocks")
        return each.pop()

    @functools.cached_property
    def _layout(self) -> Layout:
        return Layout(self.get_spec())

    def _of_id(self, object_id: int) -> MetadataPort:
        return self.parts[partition_of_id(object_id, self.count)]

    def _each(self, call: Callable[[int, MetadataPort], T],
              which: Sequence[int] | None = None) -> list[tuple[int, T | BaseException]]:
        """``call`` on the partitions ``which`` (default all) at once; every answer or error."""
        which = range(self.count) if which is None else which
        futures = [(i, self._fan.submit(call, i, self.parts[i])) for i in which]
        out: list[tuple[int, T | BaseException]] = []
        for i, f in futures:
            try:
                out.append((i, f.result()))
            except BaseException as exc:  # each partition's answer is sorted by the caller
                out.append((i, exc))
        return out

    # -- the port -----------------------------------------------------------------------------

    def get_spec(self) -> CacheSpec:
        if self._spec is None:
            specs = [s for _, s in self._raising(self._each(lambda _i, p: p.get_spec()))]
            if any(s != specs[0] for s in specs):
                raise InvalidInput("the metadata partitions run different cache specs: start "
                                   "every replica with the same --spec")
            self._check_places()
            self._spec = specs[0]
        return self._spec

    def _check_places(self) -> None:
        """Each partition says which it is (stats ``partition``): a list given in another
        order than the deployment's would send chains to partitions that refuse them."""
        for i, part in enumerate(self.parts):
            stats = getattr(part, "stats", None)
            if stats is None:
                continue
            place = stats().get("partition", f"{i}/{self.count}")
            if place != f"{i}/{self.count}":
                raise InvalidInput(f"metadata partition {i} of {self.count} in this client's "
                                   f"list says it is partition {place}: list the endpoints in "
                                   "the order hkv up printed them")

    def register_owner(self, owner: ShardId, pools: Mapping[str, api.PoolConfig],
                       instance: int = 0, partitions: frozenset[int] | None = None) -> int:
        """Register with every partition (or only ``partitions``: those that lost the owner),
        each over its own range of every pool. Returns this client's incarnation number."""
        whole = {name: cfg for name, cfg in pools.items()}
        for name, cfg in whole.items():
            if cfg.num_blocks - cfg.first < self.count:
                raise InvalidInput(f"pool {name!r} has {cfg.num_blocks - cfg.first} blocks, "
                                   f"fewer than the {self.count} metadata partitions that "
                                   "each need a range of it")
        with self._lock:
            prior = self._owners.get(owner)
            if partitions is not None and prior is None:
                partitions = None  # never registered here: all of them
            which = sorted(range(self.count) if partitions is None else partitions)
            got = self._raising(self._each(
                lambda i, p: p.register_owner(owner, pool_ranges(whole, i, self.count),
                                              instance), which))
            incs = list(prior[1]) if prior is not None else [0] * self.count
            for i, inc in got:
                incs[i] = inc
            number = next(self._numbers)
            self._owners[owner] = (number, incs, whole)
            return number

    def _current(self, owner: ShardId, incarnation: int) -> tuple[list[int],
                                                                   dict[str, api.PoolConfig]]:
        known = self._owners.get(owner)
        if known is None or known[0] != incarnation:
            raise UnknownOwner(f"owner {owner!r} incarnation {incarnation} is not current; "
                               "re-register")
        return known[1], known[2]

    def heartbeat(self, owner: ShardId, incarnation: int) -> None:
        """Every partition; PartitionsLost names those that forgot the owner, else the first
        other error (a partition unreachable) is raised once all were asked."""
        incs, _ = self._current(owner, incarnation)
        answers = self._each(lambda i, p: p.heartbeat(owner, incs[i]))
        lost = frozenset(i for i, r in answers if isinstance(r, UnknownOwner))
        if lost:
            raise PartitionsLost(f"metadata partitions {sorted(lost)} of {self.count} do not "
                                 f"know owner {owner!r}; re-register with them",
                                 partitions=lost)
        self._raising(answers)

    def mark_owner_lost(self, owner: ShardId, witnesses: Sequence[int] = (),
                        instance: int = 0) -> int | None:
        """Every partition is told, whatever one of them answers (one that restarted and does
        not know the owner yet, or is unreachable, stops none of the others).

        With ``instance`` each partition judges alone (``CacheState.mark_owner_lost``: the
        owner process registered the same instance with every partition), its witnesses
        beside it for an owner that registered none. Without, the witnesses go to the
        partitions that hold them, which judge whether the report is current; if one finds
        it so, every other partition is told too; if all find it stale, none is (a partition
        without a witness cannot tell, and its registration of the owner's successor must not
        be ended); if none could judge, all are told. A successor that registered with some
        partitions before a current report reached them is ended there; it registers again
        (``ShardActor._register``, or its next heartbeat). None: stale everywhere it was
        judged."""
        mine: dict[int, list[int]] = {}
        for oid in witnesses:
            mine.setdefault(partition_of_id(ObjectId(oid), self.count), []).append(oid)
        if instance or not witnesses:
            return _verdict(self._each(
                lambda i, p: p.mark_owner_lost(owner, mine.get(i, []), instance)))
        judged = _answered(self._each(lambda i, p: p.mark_owner_lost(owner, mine[i]),
                                      sorted(mine)))
        if judged and all(n is None for n in judged):
            return None
        rest = _answered(self._each(lambda _i, p: p.mark_owner_lost(owner),
                                    [i for i in range(self.count) if i not in mine]))
        return sum(n or 0 for n in (*judged, *rest))

    def confirm(self, owner: ShardId, reports: Sequence[api.ObjectReport], incarnation: int) -> int:
        return sum(1 for oid in self.confirm_objects(owner, reports, incarnation)
                   if oid is not None)

    def confirm_objects(self, owner: ShardId, reports: Sequence[api.ObjectReport],
                        incarnation: int) -> list[ObjectId | None]:
        incs, pools = self._current(owner, incarnation)
        groups: dict[int, list[int]] = {}
        cut = self.range_blocks
        if cut:  # a range's first block has no parent in its partition
            reports = [replace(r, parent_hash=None) if r.depth % cut == 0 and r.depth
                       else r for r in reports]
        for k, r in enumerate(reports):
            groups.setdefault(self._partition_of_report(r, pools), []).append(k)
        out: list[ObjectId | None] = [None] * len(reports)
        answers = self._raising(self._each(
            lambda i, p: p.confirm_objects(owner, [reports[k] for k in groups[i]], incs[i]),
            sorted(groups)))
        for i, ids in answers:
            for k, oid in zip(groups[i], ids, strict=True):
                out[k] = oid
        return out

    def _partition_of_report(self, r: api.ObjectReport, pools: Mapping[str, api.PoolConfig]) -> int:
        """(A report's first block of a range, when chains are split, goes without its parent
        hash: the parent is in another partition; :meth:`confirm_objects`.)"""
        if r.block >= 0:
            cfg = pools.get(r.column)
            if cfg is None:
                raise InvalidInput(f"report names column {r.column!r}, which this owner "
                                   "registered no pool for")
            return partition_of_block_of(cfg, r.block, self.count)
        return partition_of_route(r.route, self.count)

    def allocate(self, block_hashes: Sequence[BlockHash], requests: Sequence[api.AllocRequest],
                 owner: ShardId | None = None, first_block: int = 0,
                 token_ids: Sequence[int] | None = None) -> list[api.Allocation]:
        cut = self.range_blocks
        if not cut or first_block or all(r.depth < cut for r in requests):
            return self._root(block_hashes).allocate(block_hashes, requests, owner,
                                                     first_block=first_block,
                                                     token_ids=token_ids)
        groups = split.split_slots(block_hashes, requests, cut)
        hb = len(token_ids) // len(block_hashes) if token_ids is not None and block_hashes else 0
        futures = [(idx, self._fan.submit(
            self.parts[self._of_anchor(hashes[0])].allocate, hashes,
            [requests[i] for i in idx], owner, first_block=lo,
            # each range's partition is told its blocks' tokens (it publishes their events)
            token_ids=(token_ids[lo * hb:(lo + len(hashes)) * hb] if token_ids is not None
                       else None))) for lo, hashes, idx in groups]
        out: list[api.Allocation | None] = [None] * len(requests)
        failed: BaseException | None = None
        for idx, f in futures:
            try:
                for i, got in zip(idx, f.result(), strict=True):
                    out[i] = got
            except BaseException as exc:  # all answered first: then undo the others
                failed = failed or exc
        if failed is not None:
            for a in out:  # all or nothing, as one partition's allocate is
                if a is not None and not a.existing:
                    self._quiet_evict(a.handle.object_id)
            raise failed
        return out  # type: ignore[return-value]

    def _quiet_evict(self, object_id: ObjectId) -> None:
        with contextlib.suppress(HkvError):  # already gone (an owner lost, a restart)
            self.evict(object_id)

    def transition(self, object_id: ObjectId, event: Event, params: api.Params | None = None,
                   generation: int | None = None) -> api.TransitionResult:
        return self._of_id(object_id).transition(object_id, event, params, generation)

    def transition_many(self, items: Sequence[api.ObjectTransitions]
                        ) -> list[api.TransitionResult | HkvError]:
        groups: dict[int, list[int]] = {}
        for k, item in enumerate(items):
            groups.setdefault(partition_of_id(item.object_id, self.count), []).append(k)
        if len(groups) == 1:
            return self.parts[next(iter(groups))].transition_many(items)
        out: list[api.TransitionResult | HkvError] = [HkvError("not answered")] * len(items)
        answers = self._each(
            lambda i, p: p.transition_many([items[k] for k in groups[i]]), sorted(groups))
        for i, results in answers:
            if isinstance(results, HkvError):  # that partition's items only: the others
                results = [results] * len(groups[i])  # were applied, and must say so
            elif isinstance(results, BaseException):
                raise results
            for k, res in zip(groups[i], results, strict=True):
                out[k] = res
        return out

    def evict(self, object_id: ObjectId) -> None:
        self._of_id(object_id).evict(object_id)

    def begin_offload(self, object_id: ObjectId, disk_owner: ShardId) -> api.Handle:
        return self._of_id(object_id).begin_offload(object_id, disk_owner)

    def begin_load(self, object_id: ObjectId, owner: ShardId | None = None) -> api.Handle:
        return self._of_id(object_id).begin_load(object_id, owner)

    def lookup(self, req: api.LookupRequest) -> api.Match:
        cut, hashes = self.range_blocks, req.block_hashes
        if not cut or req.first_block or len(hashes) <= cut:
            return self._root(hashes).lookup(req)
        hb = self._layout.hash_block
        limit = len(hashes) * hb if req.resume_tokens is None else req.resume_tokens
        if not 0 <= limit <= len(hashes) * hb or limit <= cut * hb:
            # within the root's range (or malformed: the root's partition says why)
            return self._root(hashes).lookup(
                req if limit > cut * hb or limit < 0 else replace(req, block_hashes=hashes[:cut]))
        spans = ranges(limit // hb, cut)

        def ask(ks: Sequence[int], p: int) -> list[split.RangeAnswer]:
            where = [self._of_anchor(hashes[spans[k][0]]) for k in ks]
            futures = [self._fan.submit(self.parts[i].lookup,
                                        split.range_request(req, spans, k, p, hb))
                       for k, i in zip(ks, where, strict=True)]
            got: list[split.RangeAnswer] = []
            failed: BaseException | None = None
            for k, i, f in zip(ks, where, futures, strict=True):
                try:
                    got.append(split.RangeAnswer(k, i, f.result()))
                except BaseException as exc:
                    failed = failed or exc
            if failed is not None:
                release(got)
                raise failed
            return got

        def release(answers: Sequence[split.RangeAnswer]) -> None:
            for a in answers:
                if a.match.lease_id is not None:
                    self._quiet_release(a.partition, a.match.lease_id)

        p, final, first = split.fixed_point(limit, self._layout, cut, ask, release)
        leases = [(a.partition, a.match.lease_id) for a in sorted(final, key=lambda a: a.index)
                  if a.match.lease_id is not None]
        lease_id = leases[0][1] if leases else None
        if len(leases) > 1:
            assert lease_id is not None
            with self._lock:
                self._prune_joint()
                self._joint[lease_id] = (time.monotonic() + req.lease_ttl_s, leases[1:])
        return split.joined(p, final, first, spans, hb, lease_id)

    def _prune_joint(self) -> None:
        now = time.monotonic()
        if len(self._joint) > 1024:  # (their partitions have expired them already)
            for lid in [k for k, (until, _) in self._joint.items() if until < now]:
                del self._joint[lid]

    def _quiet_release(self, partition: int, lease_id: LeaseId) -> None:
        with contextlib.suppress(HkvError):  # expired already: nothing held
            self.parts[partition].release_lease(lease_id)

    def admit_save(self, block_hashes: Sequence[BlockHash], needed: int,
                   offered_from: int = 0) -> int:
        # the whole chain's offers are counted where its root is (split chains too)
        return self._root(block_hashes).admit_save(block_hashes, needed, offered_from)

    def release_lease(self, lease_id: LeaseId) -> None:
        with self._lock:
            _, rest = self._joint.pop(lease_id, (0.0, []))
        for i, lid in rest:
            self._quiet_release(i, lid)
        self.parts[partition_of_lease(lease_id, self.count)].release_lease(lease_id)

    def check_read(self, handle: api.Handle, lease_id: LeaseId | None = None) -> None:
        part = partition_of_id(handle.object_id, self.count)
        if lease_id is not None and partition_of_lease(lease_id, self.count) != part:
            with self._lock:  # a split chain's match: the lease its partition gave
                _, rest = self._joint.get(lease_id, (0.0, []))
            lease_id = next((lid for i, lid in rest if i == part), lease_id)
        self.parts[part].check_read(handle, lease_id)

    # -- not part of the port -------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Every partition's stats under ``partitions`` (in order), and their counters and
        gauges summed at the top level, as one service reports them."""
        each = [s for _, s in self._raising(self._each(lambda _i, p: _stats_of(p)))]
        merged: dict[str, object] = _summed(each)
        merged["partition"] = f"all {self.count}"
        merged["partitions"] = each
        return merged

    def close(self) -> None:
        for part in self.parts:
            close = getattr(part, "close", None)
            if close is not None:
                close()
        self._fan.shutdown(wait=False)

    def __enter__(self) -> PartitionedMetadata:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _raising(answers: list[tuple[int, T | BaseException]]) -> list[tuple[int, T]]:
        for _, r in answers:
            if isinstance(r, BaseException):
                raise r
        return answers  # type: ignore[return-value]


def _answered(answers: list[tuple[int, int | BaseException | None]]) -> list[int | None]:
    """The partitions' verdicts on a loss report; one that failed (it does not know the
    owner, or is unreachable) gave none and is logged."""
    out: list[int | None] = []
    for i, r in answers:
        if isinstance(r, BaseException):
            log.info("metadata partition %d gave no verdict on a loss report: %s", i, r)
        else:
            out.append(r)
    return out


def _verdict(answers: list[tuple[int, int | BaseException | None]]) -> int | None:
    judged = _answered(answers)
    if judged and all(n is None for n in judged):
        return None
    return sum(n or 0 for n in judged)


class _Inline(Executor):
    """An executor that runs each call at once, in the caller's thread."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        done: Future[T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever asks the future
            done.set_exception(exc)
        return done


def pool_ranges(pools: Mapping[str, api.PoolConfig], index: int, count: int
                ) -> dict[str, api.PoolConfig]:
    """Partition ``index``'s range of every pool (blocks keep their numbers: a handle's block
    is the shard's own)."""
    out = {}
    for name, cfg in pools.items():
        lo, hi = block_range(cfg.num_blocks - cfg.first, index, count)
        out[name] = replace(cfg, first=cfg.first + lo, num_blocks=cfg.first + hi)
    return out


def partition_of_block_of(cfg: api.PoolConfig, block: int, count: int) -> int:
    """The partition that hands out ``block`` of a pool registered whole as ``cfg``."""
    return partition_of_block(block - cfg.first, cfg.num_blocks - cfg.first, count)


def _stats_of(part: Any) -> dict[str, object]:
    stats = getattr(part, "stats", None)
    return dict(stats()) if stats is not None else {}


def _summed(each: Sequence[Mapping[str, object]]) -> dict[str, object]:
    """Numbers summed key by key (nested dicts alike); anything else from the first."""
    out: dict[str, object] = {}
    for stats in each:
        for key, value in stats.items():
            if isinstance(value, bool) or key in ("partition", "partitions"):
                out.setdefault(key, value)
            elif isinstance(value, int | float):
                prior = out.get(key, 0)
                out[key] = (prior if isinstance(prior, int | float) else 0) + value
            elif isinstance(value, Mapping):
                prior_map = out.get(key)
                out[key] = _summed([prior_map, value] if isinstance(prior_map, Mapping)
                                   else [value])
            else:
                out.setdefault(key, value)
    return out
