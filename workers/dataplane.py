"""The inference worker's side of the data plane: lookup results in, bytes out (and back).

:class:`DataPlane` joins the metadata service (state) and the shard actors (bytes). It never
raises into model code for a cache problem: every failure becomes a :class:`Recompute` that
names the reason, and every wait on a shard has a deadline. A shard that died or timed out is marked
lost at the metadata service, so the next lookup downgrades instead of pointing at it.

Read path::

    match.load (DISK at rest) --load on the shards' disk tiers--> memory handles
    match.handles (per column, token order) --read_blocks per shard, in parallel--> arrays

Write path (``write_prefix``)::

    allocate --> per shard, in parallel: write_blocks(report=False)   bytes in, readable
             --> transition_many(every readable block's commit)  one call, KVs before the
                 indexers synced to them (a fresh KV's version is its content version)
             --> per shard, in parallel: settle_blocks(how its commits went)  tags recorded
                 for the commits that landed, the rest forgotten

Two metadata calls a request (one more per :data:`~workers.commits.COMMIT_CHUNK` objects past
the first), whichever shards hold its blocks.

A shard on this node whose pools are in shared memory is reached through a
:class:`~workers.shared.SharedLink`: its reads call no shard (one copy out of the segment),
its writes claim the blocks, copy into them and finish (one copy, no bytes through Ray).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TypeVar

import numpy as np

from hkv_service.core.api import Allocation, AllocRequest, Handle, Match, Params
from hkv_service.core.errors import HkvError, InvalidInput, UnknownGroup, WrongSize
from hkv_service.core.hashing import content_version
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import range_anchor, route_key
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Event, Kind, Reason, State

from .commits import commit_many
from .link import Deferred, Pending, ShardLink, ShardUnavailable
from .partitioned import range_blocks_of
from .pool import HandleBatch
from .ports import Commit, ItemResult, Outcome, commit_bytes, payload_bytes
from .shared import SharedLink, shared_links
from .tags import BlockTag

__all__ = ["DataPlane", "PendingLoad", "Recompute", "WriteReport"]

log = logging.getLogger(__name__)
T = TypeVar("T")
# Handles of a failed call sent with its loss report: any one still held by the shard's
# current incarnation shows the report current (a few suffice; one could have been evicted).
WITNESSES = 4
Slot = tuple[int, str]  # (depth, column name)


@dataclass(frozen=True, slots=True)
class Recompute:
    """The cached prefix cannot be used now: recompute it. Never carries bytes."""

    reason: Reason
    detail: str = ""

    @property
    def ok(self) -> bool:
        return False


@dataclass(slots=True)
class WriteReport:
    written: int = 0  # len(wrote)
    existing: int = 0
    wrote: set[Slot] = field(default_factory=set)  # slots this call wrote and committed
    versions: dict[Slot, int] = field(default_factory=dict)  # KV versions of COMPRESSED
    failed: dict[Slot, ItemResult] = field(default_factory=dict)
    handles: dict[Slot, Handle] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed


_GIVE_UP = Commit((Event.EVICT,))  # a fresh object its writer could not write or commit

_OUTCOME_REASON = {
    Outcome.STALE: Reason.STALE_HANDLE,
    Outcome.LOST: Reason.OWNER_LOST,
    Outcome.UNAVAILABLE: Reason.OWNER_LOST,
    Outcome.ADMISSION: Reason.ADMISSION,
    Outcome.CORRUPT: Reason.CORRUPT,
    Outcome.MISSING: Reason.MISSING_COMPONENT,
    Outcome.NOT_HERE: Reason.MISSING_COMPONENT,
    Outcome.NOT_READABLE: Reason.DISK_INFLIGHT,
}


class DataPlane:
    """``shards`` maps a shard id to its :class:`~workers.link.ShardLink` (in-process or Ray:
    ``workers.raylink.ray_links``); the data plane itself imports no Ray."""

    def __init__(self, metadata: MetadataPort, shards: Mapping[str, ShardLink],
                 timeout_s: float = 10.0, shared_memory: bool = True) -> None:
        """``shared_memory``: reads and writes of a shard whose pools this process can map
        copy the bytes once, through the segment (:class:`~workers.shared.SharedLink`)."""
        self.meta = metadata
        self.shards: dict[str, ShardLink] = (shared_links(dict(shards)) if shared_memory
                                             else dict(shards))
        self.timeout_s = timeout_s
        self.layout = Layout(metadata.get_spec())

    def attach_shared(self) -> int:
        """Map now the segment of every shard whose pools this process can map (see
        :meth:`SharedLink.attach`); the number mapped. Optional: transfers map on first use."""
        return sum(link.attach() for link in self.shards.values() if isinstance(link, SharedLink))

    # -- read -------------------------------------------------------------------------------

    def read(self, match: Match, block_hashes: Sequence[BlockHash] | None = None,
             release: bool = True) -> dict[str, list[np.ndarray]] | Recompute:
        """Bytes of every handle in ``match`` (loading disk objects first), or a Recompute.
        ``block_hashes`` (the lookup's) are needed only when ``match.needs_load``."""
        try:
            return self._read(match, block_hashes)
        finally:
            if release:
                self.release(match)

    def release(self, match: Match) -> None:
        """Give ``match``'s lease back (a failure is ignored: the lease expires on its own).
        A reader that was told ``release=False`` calls it once it is done with the bytes: the
        engine's load lane, after telling vLLM the load landed (a round trip to the service
        that the request need not wait for)."""
        if match.lease_id is not None:
            lease = match.lease_id
            self._quietly(lambda: self.meta.release_lease(lease))

    def read_into(self, match: Match, dests: Mapping[str, Sequence[np.ndarray]],
                  block_hashes: Sequence[BlockHash] | None = None,
                  release: bool = True) -> Recompute | None:
        """As :meth:`read`, but each object's bytes are copied into ``dests[column][i]`` (a
        writable uint8 array of exactly that object's size, in ``match.handles`` order: a
        staging buffer, a KV cache page) instead of returned: from a shard on this node, one
        copy straight out of its shared segment. None when every object landed; on a
        Recompute some ``dests`` may hold bytes, none of which is to be used."""
        try:
            handles = self._memory_handles(match, block_hashes)
            if isinstance(handles, Recompute):
                return handles
            flat = [(h, dests[col][i]) for col, hs in handles.items() for i, h in enumerate(hs)]
            by_shard: dict[str, list[int]] = defaultdict(list)
            for j, (h, _) in enumerate(flat):
                by_shard[h.shard].append(j)
            for sid, idx in by_shard.items():
                why = self._read_shard_into(sid, [flat[j][0] for j in idx],
                                            [flat[j][1] for j in idx])
                if why is not None:
                    return why
            return None
        finally:
            if release:
                self.release(match)

    def _read_shard_into(self, sid: str, handles: list[Handle], dests: list[np.ndarray]
                         ) -> Recompute | None:
        link = self.shards.get(sid)
        if link is None:
            return Recompute(Reason.OWNER_LOST, f"{sid!r} is not a known shard")
        if not isinstance(link, SharedLink):
            got = self._by_shard(handles, "read_blocks")
            results: list[ItemResult | None] = []
            for res, dest in zip(got, dests, strict=True):
                if isinstance(res, ItemResult):
                    results.append(res)
                elif res.nbytes != dest.nbytes:
                    results.append(ItemResult(Outcome.FAILED, "size differs from its buffer"))
                else:
                    np.copyto(dest, res)
                    results.append(None)
        else:
            answer = self._get(sid, Deferred(lambda t: link.read_into(handles, dests, t)), handles)
            results = answer if answer is not None else [
                ItemResult(Outcome.UNAVAILABLE, f"shard {sid} died or timed out: recompute")]
        for res in results:
            if res is not None:
                return Recompute(_OUTCOME_REASON.get(res.outcome, Reason.STALE_HANDLE),
                                 res.detail)
        return None

    def _memory_handles(self, match: Match, block_hashes: Sequence[BlockHash] | None
                        ) -> dict[str, list[Handle]] | Recompute:
        """``match.handles``, a disk object's replaced by its memory copy once loaded."""
        handles = {col: list(hs) for col, hs in match.handles.items()}
        if match.needs_load:
            loaded = self.load(match, block_hashes)
            if isinstance(loaded, Recompute):
                return loaded
            for hs in handles.values():
                hs[:] = [loaded.get(h.object_id, h) for h in hs]
        return handles

    def _read(self, match: Match, block_hashes: Sequence[BlockHash] | None
              ) -> dict[str, list[np.ndarray]] | Recompute:
        handles = self._memory_handles(match, block_hashes)
        if isinstance(handles, Recompute):
            return handles
        flat = [(col, i, h) for col, hs in handles.items() for i, h in enumerate(hs)]
        results = self._by_shard([h for _, _, h in flat], "read_blocks")
        out: dict[str, list[np.ndarray]] = {col: [None] * len(hs)  # type: ignore[list-item]
                                            for col, hs in handles.items()}
        for (col, i, _), res in zip(flat, results, strict=True):
            if isinstance(res, ItemResult):
                return Recompute(_OUTCOME_REASON.get(res.outcome, Reason.STALE_HANDLE),
                                 res.detail)
            out[col][i] = res
        return out

    def load(self, match: Match, block_hashes: Sequence[BlockHash] | None
             ) -> dict[int, Handle] | Recompute:
        """Load ``match.load`` on the shards; returns ``{object id: memory handle}``."""
        started = self.start_load(match, block_hashes)
        return started if isinstance(started, Recompute) else started.wait()

    def start_load(self, match: Match, block_hashes: Sequence[BlockHash] | None,
                   hold_s: float = 0.0) -> PendingLoad | Recompute:
        """Start loading ``match.load`` on the shards and return at once; ``wait()`` on the
        result gives what :meth:`load` gives. ``hold_s``: see ``ShardActor.load``."""
        if block_hashes is None:
            return Recompute(Reason.MISSING_COMPONENT, "a disk load needs the lookup's hashes")
        depth_of: dict[int, int] = {}
        for col, hs in match.handles.items():
            depths = self.layout.needed_depths(self.layout.by_name[col], match.usable_tokens)
            if len(depths) != len(hs):
                return Recompute(Reason.MISSING_COMPONENT, f"{col}: handles do not cover it")
            depth_of.update((h.object_id, d) for h, d in zip(hs, depths, strict=True))
        # A DISK handle at rest names its disk owner: each load goes to that shard only.
        by_owner: dict[str, list[tuple[Handle, BlockHash]]] = defaultdict(list)
        for h in match.load:
            by_owner[h.shard].append((h, block_hashes[depth_of[h.object_id]]))
        refs = {}
        for sid, items in by_owner.items():
            link = self.shards.get(sid)
            if link is None:
                return Recompute(Reason.OWNER_LOST, f"disk owner {sid!r} is not a known shard")
            refs[sid] = link.submit("load", items, hold_s=hold_s) if hold_s else \
                link.submit("load", items)
        return PendingLoad(self, match, refs)

    def _finish_load(self, match: Match, refs: Mapping[str, Pending]
                     ) -> dict[int, Handle] | Recompute:
        loaded: dict[int, Handle] = {}
        failures: list[ItemResult] = []
        for sid, ref in refs.items():
            res = self._get(sid, ref, (h for h in match.load if h.shard == sid))
            if res is None:
                continue
            for item in res:
                if item.ok and item.handle is not None:
                    loaded[item.handle.object_id] = item.handle
                else:
                    failures.append(item)
        missing = [h for h in match.load if h.object_id not in loaded]
        if missing:
            why = failures[0] if failures else ItemResult(Outcome.MISSING, "no shard holds it")
            return Recompute(_OUTCOME_REASON.get(why.outcome, Reason.MISSING_COMPONENT),
                             why.detail)
        return loaded

    # -- write ------------------------------------------------------------------------------

    def write_prefix(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Mapping[Slot, Any],
        tails: Mapping[Slot, tuple[Any, int]] | None = None,
        swa_ranges: Mapping[Slot, tuple[int, int]] | None = None,
        owner: ShardId | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> WriteReport:
        """Allocate, write and commit every block of a prefix. ``token_ids``: the tokens of
        ``block_hashes``' blocks (``hash_block`` per hash), carried by the allocate for the KV
        event stream (a router keys blocks by them); of another length, InvalidInput is
        raised before anything is allocated. ``blocks[(depth, column)]`` is
        the bytes of a COMPRESSED/SWA/INDEXER block; ``tails[(depth, "<group>.tail")]`` is
        ``(bytes, raw tokens held)``; ``swa_ranges`` optionally narrows an SWA block's
        ``[lo, hi)``. Each block is exactly its object's bytes (``Layout.object_bytes``: a
        tail its raw tokens, an SWA block its range, any other block whole), else WrongSize
        is raised before anything is allocated. Objects already present are left alone
        (``existing``). A COMPRESSED
        block's KV version is its content version (``hashing.content_version``): a block
        rewritten with the same bytes keeps the indexers and disk copies synced to it."""
        data: dict[Slot, tuple[Any, Commit]] = {}
        for slot, arr in blocks.items():
            data[slot] = (arr, self._commit_for(slot, arr, (swa_ranges or {}).get(slot)))
        for slot, (arr, n) in (tails or {}).items():
            data[slot] = (arr, Commit((Event.TAIL_DONE,), (Params(tail_len=n),)))
        self._check_sizes(data)
        if token_ids is not None and len(token_ids) != len(block_hashes) * self.layout.hash_block:
            raise InvalidInput(f"{len(token_ids)} token ids for {len(block_hashes)} hash blocks "
                               f"of {self.layout.hash_block} tokens")
        report = WriteReport()
        slots = sorted(data)
        try:
            allocs = self.meta.allocate(
                block_hashes, [AllocRequest(d, c) for d, c in slots], owner, token_ids=token_ids
            )
        except HkvError as exc:
            for slot in slots:
                report.failed[slot] = ItemResult(Outcome.FAILED, str(exc), cause=type(exc))
            return report
        fresh = self._note_allocations(slots, allocs, report)
        existing = {s: a for s, a in zip(slots, allocs, strict=True) if a.existing}
        first, second, stale = self._plan(slots, fresh, existing, data, report)
        replaced = self._replace(block_hashes, stale, owner, report)
        self._write(block_hashes, first + second + replaced, data, report)
        self._give_back([report.handles[s] for s in (*fresh, *replaced) if s in report.failed])
        return report

    def _give_back(self, handles: Sequence[Handle]) -> None:
        """The objects this call allocated and could not write or commit go back (EVICT
        from ALLOCATED: a writer gave up). Left, each held its slot as an object "already
        there" that no later writer writes (a write whose shard died had stranded them for
        good once stale loss reports stopped ending the live shard)."""
        if handles:
            self._quietly(lambda: commit_many(self.meta, [(h, _GIVE_UP) for h in handles]))

    def _plan(self, slots: list[Slot], fresh: list[Slot], existing: Mapping[Slot, Allocation],
              data: dict[Slot, tuple[Any, Commit]], report: WriteReport
              ) -> tuple[list[Slot], list[Slot], dict[Slot, Allocation]]:
        """The slots to write, in the order their commits are reported: the fresh KV, SWA and
        tail blocks, then the indexers, each synced to its KV's version as this call leaves it
        (a fresh KV's is its content version, known before it lands). Indexers are synced to
        the KV written in this call: the fresh ones, and (third) existing ones left unsynced
        or synced to a version that moved on (their KV was evicted and rewritten with other
        bytes), which would otherwise stay INDEXER_STALE until evicted: those are replaced by
        fresh objects (:meth:`_replace`), never rewritten in place."""
        first = [s for s in fresh if self._kind(s) is not Kind.INDEXER]
        versions = {s: data[s][1].merged().version for s in first
                    if self._kind(s) is Kind.COMPRESSED}
        second: list[Slot] = []
        stale: dict[Slot, Allocation] = {}
        for s in slots:
            if self._kind(s) is not Kind.INDEXER:
                continue
            kv_slot = self._kv_slot(s)
            version = versions.get(kv_slot, self._same_kv(kv_slot, existing, data))
            old = existing.get(s)
            if old is not None and (version is None or (
                    old.state is State.INDEXER_SYNCED and old.version == version)):
                continue  # in sync, or nothing to sync it to: leave it alone
            if version is None:
                report.failed[s] = ItemResult(
                    Outcome.FAILED, "its compressed KV was not written in this call")
                continue
            arr, _ = data[s]
            data[s] = (arr, Commit((Event.WRITE_DONE, Event.INDEXER_SYNC),
                                   (None, Params(version=version))))
            if old is None:
                second.append(s)
            else:
                stale[s] = old
        return first, second, stale

    def _replace(self, hashes: Sequence[BlockHash], stale: Mapping[Slot, Allocation],
                 owner: ShardId | None, report: WriteReport) -> list[Slot]:
        """Fresh objects for the ``stale`` ones (copy-on-write: each old one is retired
        before a byte is written, refused while a reader holds it); the slots to write."""
        if not stale:
            return []
        slots = sorted(stale)
        reqs = [AllocRequest(d, c, replace=int(stale[(d, c)].handle.object_id)) for d, c in slots]
        try:
            allocs = self.meta.allocate(hashes, reqs, owner)
        except HkvError as exc:
            for slot in slots:
                report.failed[slot] = ItemResult(Outcome.FAILED, str(exc), cause=type(exc))
            return []
        out = []
        for slot, a in zip(slots, allocs, strict=True):
            report.handles[slot] = a.handle
            if a.existing:  # still there: a reader holds it (or a writer just made it)
                report.failed[slot] = ItemResult(
                    Outcome.FAILED, f"{slot[1]!r} at depth {slot[0]} is held by a reader "
                    "(lease or graph capture): not replaced; a later write replaces it")
            else:
                out.append(slot)
        return out

    def _kind(self, slot: Slot) -> Kind:
        return self.layout.columns[self.layout.by_name[slot[1]]].kind

    def _kv_slot(self, indexer: Slot) -> Slot:
        kv = self.layout.columns[self.layout.by_name[indexer[1]]].indexes
        assert kv is not None
        return (indexer[0], self.layout.columns[kv].name)

    @staticmethod
    def _same_kv(kv_slot: Slot, existing: Mapping[Slot, Allocation],
                 data: Mapping[Slot, tuple[Any, Commit]]) -> int | None:
        """The version of a KV already there whose bytes are this call's (its version is the
        content version of the bytes this call brings): an indexer of those bytes syncs to
        it. None if the KV there holds other bytes, or this call brings none for it. (The
        sync's precondition checks the KV is still at that version when it lands.)"""
        kv = existing.get(kv_slot)
        mine = data.get(kv_slot)
        if kv is None or mine is None or kv.state is not State.COMPRESSED_READY:
            return None
        version = mine[1].merged().version
        return version if version is not None and kv.version == version else None

    def _check_sizes(self, data: Mapping[Slot, tuple[Any, Commit]]) -> None:
        """Raise WrongSize (nothing allocated yet) unless every block is exactly its object's
        bytes: a tail its ``n`` raw tokens, an SWA block its range, any other block whole."""
        for (depth, name), (arr, commit) in sorted(data.items()):
            col = self.layout.by_name.get(name)
            if col is None:
                raise UnknownGroup(f"unknown column {name!r}; the spec has "
                                   f"{sorted(self.layout.by_name)}")
            want = commit_bytes(self.layout, col, depth, commit)
            got = payload_bytes(arr)
            if want != got:
                raise WrongSize(f"{name!r} at depth {depth}", want or 0, got)

    def _commit_for(self, slot: Slot, arr: Any, swa: tuple[int, int] | None) -> Commit:
        kind = self.layout.columns[self.layout.by_name[slot[1]]].kind
        if kind is Kind.SWA and swa is not None:
            return Commit((Event.WRITE_DONE,), (Params(lo=swa[0], hi=swa[1]),))
        if kind is Kind.COMPRESSED:  # the same bytes keep their version (and their indexer)
            version = content_version(np.ascontiguousarray(arr).data)
            return Commit((Event.WRITE_DONE,), (Params(version=version),))
        return Commit((Event.WRITE_DONE,))

    def _note_allocations(self, slots: list[Slot], allocs: Sequence[Allocation],
                          report: WriteReport) -> list[Slot]:
        fresh = []
        for slot, a in zip(slots, allocs, strict=True):
            report.handles[slot] = a.handle
            if a.existing:
                report.existing += 1
            else:
                fresh.append(slot)
        return fresh

    def _write(self, hashes: Sequence[BlockHash], slots: list[Slot],
               data: Mapping[Slot, tuple[Any, Commit]], report: WriteReport) -> None:
        """Write ``slots`` on their shards (in parallel, bytes only), report every commit of
        the blocks that became readable in one ``transition_many`` (in ``slots``' order: a
        KV lands before its indexer's sync), then tell each shard how its commits went (it
        records the tags of those that landed and forgets the rest)."""
        if not slots:
            return
        handles = [report.handles[s] for s in slots]
        # the disk tag says which metadata partition it is in: its root's, or with chains
        # split, its range's first hash's
        cut = range_blocks_of(self.meta)
        tags = [BlockTag(hashes[d], hashes[d - 1] if d else None, d,
                         route=route_key(hashes[range_anchor(d, cut)])) for d, _ in slots]
        commits = [data[s][1] for s in slots]
        extra = {"arrays": [data[s][0] for s in slots], "tags": tags, "commits": commits}
        results = self._by_shard(handles, "write_blocks", extra, report=False)
        written = self._readable(slots, results, report)
        landed = commit_many(self.meta, [(handles[i], commits[i]) for i in written])
        outcome: dict[int, ItemResult] = dict(zip(written, landed, strict=True))
        for i in written:
            res = outcome[i]
            if res.ok:
                report.written += 1
                report.wrote.add(slots[i])
                if self._kind(slots[i]) is Kind.COMPRESSED:
                    report.versions[slots[i]] = res.version
            else:
                report.failed[slots[i]] = res
        settle = [i for i, r in enumerate(results) if isinstance(r, ItemResult) and r.ok]
        for i in settle:
            if i not in outcome:  # written but not reported (its KV's write failed): forgotten
                outcome[i] = report.failed[slots[i]]
        settled = self._by_shard([handles[i] for i in settle], "settle_blocks", {
            "tags": [tags[i] for i in settle], "commits": [commits[i] for i in settle],
            "results": [outcome[i] for i in settle]})
        self._unreadable(slots, [(i, r) for i, r in zip(settle, settled, strict=True)
                                 if outcome[i].ok], report)

    @staticmethod
    def _unreadable(slots: list[Slot], settled: Sequence[tuple[int, Any]],
                    report: WriteReport) -> None:
        """Commits that landed on blocks their shard does not hold readable, failed (they are
        given back). Through shared memory the finish is posted and the commits report before
        its answer is read; a finish the shard refused leaves the block claimed, and its
        settle (taken after the finish, on the same socket) says so. Left READY, every lookup
        would hit the object and every read of it recompute."""
        for i, res in settled:
            if isinstance(res, ItemResult) and res.ok:
                continue
            slot = slots[i]
            report.written -= 1
            report.wrote.discard(slot)
            report.versions.pop(slot, None)
            report.failed[slot] = res if isinstance(res, ItemResult) else ItemResult(
                Outcome.UNAVAILABLE, "its shard did not settle the write")

    def _readable(self, slots: list[Slot], results: Sequence[Any],
                  report: WriteReport) -> list[int]:
        """The indices of the blocks to commit: written, and an indexer's KV in this call
        written too (its sync would be refused)."""
        failed = set()
        for slot, res in zip(slots, results, strict=True):
            if not (isinstance(res, ItemResult) and res.ok):
                report.failed[slot] = res if isinstance(res, ItemResult) else ItemResult(
                    Outcome.FAILED, "unexpected reply")
                failed.add(slot)
        out = []
        for i, slot in enumerate(slots):
            if slot in failed:
                continue
            if self._kind(slot) is Kind.INDEXER and self._kv_slot(slot) in failed:
                report.failed[slot] = ItemResult(
                    Outcome.FAILED, "its compressed KV was not written in this call")
                continue
            out.append(i)
        return out

    # -- offload ----------------------------------------------------------------------------

    def offload(self, handles: Sequence[Handle], tags: Sequence[BlockTag | None] | None = None,
                evict_memory: bool = False) -> list[ItemResult]:
        """Offload memory objects to the disk tier of the shard that holds them."""
        extra: dict[str, list[Any]] = {"tags": list(tags) if tags else [None] * len(handles)}
        results = self._by_shard(list(handles), "offload", extra, evict_memory=evict_memory)
        return [r if isinstance(r, ItemResult) else ItemResult(Outcome.FAILED) for r in results]

    # -- plumbing ---------------------------------------------------------------------------

    def _by_shard(self, handles: Sequence[Handle], method: str,
                  extra: Mapping[str, Sequence[Any]] | None = None, **kwargs: Any) -> list[Any]:
        """Call ``method`` once per shard with its handles (and the matching slices of
        ``extra``), all shards in parallel; results in the order of ``handles``."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, h in enumerate(handles):
            groups[h.shard].append(i)
        refs = {}
        out: list[Any] = [ItemResult(Outcome.UNAVAILABLE, "no such shard")] * len(handles)
        for sid, idx in groups.items():
            link = self.shards.get(sid)
            if link is None:
                continue
            args = {k: [v[i] for i in idx] for k, v in (extra or {}).items()}
            batch = HandleBatch.of([handles[i] for i in idx])  # one array, not N pickled handles
            refs[sid] = link.submit(method, batch, **args, **kwargs)
        for sid, ref in refs.items():
            res = self._get(sid, ref, (handles[i] for i in groups[sid]))
            for j, i in enumerate(groups[sid]):
                out[i] = res[j] if res is not None else ItemResult(
                    Outcome.UNAVAILABLE, f"shard {sid} died or timed out: recompute")
        return out

    def _get(self, shard: str, ref: Pending, handles: Iterable[Handle]) -> Any:
        """The call's result within the deadline; a dead or silent shard is marked lost
        (None). The report names the shard process the call went to (the link's
        ``ShardUnavailable.instance``), and the first of ``handles`` (the call's; only read on
        a failure) as witnesses for a link that does not know it: Ray reports a crashed
        call's failure once the restarted shard is up, and a replaced actor's old handle
        fails while its successor serves; neither report may end the successor
        (``CacheState.mark_owner_lost``)."""
        try:
            return ref.result(self.timeout_s)
        except ShardUnavailable as exc:
            log.warning("shard %s unavailable (%s); marking it lost", shard, exc.why)
            seen = [int(h.object_id) for h in islice(handles, WITNESSES)]
            instance = exc.instance
            self._quietly(lambda: self.meta.mark_owner_lost(ShardId(shard), seen, instance))
            return None

    @staticmethod
    def _quietly(fn: Callable[[], T]) -> T | None:
        try:
            return fn()
        except Exception as exc:
            log.debug("ignored: %s", exc)
            return None


class PendingLoad:
    """Loads started on the shards (:meth:`DataPlane.start_load`); ``wait`` finishes them."""

    def __init__(self, plane: DataPlane, match: Match, refs: Mapping[str, Pending]) -> None:
        self._plane, self._match, self._refs = plane, match, dict(refs)

    def wait(self) -> dict[int, Handle] | Recompute:
        return self._plane._finish_load(self._match, self._refs)
