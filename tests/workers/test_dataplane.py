"""DataPlane + shard actors on a real local Ray, against the real gRPC metadata server:
write -> commit -> lookup -> read, stale reads, offload/load, corruption, shard kills.

The shards reach the service over gRPC (``MetadataClient``); the test's own DataPlane uses
the same in-process ``CacheState`` directly (``LocalMetadata``), which also lets the tests
look at states.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from hkv_service.core.api import LookupRequest, StateConfig
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.server.app import ServerConfig, build_service
from hkv_service.specs import default_spec
from workers.dataplane import DataPlane, Recompute
from workers.launcher import SystemConfig, place_shards, shard_actor_class
from workers.local import LocalMetadata
from workers.raylink import ray_links
from workers.shard import ShardConfig
from workers.shm import process_start, writer_alive

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def service() -> Iterator[Any]:
    state = CacheState(default_spec(), StateConfig(heartbeat_timeout_s=30.0))
    svc = build_service(ServerConfig("127.0.0.1", 0), state)
    svc.server.start()
    yield svc
    svc.stop(0)


@pytest.fixture(scope="module")
def endpoint(service: Any) -> str:
    return f"127.0.0.1:{service.port}"


@pytest.fixture(scope="module")
def system(service: Any, endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    cfg = SystemConfig(data_dir=str(tmp_path_factory.mktemp("dp")), blocks_per_group=16,
                       disk_budget_bytes=32 << 20, device="cpu")
    shards = place_shards(cfg, endpoint)
    meta = LocalMetadata(service.state)
    yield DataPlane(meta, ray_links(shards), timeout_s=10.0), shards, meta
    for a in shards.values():
        ray.kill(a, no_restart=True)


def write_and_lookup(dp: DataPlane, w: Any, n: int, seed: int) -> tuple[Any, Any, Any]:
    hashes = w.prompt(n, seed=seed)
    blocks, tails = w.prefix_payload(dp.layout, n, seed)
    report = dp.write_prefix(hashes, blocks, tails)
    assert report.ok, report.failed
    match = dp.meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    return hashes, {**blocks, **{k: v[0] for k, v in tails.items()}}, match


def expected(dp: DataPlane, payload: dict[Any, np.ndarray], column: str,
             depths: list[int]) -> list[bytes]:
    return [payload[(d, column)].tobytes() for d in depths]


def check_bytes(dp: DataPlane, match: Any, out: Any, payload: Any) -> None:
    assert not isinstance(out, Recompute), out
    for column, arrays in out.items():
        depths = list(dp.layout.needed_depths(dp.layout.by_name[column], match.usable_tokens))
        assert [a.tobytes() for a in arrays] == expected(dp, payload, column, depths)


def test_write_commit_lookup_read_round_trip(system: Any, w: Any) -> None:
    dp, _, _ = system
    hashes, payload, match = write_and_lookup(dp, w, 4, seed=1)
    assert match.usable_tokens == 256 and not match.needs_load
    out = dp.read(match, hashes)
    check_bytes(dp, match, out, payload)
    assert set(out) == {"c4", "c128", "swa", "idx", "c4.tail"}  # c128: no overlap, no tail


@pytest.mark.parametrize("same_kv_bytes", [True, False])
def test_write_prefix_resyncs_an_indexer_whose_kv_moved_on(
    system: Any, w: Any, service: Any, same_kv_bytes: bool
) -> None:
    """A KV evicted under a held indexer and written again: with the same bytes its content
    version is unchanged and the indexer is left alone; with other bytes write_prefix replaces
    the indexer (a fresh object: its bytes are never rewritten) synced to the new version, so
    the prefix is a full hit again."""
    dp, _, meta = system
    hashes, payload, match = write_and_lookup(dp, w, 2, seed=40 + same_kv_bytes)
    meta.release_lease(match.lease_id)
    state = service.state
    idx_h, kv_h = match.handles["idx"][1], match.handles["c4"][1]
    idx = state.objects[idx_h.object_id]
    state.holds.pins[idx] = 1  # a reader holds the indexer: the KV goes alone
    try:
        meta.evict(kv_h.object_id)
    finally:
        del state.holds.pins[idx]
    kv_bytes = payload[(1, "c4")] if same_kv_bytes else payload[(1, "c4")][::-1].copy()
    new_idx = np.full_like(payload[(1, "idx")], 9)
    rep = dp.write_prefix(hashes, {(1, "c4"): kv_bytes, (1, "idx"): new_idx})
    assert rep.ok, rep.failed
    kv_version = rep.versions[(1, "c4")]
    now = idx.entry.mem[idx.column]
    assert now is not None and now.state.value == "INDEXER_SYNCED"
    assert now.version == kv_version
    assert (now is idx) == same_kv_bytes  # replaced by a fresh object for other bytes
    again = dp.meta.lookup(LookupRequest(hashes))
    assert again.usable_tokens == 128 and not again.downgrades
    out = dp.read(again, hashes)
    assert not isinstance(out, Recompute)
    want = payload[(1, "idx")] if same_kv_bytes else new_idx  # untouched, or rewritten
    assert out["idx"][1].tobytes() == want.tobytes()


def test_generation_recheck_catches_evict_and_reuse(system: Any, w: Any, service: Any) -> None:
    dp, _, meta = system
    hashes, _, match = write_and_lookup(dp, w, 2, seed=2)
    meta.release_lease(match.lease_id)
    victim = match.handles["c4"][0]
    meta.evict(victim.object_id)
    # Reuse the freed block: allocate on the same shard until it comes back, and write it.
    rewritten = False
    for i in range(40):
        rep = dp.write_prefix(w.prompt(1, seed=1000 + i),
                              {(0, "c4"): np.full(2048, 7, np.uint8)}, owner=victim.shard)
        h = rep.handles[(0, "c4")]
        if h.block == victim.block:
            rewritten = True
            break
    assert rewritten
    out = dp.read(match, hashes, release=False)
    assert isinstance(out, Recompute) and out.reason.value == "STALE_HANDLE"


def test_offload_evict_lookup_load_read(system: Any, w: Any) -> None:
    dp, _, meta = system
    hashes, payload, match = write_and_lookup(dp, w, 2, seed=3)
    meta.release_lease(match.lease_id)
    mem = [h for hs in match.handles.values() for h in hs]
    results = dp.offload(mem, evict_memory=True)
    assert all(r.ok for r in results), results
    again = meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert again.usable_tokens == 128 and again.needs_load
    out = dp.read(again, hashes)
    check_bytes(dp, again, out, payload)


def test_corrupt_disk_entry_marks_corrupt_and_lookup_downgrades(system: Any, w: Any,
                                                                  service: Any) -> None:
    dp, shards, meta = system
    hashes, payload, match = write_and_lookup(dp, w, 2, seed=4)
    meta.release_lease(match.lease_id)
    c4, idx = match.handles["c4"][0], match.handles["idx"][0]
    assert all(r.ok for r in dp.offload([c4, idx], evict_memory=True))  # KV goes with index
    data_dir = Path(ray.get(shards[c4.shard].stats.remote())["data_dir"])
    needle = payload[(0, "c4")][200:232].tobytes()
    raw = (data_dir / "data.mdb").read_bytes()
    assert raw.count(needle) == 1
    with (data_dir / "data.mdb").open("r+b") as f:
        f.seek(raw.index(needle))
        f.write(bytes([needle[0] ^ 0x10]))
    m = meta.lookup(LookupRequest(hashes, lease_ttl_s=5.0))
    assert m.needs_load
    out = dp.read(m, hashes)
    assert isinstance(out, Recompute) and out.reason.value == "CORRUPT"
    assert meta.lookup(LookupRequest(hashes)).usable_tokens == 0  # c4 at depth 0 is gone
    assert ray.get(shards[c4.shard].stats.remote())["disk"]["quarantined"] >= 1


def _spare_shard(endpoint: str, data_dir: Path, sid: str, max_restarts: int) -> Any:
    cls = shard_actor_class(max_restarts=max_restarts)
    cfg = ShardConfig(sid, endpoint, str(data_dir), 16, 8 << 20, heartbeat_interval_s=0.5,
                      device="cpu")
    actor = cls.options(name=sid, namespace="hkv-test").remote(cfg)
    ray.get(actor.ping.remote(), timeout=60)
    return actor


@pytest.mark.parametrize("restart", [False, True])
def test_killed_shard_objects_lost_and_lookup_downgrades(service: Any, endpoint: str,
                                                         tmp_path: Path, w: Any,
                                                         restart: bool) -> None:
    sid = f"victim-{int(restart)}"
    actor = _spare_shard(endpoint, tmp_path, sid, max_restarts=1 if restart else 0)
    meta = LocalMetadata(service.state)
    dp = DataPlane(meta, ray_links({sid: actor}), timeout_s=5.0)
    hashes, _, match = write_and_lookup_on(dp, w, sid, seed=10 + restart)
    first = ray.get(actor.ping.remote())
    ray.kill(actor, no_restart=not restart)
    if restart:  # wait for the new incarnation: re-registered, and empty
        info = _await_restart(actor, first["incarnation"])
        assert ray.get(actor.stats.remote())["counts"].get("writes", 0) == 0
        assert info["pid"] != first["pid"]
    else:  # ray.kill returns before the process is gone: a read racing it still got bytes
        _await_death(actor)
        # Ray reports the actor dead ~50 ms before its process exits; a read through the
        # shared segment meanwhile gets the objects' own bytes (checked, and never changed)
        _await_exit(first["pid"])
    out = dp.read(match, hashes)  # fails cleanly as recompute, never old bytes
    assert isinstance(out, Recompute)
    # no restart: the dead shard is marked lost; restart: the shard came back empty, so the
    # handle is stale (and its objects were marked lost when it re-registered).
    assert out.reason.value == ("STALE_HANDLE" if restart else "OWNER_LOST")
    assert meta.lookup(LookupRequest(hashes)).usable_tokens == 0
    ray.kill(actor, no_restart=True)


def _await_death(actor: Any) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("killed shard still answers after 60 s")


def _await_exit(pid: int) -> None:
    """Until every thread of ``pid`` is gone (its main thread turns zombie earlier)."""
    deadline = time.monotonic() + 60
    while writer_alive((pid, process_start(pid) or 0)):
        assert time.monotonic() < deadline, f"killed shard process {pid} still runs after 60 s"
        time.sleep(0.02)


def _await_restart(actor: Any, incarnation: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            info: dict[str, Any] = ray.get(actor.ping.remote(), timeout=10)
            if info["incarnation"] > incarnation:
                return info
        except Exception:
            pass
        time.sleep(0.2)
    raise AssertionError("shard did not restart within 60 s")


def write_and_lookup_on(dp: DataPlane, w: Any, sid: str, seed: int) -> tuple[Any, Any, Any]:
    hashes = w.prompt(2, seed=seed)
    blocks, tails = w.prefix_payload(dp.layout, 2, seed)
    assert dp.write_prefix(hashes, blocks, tails, owner=ShardId(sid)).ok
    match = dp.meta.lookup(LookupRequest(hashes))
    assert match.usable_tokens == 128
    return hashes, None, match


def test_inflight_call_to_killed_shard_fails_within_deadline(service: Any, endpoint: str,
                                                             tmp_path: Path, w: Any) -> None:
    sid = "victim-inflight"
    actor = _spare_shard(endpoint, tmp_path, sid, max_restarts=0)
    meta = LocalMetadata(service.state)
    # the link's deadline: a read through shared memory does not call the shard at all
    dp = DataPlane(meta, ray_links({sid: actor}), timeout_s=3.0, shared_memory=False)
    hashes, _, match = write_and_lookup_on(dp, w, sid, seed=20)
    actor.__ray_call__.remote(lambda self: time.sleep(30))  # occupy the shard
    start = time.monotonic()
    import threading

    threading.Timer(0.5, lambda: ray.kill(actor, no_restart=True)).start()
    out = dp.read(match, hashes)
    assert isinstance(out, Recompute) and out.reason.value == "OWNER_LOST"
    assert time.monotonic() - start < 3.0 + 2.0



@pytest.mark.parametrize("what", ["short block", "long block", "empty block", "padded tail",
                                  "short SWA range"])
def test_write_prefix_refuses_a_wrong_size_before_allocating(system: Any, w: Any,
                                                              what: str) -> None:
    """Regression (issue 15, item 1): a block of any other size than its object's is refused
    with WrongSize naming the slot and both sizes, and nothing is allocated or readable."""
    from hkv_service.core.errors import WrongSize

    dp, _, meta = system
    hashes = w.prompt(2, seed=40 + len(what))
    blocks, tails = w.prefix_payload(dp.layout, 2, 3)
    swa = None
    if what == "short block":
        blocks[(1, "c4")] = blocks[(1, "c4")][:16]
    elif what == "long block":
        blocks[(1, "c128")] = np.concatenate([blocks[(1, "c128")], blocks[(1, "c128")]])
    elif what == "empty block":
        blocks[(0, "idx")] = blocks[(0, "idx")][:0]
    elif what == "padded tail":
        arr, n = tails[(1, "c4.tail")]
        tails[(1, "c4.tail")] = (np.concatenate([arr, arr]), n)
    else:
        swa = {(1, "swa"): (64 + 16, 128)}  # 48 tokens, but the whole block's bytes given
    before = len(meta.state.objects)
    with pytest.raises(WrongSize, match="exactly"):
        dp.write_prefix(hashes, blocks, tails, swa_ranges=swa)
    assert len(meta.state.objects) == before
    assert meta.lookup(LookupRequest(hashes)).usable_tokens == 0


def test_the_metadata_actor_reports_many_transitions_in_one_call(w: Any) -> None:
    """ActorMetadata.transition_many: a refused item comes back as a value, its fields intact
    through Ray's pickling; the unary transition's raised error reads them as well."""
    from hkv_service.core.api import AllocRequest, ObjectTransitions, TransitionResult
    from hkv_service.core.errors import IllegalTransition
    from hkv_service.core.states import Event, State
    from hkv_service.testing import pools_for

    meta = w.metadata()
    meta.register_owner(ShardId("s0"), pools_for(meta_layout(), 8))
    allocs = meta.allocate(w.prompt(2, seed=77), [AllocRequest(0, "c4"), AllocRequest(1, "c4")],
                           ShardId("s0"))
    bad, good = (a.handle.object_id for a in allocs)
    refused, done = meta.transition_many([
        ObjectTransitions(bad, (Event.WRITE_DONE, Event.TAIL_DONE)),
        ObjectTransitions(good, (Event.WRITE_DONE,)),
    ])
    assert isinstance(refused, IllegalTransition)
    assert (refused.state, refused.event, refused.index) == (State.COMPRESSED_READY,
                                                             Event.TAIL_DONE, 1)
    assert isinstance(done, TransitionResult) and done.state is State.COMPRESSED_READY
    with pytest.raises(IllegalTransition) as info:
        meta.transition(good, Event.TAIL_DONE)
    assert (info.value.state, info.value.precondition) == (State.COMPRESSED_READY, None)
    ray.kill(meta.actor)


def meta_layout() -> Any:
    from hkv_service.core.layout import Layout

    return Layout(default_spec())


def test_a_sigkilled_ray_shard_is_never_read_through_its_old_segment(
        service: Any, endpoint: str, tmp_path: Path, w: Any) -> None:
    """A real shard actor on this node: the worker writes and reads through its shared
    segment (no read reaches the actor); SIGKILLed and restarted by Ray, the old match is a
    recompute, and this worker no longer maps the dead shard's segment (the kernel frees it)."""
    sid = "victim-shm"
    actor = _spare_shard(endpoint, tmp_path, sid, max_restarts=1)
    meta = LocalMetadata(service.state)
    dp = DataPlane(meta, ray_links({sid: actor}), timeout_s=5.0)
    hashes, _, match = write_and_lookup_on(dp, w, sid, seed=30)
    assert not isinstance(dp.read(match, hashes, release=False), Recompute)
    before = ray.get(actor.stats.remote())["counts"]
    assert before.get("claims", 0) > 0 and before.get("reads", 0) == 0  # the bytes went by
    old = dp.shards[sid].mapped  # type: ignore[attr-defined]
    assert old is not None
    first = ray.get(actor.ping.remote())
    os.kill(first["pid"], signal.SIGKILL)
    _await_exit(first["pid"])
    out = dp.read(match, hashes)
    assert isinstance(out, Recompute), "a dead shard's segment was read"
    with open("/proc/self/maps") as f:
        assert not any(str(old.inode) in line.split() for line in f if "hkv-pool" in line)
    _await_restart(actor, first["incarnation"])
    ray.kill(actor, no_restart=True)
