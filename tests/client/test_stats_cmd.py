"""``hkv stats``: the pure rate-jump logic, and ``--json`` against a live server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hkv_service.client.stats_cmd import kind_totals, rate_jumps
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import CacheState
from hkv_service.server.app import ServerConfig, build_service
from hkv_service.specs import default_spec
from hkv_service.testing import commit_prefix, pools_for, prompt_hashes

ROOT = Path(__file__).resolve().parents[2]


def _samples(counts: list[dict[str, int]]) -> list[tuple[float, dict[str, int]]]:
    return [(0.5 * i, c) for i, c in enumerate(counts)]


def test_jump_flagged_only_for_the_kind_that_jumped() -> None:
    s = _samples([{"SWA": 0, "TAIL": 0}, {"SWA": 10, "TAIL": 10}, {"SWA": 20, "TAIL": 20},
                  {"SWA": 200, "TAIL": 30}])
    (jump,) = rate_jumps(s)
    assert jump.kind == "SWA" and jump.rate_per_s == 360.0 and jump.mean_per_s == 20.0
    assert jump.ratio == 18.0


def test_no_jump_below_factor_or_floor() -> None:
    assert rate_jumps(_samples([{"SWA": 0}, {"SWA": 10}, {"SWA": 20}, {"SWA": 35}])) == []
    assert rate_jumps(_samples([{"SWA": 0}, {"SWA": 0}, {"SWA": 0}, {"SWA": 2}])) == []  # floor
    assert rate_jumps(_samples([{"SWA": 0}, {"SWA": 100}])) == []  # one interval: no history


def test_jump_from_idle_has_infinite_ratio() -> None:
    (jump,) = rate_jumps(_samples([{"DISK": 0}, {"DISK": 0}, {"DISK": 0}, {"DISK": 50}]))
    assert jump.ratio == float("inf")


def test_kind_totals() -> None:
    assert kind_totals({"SWA:SWA_VALID": 3, "SWA:EVICTED": 1, "TAIL:TAIL_COMPLETE": 2}) == {
        "SWA": 4, "TAIL": 2}


def test_stats_json_against_a_live_server() -> None:
    state = CacheState(default_spec())
    state.register_owner(ShardId("s0"), pools_for(state.layout, 64))
    commit_prefix(state, prompt_hashes(state.spec, 4))
    service = build_service(ServerConfig(port=0), state)
    service.server.start()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "hkv_service.cli", "stats", "--endpoint",
             f"127.0.0.1:{service.port}", "--json"],
            capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        service.stop(0).wait(10)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["stats"]["gauges"]["objects"] == len(state.objects)
    assert doc["stats"]["transitions"]["COMPRESSED:COMPRESSED_READY"] == 6
    assert doc["rate_jumps"] == [] and set(doc["rates_per_s"]) >= {"COMPRESSED"}


def test_stats_unreachable_exits_1() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hkv_service.cli", "stats", "--endpoint", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "cannot read stats" in out.stderr


def test_stats_piped_into_head_and_idle_rates(tmp_path: Path) -> None:
    """Regressions (issue 17, item 8): ``hkv stats | head`` printed a BrokenPipeError
    traceback, and an idle service's rate section listed nothing, saying nothing."""
    state = CacheState(default_spec())
    service = build_service(ServerConfig(port=0), state)
    service.server.start()
    cmd = f"{sys.executable} -m hkv_service.cli stats --endpoint 127.0.0.1:{service.port}"
    try:
        # `true` exits at once: every line stats writes meets a closed pipe, as past `head`
        piped = subprocess.run(f"{cmd} | true", shell=True, capture_output=True, text=True,
                               timeout=60, cwd=ROOT)
        whole = subprocess.run(cmd.split(), capture_output=True, text=True, timeout=60,
                               cwd=ROOT)
    finally:
        service.stop(0).wait(10)
    assert piped.stderr == "", piped.stderr
    assert whole.returncode == 0 and "(no transitions: idle)" in whole.stdout


def test_stats_dead_endpoint_is_one_sentence() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hkv_service.cli", "stats", "--endpoint", "127.0.0.1:1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 1 and "no hkv service answers there" in out.stderr
    assert out.stderr.count("\n") == 1


def test_stats_json_over_two_partitions_sums_them_and_keeps_each() -> None:
    """``hkv stats --endpoint A,B`` (the endpoint ``hkv up --service-replicas 2`` prints):
    counters summed, each partition's under ``partitions``, in order."""
    from hkv_service.core.api import StateConfig
    from hkv_service.core.partitions import Partition, partition_of_root

    states = [CacheState(default_spec(), StateConfig(partition=Partition(i, 2)))
              for i in range(2)]
    for st in states:
        st.register_owner(ShardId("s0"), pools_for(st.layout, 64))
    seeds = {partition_of_root(prompt_hashes(states[0].spec, 4, seed=s)[0], 2): s
             for s in range(40)}
    for i, st in enumerate(states):
        commit_prefix(st, prompt_hashes(st.spec, 4, seed=seeds[i]))
    services = [build_service(ServerConfig(port=0), st) for st in states]
    for s in services:
        s.server.start()
    try:
        endpoint = ",".join(f"127.0.0.1:{s.port}" for s in services)
        out = subprocess.run(
            [sys.executable, "-m", "hkv_service.cli", "stats", "--endpoint", endpoint,
             "--json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        for s in services:
            s.stop(0).wait(10)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)["stats"]
    each = [st.object_count() for st in states]
    assert [p["partition"] for p in stats["partitions"]] == ["0/2", "1/2"]
    assert [p["gauges"]["objects"] for p in stats["partitions"]] == each
    assert stats["gauges"]["objects"] == sum(each) > 0
