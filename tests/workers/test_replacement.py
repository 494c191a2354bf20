"""A shard that dies for good (its Ray restarts used up) is replaced by ``hkv up``'s reconcile
(issue 17, item 4): a new actor of the same name on the same node, a new incarnation that
starts cold, registered with the service, and reported."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hkv_service.core.api import LookupRequest
from hkv_service.server.serve import OWNER_HEALTH_PREFIX
from workers.dataplane import Recompute
from workers.launcher import SystemConfig, dead_shards, reconcile_shards, start_system

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _await_health(endpoint: str, service: str, want: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        got = None
        while time.monotonic() < deadline:
            try:
                got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            except grpc.RpcError:
                got = None
            if got == want:
                return
            time.sleep(0.2)
    raise AssertionError(f"health of {service}: {got}, not {want}")


def test_a_shard_dead_for_good_is_replaced_and_reported(tmp_path: Path, w: Any,
                                                        clock: Any) -> None:
    w.clear_stale_ray()
    config = SystemConfig(port=0, data_dir=str(tmp_path / "hkv-data"), blocks_per_group=16,
                          disk_budget_bytes=16 << 20, max_restarts=0, device="cpu",
                          heartbeat_timeout_s=4.0, shard_replacements=1, restart_window_s=60.0)
    said: list[str] = []
    system = start_system(config, said.append)
    system.clock = clock  # the replacement budget's: stepped by the test
    try:
        (sid, actor), = system.shards.items()
        first = ray.get(actor.ping.remote(), timeout=30)
        dp = system.dataplane()
        hashes = w.prompt(4, seed=3)
        blocks, tails = w.prefix_payload(dp.layout, 4, seed=3)
        assert dp.write_prefix(hashes, blocks, tails).ok
        assert dead_shards(system) == []  # alive: nothing to replace
        health = OWNER_HEALTH_PREFIX + sid
        _await_health(system.endpoint, health, SERVING)

        ray.kill(actor, no_restart=True)  # dead for good, as after its last restart
        deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
        while dead_shards(system) != [sid] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dead_shards(system) == [sid]
        _await_health(system.endpoint, health, NOT_SERVING)  # silent past its timeout: lost
        assert system.metadata().stats()["gauges"]["owners_lost"] == 1
        reconcile_shards(system, said.append)
        _await_health(system.endpoint, health, SERVING)

        assert sid in system.shards and system.replaced == {sid: 1}
        assert any("died for good" in m and sid in m for m in said), said
        now = ray.get(system.shards[sid].ping.remote(), timeout=30)
        assert now["pid"] != first["pid"] and now["node_id"] == first["node_id"]
        meta = system.metadata()
        assert meta.stats()["gauges"]["owners_alive"] == 1
        # it started cold: the old memory objects are gone, not served
        match = meta.lookup(LookupRequest(hashes, lease_ttl_s=0.0))
        assert match.usable_tokens == 0
        # and it serves writes and reads again, also to a worker attached before the
        # replacement (issue 35, item 5: its links named the dead actor, every call failed
        # and reported the new shard lost, for as long as the worker ran)
        owner = system.metadata()
        lost_before = owner.stats()["events"].get("owner_lost", 0)
        deadline = time.monotonic() + 10
        while not dp.write_prefix(hashes, blocks, tails).ok:
            assert time.monotonic() < deadline, "the old worker never reached the new shard"
            time.sleep(0.2)
        assert meta.lookup(LookupRequest(hashes)).usable_tokens == 256
        got = dp.read(meta.lookup(LookupRequest(hashes, lease_ttl_s=10.0)), hashes)
        assert not isinstance(got, Recompute), got
        assert owner.stats()["events"].get("owner_lost", 0) == lost_before
        assert owner.stats()["gauges"]["owners_alive"] == 1
        owner.close()
        meta.close()

        # Dead for good again within the window (--shard-replacements 1): a crash loop. It is
        # not replaced, said once, and its node gets no other shard, until the window has room.
        _kill_for_good(system, sid)
        said.clear()
        reconcile_shards(system, said.append)
        reconcile_shards(system, said.append)
        assert system.replaced == {sid: 1} and sid in dead_shards(system)
        assert len([m for m in said if "crash loop" in m and sid in m]) == 1, said
        assert not any("placed" in m for m in said), said
        clock.advance(60.0)
        reconcile_shards(system, said.append)
        assert system.replaced == {sid: 2} and dead_shards(system) == []
        _await_health(system.endpoint, health, SERVING)
    finally:
        system.stop()


def _kill_for_good(system: Any, sid: str) -> None:
    ray.kill(system.shards[sid], no_restart=True)
    deadline = time.monotonic() + 30  # ray.kill returns before the actor is gone
    while dead_shards(system) != [sid] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert dead_shards(system) == [sid]
