"""The shipped shard and data plane over metadata partitions (issue 19): prompts spread over
the partitions by root, one partition restarted alone is rebuilt from the owners' re-confirm
of what is its own, and the others keep serving the same objects (same ids, same bytes)
while it is down and after.

The adversary's cases: a shard resetting every block when only one partition forgot it (the
other partitions' objects would read STALE, or worse their blocks be handed out twice); a
re-confirm sent to the wrong partition (its chains would never be hits again); a lookup on
the restarted partition answering before the shard vouched again (nothing unconfirmed is a
hit)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hkv_service.core.api import LookupRequest, StateConfig
from hkv_service.core.partitions import Partition, partition_of_id, partition_of_root
from hkv_service.core.state_view import CacheState
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessSystem
from workers.partitioned import PartitionedMetadata

BLOCKS = 6
PARTS = 2


def _prompts(w: Any, want: int) -> dict[int, list[list[bytes]]]:
    """``want`` prompts rooted in each partition."""
    out: dict[int, list[list[bytes]]] = {i: [] for i in range(PARTS)}
    seed = 0
    while min(len(v) for v in out.values()) < want:
        hashes = w.prompt(BLOCKS, seed=seed)
        seed += 1
        bucket = out[partition_of_root(hashes[0], PARTS)]
        if len(bucket) < want:
            bucket.append(hashes)
    return out


def _write(plane: DataPlane, w: Any, hashes: list[bytes], seed: int) -> None:
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=seed)
    report = plane.write_prefix(hashes, blocks, tails)
    assert report.ok, report.failed


def _read(plane: DataPlane, hashes: list[bytes]) -> tuple[int, dict[str, list[bytes]], set[int]]:
    m = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    got = plane.read(m, hashes)
    assert not isinstance(got, Recompute), got
    ids = {int(i) for col in m.columns.values() for i in col.array["object_id"]}
    return m.usable_tokens, {c: [a.tobytes() for a in arrays] for c, arrays in got.items()}, ids


@pytest.fixture
def system(inprocess: Callable[..., InProcessSystem]) -> InProcessSystem:
    return inprocess(shards=2, partitions=PARTS)


def test_prompts_spread_and_each_lives_in_its_roots_partition(system: InProcessSystem,
                                                              w: Any) -> None:
    plane = system.dataplane()
    prompts = _prompts(w, 2)
    for i, chains in prompts.items():
        for k, hashes in enumerate(chains):
            _write(plane, w, hashes, seed=10 * i + k)
            usable, _, ids = _read(plane, hashes)
            assert usable > 0
            assert {partition_of_id(oid, PARTS) for oid in ids} == {i}
    counts = [p.state.object_count() for p in system.parts]
    assert all(c > 0 for c in counts), counts
    assert isinstance(system.meta, PartitionedMetadata)
    assert system.meta.stats()["gauges"]["objects"] == sum(counts)  # type: ignore[index]


def test_one_partition_restarted_alone_is_rebuilt_and_the_other_keeps_serving(
        system: InProcessSystem, w: Any) -> None:
    plane = system.dataplane()
    prompts = _prompts(w, 2)
    before = {}
    for i, chains in prompts.items():
        for k, hashes in enumerate(chains):
            _write(plane, w, hashes, seed=10 * i + k)
            before[(i, k)] = _read(plane, hashes)
    kept_state = system.parts[0].state
    held = system.parts[1].state.object_count()
    rejoins = {sid: link.shard._counts.get("rejoins", 0) for sid, link in system.links.items()}

    system.restart_service(partition=1)

    assert system.parts[0].state is kept_state  # partition 0 was not touched
    for (i, k), (usable, data, ids) in before.items():
        again_usable, again_data, again_ids = _read(plane, prompts[i][k])
        assert again_usable == usable, (i, k)
        assert again_data == data, (i, k)  # the very bytes written, through either path
        if i == 0:
            assert again_ids == ids  # the same objects: nothing was re-created
        else:
            assert again_ids.isdisjoint(ids)  # re-confirmed: new ids in the new view
    for sid, link in system.links.items():
        assert link.shard._counts.get("rejoins", 0) == rejoins[sid] + 1
    assert system.parts[1].state.object_count() == held  # every object of it came back


def test_nothing_of_the_restarted_partition_is_a_hit_before_it_is_vouched_for(
        system: InProcessSystem, w: Any) -> None:
    """Between the restart and the shards' rejoin the fresh partition knows nothing: its
    prompts miss (recompute), they are never served from blocks it did not take back."""
    plane = system.dataplane()
    prompts = _prompts(w, 1)
    for i, chains in prompts.items():
        _write(plane, w, chains[0], seed=i)
    for link in system.links.values():  # hold the heartbeats: no rejoin yet
        link.shard._stop.set()
        link.shard._beat.join(5.0)
    system.parts[1].swap(CacheState(system.spec, StateConfig(partition=Partition(1, PARTS))))
    m = plane.meta.lookup(LookupRequest(prompts[1][0]))
    assert m.usable_tokens == 0
    usable0, _, _ = _read(plane, prompts[0][0])
    assert usable0 > 0
    # a write into the restarted partition before the rejoin is refused, not misplaced
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=99)
    report = plane.write_prefix(prompts[1][0], blocks, tails)
    assert not report.ok
    assert system.parts[1].state.object_count() == 0


def test_disk_records_go_back_to_their_roots_partition(system: InProcessSystem, w: Any) -> None:
    """Every shard restarts (its memory gone): it vouches for its disk tier, and each record
    must reach the partition of its chain (the route key in its tag), or that chain's disk
    copies are never hits again."""
    plane = system.dataplane()
    prompts = _prompts(w, 1)
    before = {}
    for i, chains in prompts.items():
        _write(plane, w, chains[0], seed=i)
        before[i] = _read(plane, chains[0])
        m = plane.meta.lookup(LookupRequest(chains[0]))
        handles = [h for hs in m.handles.values() for h in hs]
        assert all(r.ok for r in plane.offload(handles, evict_memory=True))
    for sid in list(system.links):
        system.kill_shard(sid)
    for i, chains in prompts.items():
        m = plane.meta.lookup(LookupRequest(chains[0]))
        assert m.usable_tokens == before[i][0] and m.needs_load, (i, m)
        usable, data, _ = _read(plane, chains[0])
        assert (usable, data) == before[i][:2], i
    assert all(p.state.object_count() > 0 for p in system.parts)
