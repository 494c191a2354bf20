"""workers/shard.py in-process (no Ray): write/commit/read, stale reads, offload/load, corrupt
disk records, restart re-registration, idempotent commits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkv_service.core.api import AllocRequest, LookupRequest, StateConfig
from hkv_service.core.errors import UnknownOwner
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from workers.local import LocalMetadata
from workers.ports import Commit, ItemResult, Outcome
from workers.shard import REGISTER_ATTEMPTS, ShardActor, ShardConfig
from workers.tags import BlockTag


def make_shard(meta: LocalMetadata, data_dir: Path, sid: str = "s0", **kw: Any) -> ShardActor:
    cfg = ShardConfig(sid, meta, str(data_dir), blocks_per_group=8, disk_budget_bytes=8 << 20,
                      heartbeat_interval_s=60.0, device="cpu", **kw)
    return ShardActor(cfg)


def write_c4(shard: ShardActor, meta: LocalMetadata, hashes: list[BlockHash], depth: int,
             data: np.ndarray) -> Any:
    alloc = meta.allocate(hashes, [AllocRequest(depth, "c4")], ShardId(shard.shard_id))[0]
    tag = BlockTag(hashes[depth], hashes[depth - 1] if depth else None, depth)
    [res] = shard.write_blocks([alloc.handle], [data], [tag], [Commit((Event.WRITE_DONE,))])
    assert res.ok, res
    return alloc.handle


def c4_bytes(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 2048, dtype=np.uint8)


def test_write_commit_read(meta: LocalMetadata, data_dir: Path, w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(2)
    data = c4_bytes(1)
    h = write_c4(shard, meta, hashes, 0, data)
    assert meta.state.objects[h.object_id].state is State.COMPRESSED_READY
    assert meta.state.objects[h.object_id].version > 0
    [out] = shard.read_blocks([h])
    assert isinstance(out, np.ndarray) and np.array_equal(out, data)
    shard.shutdown()


def test_evicted_and_reused_block_reads_stale(meta: LocalMetadata, data_dir: Path,
                                              w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=1)
    old = write_c4(shard, meta, hashes, 0, c4_bytes(1))
    meta.evict(old.object_id)
    for i in range(8):  # reuse every block, so the old one is rewritten too
        write_c4(shard, meta, w.prompt(1, seed=100 + i), 0, c4_bytes(100 + i))
    [res] = shard.read_blocks([old])
    assert isinstance(res, ItemResult) and res.outcome is Outcome.STALE
    assert "stale" in res.detail
    shard.shutdown()


def test_retried_commit_is_idempotent(meta: LocalMetadata, data_dir: Path, w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=2)
    alloc = meta.allocate(hashes, [AllocRequest(0, "c4")], ShardId("s0"))[0]
    commit = Commit((Event.WRITE_DONE,))
    first = shard.write_blocks([alloc.handle], [c4_bytes(3)], None, [commit])[0]
    again = shard.write_blocks([alloc.handle], [c4_bytes(3)], None, [commit])[0]
    assert first.ok and again.ok  # the repeat is recognised as already applied
    rec = meta.state.objects[alloc.handle.object_id]
    assert rec.seq == 1 and rec.version == first.version  # one transition applied, not two
    shard.shutdown()


def write_batch(shard: ShardActor, meta: LocalMetadata, w: Any, n: int,
                commits: list[Commit]) -> tuple[list[Any], list[ItemResult]]:
    """One write_blocks call of ``n`` c4 objects (depths 0..n-1), ``commits[i]`` for each."""
    hashes = w.prompt(n, seed=40 + n)
    allocs = meta.allocate(hashes, [AllocRequest(d, "c4") for d in range(n)], ShardId("s0"))
    handles = [a.handle for a in allocs]
    tags = [BlockTag(hashes[d], hashes[d - 1] if d else None, d) for d in range(n)]
    return handles, shard.write_blocks(handles, [c4_bytes(d) for d in range(n)], tags, commits)


@pytest.mark.parametrize("n, chunk, calls", [
    (6, None, 1),  # a batch: every commit in one call
    (5, 2, 3),  # a large batch: in calls of COMMIT_CHUNK items (the lock is held per call)
])
def test_a_batch_is_committed_in_one_call_per_chunk(meta: LocalMetadata, data_dir: Path, w: Any,
                                                    monkeypatch: Any, n: int, chunk: int | None,
                                                    calls: int) -> None:
    import workers.commits

    if chunk is not None:
        monkeypatch.setattr(workers.commits, "COMMIT_CHUNK", chunk)
    shard = make_shard(meta, data_dir)
    shard.meta = counting = w.CountingPort(shard.meta)
    handles, out = write_batch(shard, meta, w, n, [Commit((Event.WRITE_DONE,))] * n)
    assert all(r.ok and r.version for r in out), out
    assert counting.calls == {"transition_many": calls}
    assert {meta.state.objects[h.object_id].state for h in handles} == {State.COMPRESSED_READY}
    shard.shutdown()


def test_a_refused_commit_fails_its_item_alone_and_whole(meta: LocalMetadata, data_dir: Path,
                                                         w: Any) -> None:
    shard = make_shard(meta, data_dir)
    ok, bad = Commit((Event.WRITE_DONE,)), Commit((Event.WRITE_DONE, Event.TAIL_DONE))
    handles, out = write_batch(shard, meta, w, 3, [ok, bad, ok])
    assert [r.outcome for r in out] == [Outcome.OK, Outcome.NOT_READABLE, Outcome.OK]
    assert "TAIL_DONE is not allowed" in out[1].detail
    refused = meta.state.objects[handles[1].object_id]
    assert refused.state is State.ALLOCATED and refused.seq == 0  # its WRITE_DONE not applied
    [read] = shard.read_blocks([handles[1]])  # the bytes were forgotten
    assert isinstance(read, ItemResult) and read.outcome is Outcome.STALE
    shard.shutdown()


def test_an_event_already_applied_counts_as_done(meta: LocalMetadata, data_dir: Path,
                                                 w: Any) -> None:
    """As reported one by one: an event refused because its object is already in the event's
    target state is skipped, the item's other events apply (here the first two)."""
    shard = make_shard(meta, data_dir)
    twice = Commit((Event.BEGIN_WRITE, Event.WRITE_DONE, Event.WRITE_DONE))
    shard.meta = counting = w.CountingPort(shard.meta)
    handles, out = write_batch(shard, meta, w, 2, [twice, Commit((Event.WRITE_DONE,))])
    assert all(r.ok for r in out), out
    assert [meta.state.objects[h.object_id].seq for h in handles] == [2, 1]
    assert counting.calls == {"transition_many": 2}  # the item without its repeat, once more
    again = shard.write_blocks(handles, [c4_bytes(d) for d in range(2)], None,
                               [Commit((Event.WRITE_DONE,))] * 2)  # the whole call re-run
    assert all(r.ok for r in again), again
    assert [meta.state.objects[h.object_id].seq for h in handles] == [2, 1]
    shard.shutdown()


def test_offload_evict_load_round_trip(meta: LocalMetadata, data_dir: Path, w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=3)
    data = c4_bytes(4)
    h = write_c4(shard, meta, hashes, 0, data)
    [off] = shard.offload([h], evict_memory=True)
    assert off.ok, off
    assert off.handle is not None
    disk_rec = meta.state.objects[off.handle.object_id]
    assert disk_rec.state is State.ON_DISK and h.object_id not in meta.state.objects
    [ld] = shard.load([(off.handle, hashes[0])])
    assert ld.ok and ld.handle is not None, ld
    assert meta.state.objects[off.handle.object_id].state is State.ON_DISK_READY
    out = shard.read_blocks([ld.handle])[0]
    assert isinstance(out, np.ndarray) and np.array_equal(out, data)
    shard.shutdown()


def test_corrupt_disk_record_is_marked_and_never_served(meta: LocalMetadata, data_dir: Path,
                                                        w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=4)
    data = c4_bytes(5)
    h = write_c4(shard, meta, hashes, 0, data)
    [off] = shard.offload([h], evict_memory=True)
    assert off.ok and off.handle is not None
    shard.shutdown()
    flip_payload_byte(data_dir / "s0" / "data.mdb", data)
    shard = make_shard(meta, data_dir)  # the restart re-confirms... and the flip is caught
    assert shard.confirmed == 0
    assert meta.lookup(LookupRequest(hashes, 64)).usable_tokens == 0
    shard.shutdown()


def test_corrupt_record_caught_on_load(meta: LocalMetadata, data_dir: Path, w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=5)
    data = c4_bytes(6)
    h = write_c4(shard, meta, hashes, 0, data)
    [off] = shard.offload([h], evict_memory=True)
    assert off.ok and off.handle is not None
    flip_payload_byte(data_dir / "s0" / "data.mdb", data)
    [ld] = shard.load([(off.handle, hashes[0])])
    assert ld.outcome is Outcome.CORRUPT
    assert off.handle.object_id not in meta.state.objects  # CORRUPT is terminal: detached
    assert shard.stats()["disk"]["quarantined"] == 1
    shard.shutdown()


def test_restart_comes_back_empty_and_reconfirms_disk(meta: LocalMetadata, data_dir: Path,
                                                      w: Any) -> None:
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(2, seed=6)
    kept = write_c4(shard, meta, hashes, 0, c4_bytes(7))
    [off] = shard.offload([kept])
    assert off.ok
    mem_only = write_c4(shard, meta, hashes, 1, c4_bytes(8))
    shard.shutdown()
    shard = make_shard(meta, data_dir)  # what a Ray restart does: __init__ again
    assert shard.confirmed == 1
    assert mem_only.object_id not in meta.state.objects  # LOST, detached
    entry = meta.state.index[hashes[0]]
    assert entry.mem[0] is None and entry.disk is not None
    assert entry.disk[0] is not None and entry.disk[0].state is State.ON_DISK
    assert isinstance(shard.read_blocks([mem_only])[0], ItemResult)
    shard.shutdown()


class LossReportRacesRegistration(LocalMetadata):
    """The data plane's report that the previous incarnation died (it names the owner, not
    the incarnation) arriving just after the new incarnation registered: ``losses`` times."""

    def __init__(self, state: CacheState, losses: int) -> None:
        super().__init__(state)
        self.losses = losses
        self.registrations = 0

    def register_owner(self, owner: ShardId, pools: Any, instance: int = 0) -> int:
        incarnation = super().register_owner(owner, pools, instance)
        self.registrations += 1
        if self.losses:
            self.losses -= 1
            self.mark_owner_lost(owner)
        return incarnation


def _one_disk_object(state: CacheState, data_dir: Path, w: Any) -> list[BlockHash]:
    """A shard that wrote and offloaded one block, then stopped."""
    shard = make_shard(LocalMetadata(state), data_dir)
    hashes: list[BlockHash] = w.prompt(1, seed=60)
    kept = write_c4(shard, LocalMetadata(state), hashes, 0, c4_bytes(60))
    [off] = shard.offload([kept])
    assert off.ok
    shard.shutdown()
    return hashes


def test_a_loss_report_racing_the_restart_does_not_kill_the_successor(data_dir: Path,
                                                                     w: Any) -> None:
    """Found by the system fault campaign: a restarted shard's confirms met UnknownOwner (a
    late loss report had ended its new incarnation), its __init__ raised, and Ray never
    restarts an actor whose constructor failed: the shard was gone for good."""
    state = CacheState(default_spec(), StateConfig())
    hashes = _one_disk_object(state, data_dir, w)
    racing = LossReportRacesRegistration(state, losses=2)
    shard = make_shard(racing, data_dir)  # what a Ray restart does: __init__ again
    assert racing.registrations == 3  # lost twice, registered again each time
    assert shard.confirmed == 1  # its disk object vouched for by the current incarnation
    racing.heartbeat(ShardId("s0"), shard.incarnation)  # current: no UnknownOwner
    entry = state.index[hashes[0]]
    assert entry.disk is not None and entry.disk[0] is not None
    assert entry.disk[0].state is State.ON_DISK
    shard.shutdown()


def test_a_shard_declared_lost_at_every_registration_gives_up_with_a_clear_error(
        data_dir: Path, w: Any) -> None:
    state = CacheState(default_spec(), StateConfig())
    _one_disk_object(state, data_dir, w)  # something to confirm, which the loss refuses
    racing = LossReportRacesRegistration(state, losses=10**6)
    with pytest.raises(UnknownOwner, match="declared lost during each of its"):
        make_shard(racing, data_dir)
    assert racing.registrations == REGISTER_ATTEMPTS  # bounded: no endless loop


def test_admission_refusal_is_reported(data_dir: Path, w: Any) -> None:
    from hkv_service.core.api import AdmissionCap

    meta = LocalMetadata(CacheState(default_spec(), StateConfig(AdmissionCap(1, 1 << 20))))
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(2, seed=7)
    a = write_c4(shard, meta, hashes, 0, c4_bytes(9))
    b = write_c4(shard, meta, hashes, 1, c4_bytes(10))
    meta.begin_offload(a.object_id, ShardId("s0"))  # holds the only ticket
    [res] = shard.offload([b])
    assert res.outcome is Outcome.ADMISSION
    shard.shutdown()


def flip_payload_byte(path: Path, data: np.ndarray) -> None:
    raw = path.read_bytes()
    needle = data[100:132].tobytes()
    assert raw.count(needle) == 1
    off = raw.index(needle)
    with path.open("r+b") as f:
        f.seek(off)
        f.write(bytes([raw[off] ^ 0x01]))


def test_the_same_disk_copy_loads_and_fails_again_and_again(meta: LocalMetadata,
                                                            data_dir: Path, w: Any) -> None:
    """Regression: the shard once memoised (object, event) commits, so a second LOAD_VERIFIED
    or LOAD_FAILED for one disk object was swallowed and the object stayed ON_DISK_INFLIGHT
    forever, holding an admission ticket."""
    shard = make_shard(meta, data_dir)
    hashes = w.prompt(1, seed=8)
    data = c4_bytes(9)
    [off] = shard.offload([write_c4(shard, meta, hashes, 0, data)], evict_memory=True)
    assert off.ok and off.handle is not None
    disk = off.handle.object_id
    for _ in range(3):  # load, drop the memory copy, load again
        [ld] = shard.load([(off.handle, hashes[0])])
        assert ld.ok and ld.handle is not None, ld
        assert meta.state.objects[disk].state is State.ON_DISK_READY
        assert np.array_equal(shard.read_blocks([ld.handle])[0], data)
        meta.state.transition(disk, Event.DROP_COPY)
    for _ in range(2):  # a load that fails twice: both failures must land
        meta.state.begin_load(disk, ShardId("s0"))
        assert shard._commit(disk, Event.LOAD_FAILED).ok
        assert meta.state.objects[disk].state is State.ON_DISK
    assert meta.state.admission.stats().in_transit_objects == 0
    shard.shutdown()


def test_a_load_batch_with_one_corrupt_record(meta: LocalMetadata, data_dir: Path,
                                              w: Any) -> None:
    """More items than one chunk; one record flipped on disk. The batch read sets the corrupt
    one aside (quarantined, CORRUPT, its object detached) and every other item loads."""
    from workers.shard import LOAD_CHUNK

    n = LOAD_CHUNK + 3
    shard = ShardActor(ShardConfig("s0", meta, str(data_dir), blocks_per_group=2 * n,
                                   disk_budget_bytes=8 << 20, heartbeat_interval_s=60.0,
                                   device="cpu"))
    hashes = w.prompt(n, seed=40)
    datas = [c4_bytes(400 + d) for d in range(n)]
    handles = [write_c4(shard, meta, hashes, d, datas[d]) for d in range(n)]
    offs = shard.offload(handles, evict_memory=True)
    assert all(o.ok and o.handle is not None for o in offs), offs
    victim = LOAD_CHUNK // 2
    flip_payload_byte(data_dir / "s0" / "data.mdb", datas[victim])
    loads = shard.load([(o.handle, hashes[d]) for d, o in enumerate(offs)])  # type: ignore[misc]
    assert [ld.outcome for ld in loads] == [
        Outcome.CORRUPT if d == victim else Outcome.OK for d in range(n)]
    for d, ld in enumerate(loads):
        if d != victim:
            assert ld.handle is not None
            assert np.array_equal(shard.read_blocks([ld.handle])[0], datas[d])
    assert offs[victim].handle is not None
    assert offs[victim].handle.object_id not in meta.state.objects
    assert shard.stats()["disk"]["quarantined"] == 1
    assert meta.state.admission.stats().in_transit_objects == 0
    shard.shutdown()


def test_loads_under_a_one_object_cap_go_one_at_a_time(data_dir: Path, w: Any) -> None:
    """A cap of one object in transit: chunks shrink to one item, so a multi-item load is
    never refused by its own earlier items."""
    from hkv_service.core.api import AdmissionCap

    meta = LocalMetadata(CacheState(default_spec(), StateConfig(AdmissionCap(1, 1 << 20))))
    shard = make_shard(meta, data_dir, admission=AdmissionCap(1, 1 << 20))
    hashes = w.prompt(3, seed=50)
    datas = [c4_bytes(500 + d) for d in range(3)]
    offs = [shard.offload([write_c4(shard, meta, hashes, d, datas[d])], evict_memory=True)[0]
            for d in range(3)]
    assert all(o.ok and o.handle is not None for o in offs), offs
    loads = shard.load([(o.handle, hashes[d]) for d, o in enumerate(offs)])  # type: ignore[misc]
    assert [ld.outcome for ld in loads] == [Outcome.OK] * 3, loads
    shard.shutdown()
