"""The data plane's loss reports name the handles of the call that failed (witnesses).

Found by the system fault campaign: Ray reports a crashed call's failure only once the
restarted shard is up, so the report used to reach the service after the successor had
registered, and ended it (its confirms refused, its disk objects forgotten). Here the same
order is forced in process: the failed call's answer is read after the successor started.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from hkv_service.core.api import LookupRequest
from hkv_service.core.errors import HkvError
from hkv_service.core.ids import ShardId
from workers.dataplane import DataPlane, Recompute
from workers.inprocess import InProcessSystem
from workers.link import Pending
from workers.shard import ShardActor

SHARD = "shard-0"


@pytest.fixture
def system(inprocess: Callable[..., InProcessSystem]) -> InProcessSystem:
    return inprocess(shards=1)


def _written(plane: DataPlane, w: Any, seed: int = 0) -> list[bytes]:
    hashes: list[bytes] = w.prompt(4, seed=seed)
    blocks, tails = w.prefix_payload(plane.layout, 4, seed=seed)
    assert plane.write_prefix(hashes, blocks, tails).ok
    return hashes


def _successor_starts_before_the_failure_is_read(system: InProcessSystem,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard crashes; the next call to it fails, and its successor is up (registered,
    its disk re-confirmed) by the time the data plane reads that failure."""
    link = system.links[SHARD]
    system.crash_shard(SHARD)
    submit = link.submit

    def submit_then_restart(method: str, *args: Any, **kwargs: Any) -> Pending:
        failed = submit(method, *args, **kwargs)
        monkeypatch.setattr(link, "submit", submit)
        system.revive_shard(SHARD)
        return failed

    monkeypatch.setattr(link, "submit", submit_then_restart)


def _owner_alive(system: InProcessSystem) -> bool:
    return bool(system.parts[0].state.owners[ShardId(SHARD)].alive)


def test_a_read_failure_reported_after_the_restart_does_not_end_the_successor(
        system: InProcessSystem, w: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # a read through the link (a worker on another node): through the shared segment a read
    # calls no shard, and a dead shard's segment is let go of before the call that fails here
    plane = DataPlane(system.meta, system.links, shared_memory=False)
    hashes = _written(plane, w)
    m = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert m.usable_tokens > 0
    _successor_starts_before_the_failure_is_read(system, monkeypatch)
    assert isinstance(plane.read(m, hashes), Recompute)  # the crash still costs the read
    assert _owner_alive(system)  # ... and nothing more: the successor stays registered
    system.meta.heartbeat(ShardId(SHARD), system.incarnation(SHARD))  # current
    events = system.parts[0].state.stats()["events"]
    assert events["stale_loss_report"] == 1  # type: ignore[index]
    assert _written(plane, w, seed=1)  # and takes writes at once


def test_a_load_failure_reported_after_the_restart_keeps_the_reconfirmed_disk(
        system: InProcessSystem, w: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    plane = system.dataplane()
    hashes = _written(plane, w)
    m = plane.meta.lookup(LookupRequest(hashes))  # no lease: it would pin memory copies
    handles = [h for hs in m.handles.values() for h in hs]
    assert all(r.ok for r in plane.offload(handles, evict_memory=True))
    at_rest = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert at_rest.load  # served from disk: a load first
    _successor_starts_before_the_failure_is_read(system, monkeypatch)
    got = plane.start_load(at_rest, hashes).wait()
    assert isinstance(got, Recompute)
    assert _owner_alive(system)
    confirmed = system.links[SHARD].shard.confirmed
    assert confirmed > 0  # the successor vouched for its disk records ...
    again = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert again.usable_tokens == m.usable_tokens and again.load  # ... and they still count
    assert not isinstance(plane.start_load(again, hashes).wait(), Recompute)


def test_a_failure_of_the_current_incarnation_is_declared(system: InProcessSystem, w: Any
                                                          ) -> None:
    plane = system.dataplane()
    hashes = _written(plane, w)
    m = plane.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    system.crash_shard(SHARD)  # no successor (yet): its objects must stop being hits now
    assert isinstance(plane.read(m, hashes), Recompute)
    assert not _owner_alive(system)
    assert plane.meta.lookup(LookupRequest(hashes)).usable_tokens == 0


def test_a_real_loss_is_declared_though_its_witnesses_were_evicted(
        system: InProcessSystem, w: Any) -> None:
    """Regression (issue 35, item 4): judged by witnesses alone, a shard that died with every
    handle of the failed call evicted meanwhile stayed alive in the view (its other chains
    hits) until its heartbeat expired. The report names the process the call went to."""
    plane = system.dataplane()
    hashes = _written(plane, w)
    other = _written(plane, w, seed=2)
    m = plane.meta.lookup(LookupRequest(hashes))  # no lease: its objects may go
    for h in (h for hs in m.handles.values() for h in hs):
        with contextlib.suppress(HkvError):  # (an indexer went with its KV)
            system.meta.evict(h.object_id)
    system.crash_shard(SHARD)  # dead, no successor
    assert isinstance(plane.read(m, hashes), Recompute)
    assert not _owner_alive(system)
    assert plane.meta.lookup(LookupRequest(other)).usable_tokens == 0


def test_a_report_names_the_process_the_call_went_to(system: InProcessSystem, w: Any) -> None:
    link = system.links[SHARD]
    first = link.shard.instance
    system.kill_shard(SHARD)
    assert link.shard.instance not in (0, first)  # a new process, a new instance
    assert system.parts[0].state.owners[ShardId(SHARD)].instance == link.shard.instance


def test_a_write_that_failed_gives_its_fresh_objects_back(
        system: InProcessSystem, w: Any) -> None:
    """A worker whose link still names a dead shard while its successor serves (a replaced
    actor): the write fails, the stale report ends nothing, and the objects allocated on the
    successor go back. Left ALLOCATED, each held its slot as "already there" and no later
    writer wrote it (found by test_replacement once stale reports were ignored)."""
    plane = system.dataplane()
    system.crash_shard(SHARD)
    successor = ShardActor(system.shard_config(SHARD))  # registered; the link names the old
    try:
        hashes = w.prompt(4, seed=5)
        blocks, tails = w.prefix_payload(plane.layout, 4, seed=5)
        assert not plane.write_prefix(hashes, blocks, tails).ok
        assert _owner_alive(system)
        state = system.parts[0].state
        assert all(not any(e.mem) for e in (state.index.get(h) for h in hashes) if e)
        system.links[SHARD].revive(successor)
        assert plane.write_prefix(hashes, blocks, tails).ok
        assert plane.meta.lookup(LookupRequest(hashes)).usable_tokens == 256
    except BaseException:
        successor.shutdown()
        raise
