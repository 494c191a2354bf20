"""A request's write in two metadata calls, whichever shards hold its blocks: one allocate,
then one ``transition_many`` of every commit (the data plane reports them once the shards say
the bytes are readable: KVs before the indexers synced to them), never one call per event or
per shard. In process (no Ray): the real data plane, shards and state behind
``LocalMetadata``, every port wrapped in a counting proxy.

The adversary's cases: a commit refused (its object evicted while the bytes went in), the
commit call failing whole, a shard whose write failed: nothing unconfirmed is a hit, the
shards forget the bytes whose commit did not land and keep no tag for them (a restarted
service must not be handed them back)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hkv_service.core.api import LookupRequest
from hkv_service.core.ids import ShardId
from hkv_service.core.states import Kind, State
from hkv_service.specs import default_spec
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessConfig, InProcessSystem
from workers.pool import HandleBatch
from workers.ports import ItemResult, Outcome

BLOCKS = 16  # 1,024 tokens of the reference spec


def counted(system: InProcessSystem, w: Any) -> tuple[DataPlane, Counter[str]]:
    """The system's data plane, its shards' ports and its own counting into one Counter."""
    calls: Counter[str] = Counter()
    for link in system.links.values():
        link.shard.meta = port = w.CountingPort(link.shard.meta)
        port.calls = calls
    plane = DataPlane(w.CountingPort(system.meta), system.links)
    plane.meta.calls = calls
    return plane, calls


@pytest.fixture(params=[1, 2], ids=["1-shard", "2-shards"])
def system(request: pytest.FixtureRequest, data_dir: Path) -> Iterator[InProcessSystem]:
    # heartbeats far apart: the count is of the write's calls only
    system = InProcessSystem(default_spec(), data_dir, InProcessConfig(
        shards=request.param, heartbeat_interval_s=3600.0))
    yield system
    system.close()


@pytest.fixture(params=[1, 2], ids=["1-shard", "2-shards"])
def shard_claims(request: pytest.FixtureRequest, data_dir: Path) -> Iterator[InProcessSystem]:
    """As ``system``, with every claim made by the shard (``ShardConfig.worker_claims``
    off): the tests that make the shard refuse a claim or a finish."""
    system = InProcessSystem(default_spec(), data_dir, InProcessConfig(
        shards=request.param, heartbeat_interval_s=3600.0, worker_claims=False))
    yield system
    system.close()


@pytest.fixture(params=[1, 2], ids=["1-shard", "2-shards"])
def restartable(request: pytest.FixtureRequest,
                inprocess: Callable[..., InProcessSystem]) -> InProcessSystem:
    """Shards heartbeating as usual: they notice a restarted service and re-confirm."""
    return inprocess(shards=request.param)


def test_a_16_block_write_takes_at_most_3_metadata_calls(system: InProcessSystem,
                                                         w: Any) -> None:
    plane, calls = counted(system, w)
    hashes = w.prompt(BLOCKS, seed=19)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=19)
    report = plane.write_prefix(hashes, blocks, tails, owner=ShardId("shard-0"))
    assert report.ok, report.failed
    assert report.written == len(blocks) + len(tails) > 60
    assert calls == {"allocate": 1, "transition_many": 1}, calls
    match = plane.meta.lookup(LookupRequest(hashes))
    assert match.usable_tokens == BLOCKS * plane.layout.hash_block  # all of it committed


def test_spread_over_shards_it_is_still_one_commit(system: InProcessSystem, w: Any) -> None:
    plane, calls = counted(system, w)
    hashes = w.prompt(BLOCKS, seed=20)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=20)
    report = plane.write_prefix(hashes, blocks, tails)  # no owner: blocks go where free
    assert report.ok, report.failed
    assert {h.shard for h in report.handles.values()} == set(system.links)  # every shard
    assert calls == {"allocate": 1, "transition_many": 1}, calls
    match = plane.meta.lookup(LookupRequest(hashes))
    assert match.usable_tokens == BLOCKS * plane.layout.hash_block
    _same_bytes(plane, hashes, blocks, match.usable_tokens)


def test_every_shard_records_the_tags_of_what_landed(restartable: InProcessSystem,
                                                     w: Any) -> None:
    """The tags go to the shards after the commit: a restarted service gets it all back."""
    system = restartable
    plane = system.dataplane()
    hashes = w.prompt(BLOCKS, seed=24)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=24)
    report = plane.write_prefix(hashes, blocks, tails)
    assert report.ok, report.failed
    objects = system.meta.state.object_count()
    system.restart_service()
    assert system.meta.state.object_count() == objects
    usable = BLOCKS * plane.layout.hash_block
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == usable
    _same_bytes(plane, hashes, blocks, usable)


class _BeforeCommit:
    """A metadata port that runs ``hook`` right before forwarding a ``transition_many``
    (while the bytes are in and no commit has landed)."""

    def __init__(self, inner: Any, hook: Callable[[], None]) -> None:
        self.inner, self.hook = inner, hook

    def transition_many(self, items: Any) -> Any:
        self.hook()
        return self.inner.transition_many(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _noting(allocate: Callable[..., Any], slot: tuple[int, str],
            into: list[int]) -> Callable[..., Any]:
    """``allocate``, noting the object id each call gives ``slot`` in ``into``."""
    def noted(*args: Any, **kwargs: Any) -> Any:
        allocs = allocate(*args, **kwargs)
        slots = [(r.depth, r.column) for r in args[1]]
        into.append(int(allocs[slots.index(slot)].handle.object_id))
        return allocs
    return noted


def _went_away() -> None:
    raise ConnectionError("the service went away mid-call")


def _same_bytes(plane: DataPlane, hashes: list[bytes], blocks: dict, usable: int) -> None:
    """What the data plane reads back for ``usable`` tokens is exactly the bytes written."""
    match = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert match.usable_tokens == usable
    got = plane.read(match, hashes)
    assert not isinstance(got, Recompute), got
    for col, arrays in got.items():
        depths = plane.layout.needed_depths(plane.layout.by_name[col], usable)
        for d, arr in zip(depths, arrays, strict=True):
            if (d, col) in blocks:
                assert arr.tobytes() == blocks[(d, col)].tobytes(), (d, col)


def _occupied(system: InProcessSystem, handles: Any) -> list[bool]:
    """Whether each handle's block is still claimed by its object at its shard."""
    out = []
    for h in handles:
        pool = system.links[h.shard].shard.pools[h.group]
        out.append(int(pool.object_id[h.block]) == h.object_id)
    return out


def test_a_refused_commit_is_no_hit_and_its_bytes_are_forgotten(restartable: InProcessSystem,
                                                               w: Any) -> None:
    system = restartable
    plane = system.dataplane()
    hashes = w.prompt(BLOCKS, seed=21)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=21)
    lay = plane.layout
    # the first KV of block 5's resume period: evicted while its bytes go in
    victim_slot = min(s for s in blocks if s[0] >= 5 and
                      lay.columns[lay.by_name[s[1]]].kind is Kind.COMPRESSED)
    victims: list[int] = []
    allocate = _noting(system.meta.allocate, victim_slot, victims)

    def evict_victims() -> None:
        for oid in victims:
            system.meta.evict(oid)

    port = _BeforeCommit(system.meta, evict_victims)
    port.allocate = allocate  # type: ignore[attr-defined]
    plane = DataPlane(port, system.links)
    report = plane.write_prefix(hashes, blocks, tails)
    assert victim_slot in report.failed
    indexed = [s for s in report.failed if s != victim_slot]
    for d, col in indexed:  # only the victim's indexers fail with it
        c = lay.columns[lay.by_name[col]]
        assert c.kind is Kind.INDEXER and d == victim_slot[0], (d, col)
        assert lay.columns[c.indexes].name == victim_slot[1]
    victim = report.handles[victim_slot]
    assert _occupied(system, [victim]) == [False]  # the shard forgot its bytes
    fine = [h for s, h in report.handles.items() if s not in report.failed]
    assert all(_occupied(system, fine))
    usable = system.meta.lookup(LookupRequest(hashes)).usable_tokens
    assert usable <= victim_slot[0] * lay.hash_block  # nothing past the hole is a hit
    assert usable > 0
    _same_bytes(plane, hashes, blocks, usable)
    # no tag of the refused commit survives: a restarted service answers what this one did
    system.restart_service()
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == usable
    _same_bytes(plane, hashes, blocks, usable)


def test_a_failed_commit_call_leaves_nothing_behind(restartable: InProcessSystem,
                                                    w: Any) -> None:
    system = restartable
    plane = DataPlane(_BeforeCommit(system.meta, _went_away), system.links)
    hashes = w.prompt(BLOCKS, seed=22)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=22)
    report = plane.write_prefix(hashes, blocks, tails)  # it raises nothing
    assert set(report.failed) == set(blocks) | set(tails)
    assert report.written == 0
    assert "the service went away" in next(iter(report.failed.values())).detail
    assert not any(_occupied(system, report.handles.values()))
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == 0
    system.restart_service()  # nothing vouched for
    assert system.meta.state.object_count() == 0
    assert system.meta.lookup(LookupRequest(hashes)).usable_tokens == 0


def test_a_failed_shard_write_commits_neither_the_block_nor_its_indexers(
        shard_claims: InProcessSystem, w: Any) -> None:
    system = shard_claims
    plane = system.dataplane()
    lay = plane.layout
    hashes = w.prompt(BLOCKS, seed=23)
    blocks, tails = w.prefix_payload(lay, BLOCKS, seed=23)
    kv = min(s for s in blocks if s[0] >= 4 and
             lay.columns[lay.by_name[s[1]]].kind is Kind.COMPRESSED)
    link = system.links["shard-0"]
    real, real_claim = link.shard.write_blocks, link.shard.claim_blocks

    def failed(handles: Any, tags: Any, out: Any) -> Any:
        for i, t in enumerate(tags or []):  # the KV's copy failed on its shard
            if t is not None and (t.depth, handles[i].group) == kv:
                link.shard.pools[kv[1]].forget(handles[i].block, handles[i].object_id)
                out[i] = ItemResult(Outcome.FAILED, "the copy failed")
        return out

    def write_blocks(handles: Any, arrays: Any, tags: Any = None, commits: Any = None,
                     report: bool = True) -> Any:
        return failed(handles, tags, real(handles, arrays, tags, commits, report))

    def claim_blocks(handles: Any, sizes: Any, writer: Any, tags: Any = None,
                     commits: Any = None) -> Any:  # the same write through shared memory:
        # the shard refuses the KV's claim (a granted claim's finish is never refused while
        # its writer lives and the shard keeps its registration: it is posted, not waited for)
        return failed(handles, tags, real_claim(handles, sizes, writer, tags=tags,
                                                commits=commits))

    link.shard.write_blocks = write_blocks  # type: ignore[method-assign]
    link.shard.claim_blocks = claim_blocks  # type: ignore[method-assign]
    report = plane.write_prefix(hashes, blocks, tails, owner=ShardId("shard-0"))
    assert report.failed[kv].detail == "the copy failed"
    for (d, col), why in report.failed.items():
        if (d, col) != kv:
            assert lay.columns[lay.by_name[col]].kind is Kind.INDEXER and d == kv[0]
            assert why.detail == "its compressed KV was not written in this call"
    assert len(report.failed) > 1  # the reference spec indexes its c4 KV
    assert not any(_occupied(system, [report.handles[s] for s in report.failed]))
    for slot in report.failed:  # nothing whose bytes are not there was committed: the
        # fresh objects are given back (EVICT from ALLOCATED), not left holding their slots
        rec = system.meta.state.objects.get(report.handles[slot].object_id)
        assert rec is None, (slot, rec.state)
    usable = system.meta.lookup(LookupRequest(hashes)).usable_tokens
    assert 0 < usable <= kv[0] * lay.hash_block
    _same_bytes(plane, hashes, blocks, usable)



def test_a_refused_finish_leaves_no_ready_object_it_cannot_read(shard_claims: InProcessSystem,
                                                               w: Any) -> None:
    """Through shared memory a write's finish is posted and the commits report before its
    answer is read. A finish the shard refuses (its claim taken from the writer: a shard
    reset) leaves the block claimed, never readable; the settle after the commits finds it
    so: the object must not stay READY (every lookup would hit it and every read recompute)."""
    system = shard_claims
    plane = system.dataplane()
    assert all(getattr(link, "control", None) is not None or link._attached() is not None
               for link in plane.shards.values())
    lay = plane.layout
    hashes = w.prompt(BLOCKS, seed=26)
    blocks, tails = w.prefix_payload(lay, BLOCKS, seed=26)
    kv = min(s for s in blocks if s[0] >= 4 and
             lay.columns[lay.by_name[s[1]]].kind is Kind.COMPRESSED)
    link = system.links["shard-0"]
    real_finish = link.shard.finish_blocks
    refused: list[int] = []

    def finish_blocks(handles: Any, writer: Any, tags: Any = None, commits: Any = None,
                      report: bool = True) -> Any:
        batch = HandleBatch.of(handles)
        keep = [i for i in range(len(batch))
                if (batch[i].group, batch[i].object_id) != (kv[1], victim[0])]
        out = real_finish(batch.take(keep), writer, tags=None, commits=None, report=report)
        refused.extend(i for i in range(len(batch)) if i not in keep)
        answers = iter(out)
        return [next(answers) if i in keep else ItemResult(Outcome.STALE, "claim taken")
                for i in range(len(batch))]

    victim: list[int] = []
    allocate = _noting(system.meta.allocate, kv, victim)

    link.shard.finish_blocks = finish_blocks  # type: ignore[method-assign]
    system.meta.allocate = allocate  # type: ignore[method-assign]
    report = plane.write_prefix(hashes, blocks, tails, owner=ShardId("shard-0"))
    assert refused, "the shared-memory path was not taken: nothing refused"
    assert kv in report.failed and kv not in report.wrote
    rec = system.meta.state.objects.get(report.handles[kv].object_id)
    assert rec is None or rec.state is not State.COMPRESSED_READY, rec.state
    usable = system.meta.lookup(LookupRequest(hashes)).usable_tokens
    assert 0 < usable <= kv[0] * lay.hash_block
    match = system.meta.lookup(LookupRequest(hashes))
    assert not isinstance(plane.read(match, hashes), Recompute)  # a hit reads, no recompute
    _same_bytes(plane, hashes, blocks, usable)


def test_a_write_past_one_commit_chunk_lands_whole(system: InProcessSystem, w: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A request of more objects than one call takes goes in several, in order: the KVs'
    chunks before the indexers' (an indexer's sync in an earlier call than its KV's commit
    would be refused), each object's events all or none."""
    import workers.commits

    monkeypatch.setattr(workers.commits, "COMMIT_CHUNK", 10)
    plane, calls = counted(system, w)
    hashes = w.prompt(BLOCKS, seed=25)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=25)
    report = plane.write_prefix(hashes, blocks, tails)
    assert report.ok, report.failed
    objects = len(blocks) + len(tails)
    assert calls == {"allocate": 1, "transition_many": -(-objects // 10)}, calls
    usable = system.meta.lookup(LookupRequest(hashes)).usable_tokens
    assert usable == BLOCKS * plane.layout.hash_block
    _same_bytes(plane, hashes, blocks, usable)
