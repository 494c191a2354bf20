"""A request's write in a few metadata calls: one allocate, then one ``transition_many`` per
shard per phase of ``DataPlane.write_prefix`` (A: KV, SWA and tail blocks; B: indexers synced
to A's versions), never one call per event. In process (no Ray): the real data plane, shards
and state behind ``LocalMetadata``, every port wrapped in a counting proxy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hkv_service.core.funnel import LookupRequest
from hkv_service.core.ids import ShardId
from hkv_service.specs import default_spec
from workers.dataplane import DataPlane
from workers.inprocess import InProcessConfig, InProcessSystem

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


def test_a_16_block_write_takes_at_most_3_metadata_calls(system: InProcessSystem,
                                                         w: Any) -> None:
    plane, calls = counted(system, w)
    hashes = w.prompt(BLOCKS, seed=19)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=19)
    report = plane.write_prefix(hashes, blocks, tails, owner=ShardId("shard-0"))
    assert report.ok, report.failed
    assert report.written == len(blocks) + len(tails) > 60
    assert calls == {"allocate": 1, "transition_many": 2}, calls
    match = plane.meta.lookup(LookupRequest(hashes))
    assert match.usable_tokens == BLOCKS * plane.layout.hash_block  # all of it committed


def test_spread_over_shards_it_is_one_commit_per_shard_and_phase(system: InProcessSystem,
                                                                 w: Any) -> None:
    plane, calls = counted(system, w)
    hashes = w.prompt(BLOCKS, seed=20)
    blocks, tails = w.prefix_payload(plane.layout, BLOCKS, seed=20)
    report = plane.write_prefix(hashes, blocks, tails)  # no owner: blocks go where free
    assert report.ok, report.failed
    shards = {h.shard for h in report.handles.values()}
    assert calls["allocate"] == 1 and "transition" not in calls
    assert calls["transition_many"] <= 2 * len(shards), calls

