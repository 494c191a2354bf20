"""Two Ray nodes on this machine (ray.cluster_utils.Cluster): one shard per node by node
affinity, and a read from a Ray task scheduled on the node that does not hold the bytes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import xxhash
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hkv_service.core.api import LookupRequest
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.server.app import ServerConfig, build_service
from hkv_service.specs import default_spec
from workers.dataplane import DataPlane
from workers.launcher import SystemConfig, node_keys, place_shards
from workers.local import LocalMetadata
from workers.raylink import ray_links


@pytest.fixture(scope="module")
def cluster(w: Any) -> Iterator[Cluster]:
    w.clear_stale_ray()
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()  # type: ignore[no-untyped-call]


@ray.remote(num_cpus=0)
def read_remote(endpoint: str, shards: dict[str, Any], hashes: list[BlockHash]) -> dict[str, Any]:
    from hkv_service.client import MetadataClient

    with MetadataClient(endpoint) as meta:
        dp = DataPlane(meta, ray_links(shards), timeout_s=20.0)
        match = meta.lookup(LookupRequest(hashes, lease_ttl_s=10.0))
        out = dp.read(match, hashes)
    assert isinstance(out, dict), out
    return {"node": ray.get_runtime_context().get_node_id(),
            "digests": {c: [xxhash.xxh3_64_hexdigest(a.tobytes()) for a in arrays]
                        for c, arrays in out.items()}}


def test_one_shard_per_node_and_cross_node_read(cluster: Cluster, tmp_path: Path,
                                                w: Any) -> None:
    state = CacheState(default_spec())
    svc = build_service(ServerConfig("127.0.0.1", 0), state)
    svc.server.start()
    endpoint = f"127.0.0.1:{svc.port}"
    try:
        cfg = SystemConfig(data_dir=str(tmp_path), blocks_per_group=8,
                           disk_budget_bytes=8 << 20, device="cpu")
        shards = place_shards(cfg, endpoint)
        nodes = {ray.get(a.ping.remote())["node_id"]: sid for sid, a in shards.items()}
        assert len(shards) == 2 and len(nodes) == 2  # one shard on each node
        # The nodes share one data dir: each gets a disk tier of its own, and placed again
        # (a restarted hkv up: new node ids) they divide the same two tiers between them.
        keys = {sid.split("-")[1] for sid in shards}
        assert len(keys) == 2 and {p.name for p in tmp_path.iterdir()} == set(shards)
        alive = [n for n in ray.nodes() if n["Alive"]]
        assert set(node_keys(alive, str(tmp_path), 60.0).values()) == keys
        holder = sorted(shards)[0]
        dp = DataPlane(LocalMetadata(state), ray_links(shards))
        hashes = w.prompt(2, seed=7)
        blocks, tails = w.prefix_payload(dp.layout, 2, 7)
        assert dp.write_prefix(hashes, blocks, tails, owner=ShardId(holder)).ok
        other = next(n for n, sid in nodes.items() if sid != holder)
        task = read_remote.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False))
        res = ray.get(task.remote(endpoint, shards, hashes), timeout=120)
        assert res["node"] == other
        want = {**blocks, **{k: v[0] for k, v in tails.items()}}
        assert res["digests"]["c4"] == [xxhash.xxh3_64_hexdigest(want[(d, "c4")].tobytes())
                                        for d in (0, 1)]
        assert res["digests"]["c4.tail"] == [
            xxhash.xxh3_64_hexdigest(want[(1, "c4.tail")].tobytes())]
        for a in shards.values():
            ray.kill(a, no_restart=True)
    finally:
        svc.stop(0)


def test_nodes_joining_later_get_shards_and_head_is_left_out(cluster: Cluster,
                                                             tmp_path: Path) -> None:
    """On a real cluster (``--address``) a worker that joins after start-up gets a shard on
    the next reconcile, and the head keeps none once workers exist."""
    from workers.launcher import System, reconcile_shards

    state = CacheState(default_spec())
    svc = build_service(ServerConfig("127.0.0.1", 0), state)
    svc.server.start()
    cfg = SystemConfig(address=cluster.address, data_dir=str(tmp_path), blocks_per_group=8,
                       disk_budget_bytes=8 << 20, device="cpu")
    system = System(cfg, f"127.0.0.1:{svc.port}")
    node = None
    try:
        system.shards = place_shards(cfg, system.endpoint, keys=system.node_keys)
        assert len(system.shards) == 1  # the one worker; the head runs the service
        node = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        said: list[str] = []
        deadline = time.monotonic() + 60  # hkv up reconciles every 5 s: within a few rounds
        while len(system.shards) < 2 and time.monotonic() < deadline:
            reconcile_shards(system, said.append)
            if len(system.shards) < 2:
                time.sleep(2.0)
        assert len(system.shards) == 2 and said, said
        reconcile_shards(system, said.append)  # idempotent: nothing new to place
        assert len(system.shards) == 2
    finally:
        for a in system.shards.values():
            ray.kill(a, no_restart=True)
        if node is not None:
            cluster.remove_node(node)
        svc.stop(0)
