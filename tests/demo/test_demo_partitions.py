"""The demo's fault campaign over two metadata partitions (issue 19): the same reference
workload, every fault on, reused state checked against a full recompute, with the view split
across partitions (a service restart restarts both; the transition stream is both merged).
In process on the default run; on the real system (two `hkv serve` processes, Ray shards)
with -m slow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hkv_service.demo.faults import DEFAULT_RATES
from hkv_service.demo.run import run_workload
from hkv_service.demo.wiring import MergedEvents
from workers.launcher import clear_stale_ray

RATES = {**DEFAULT_RATES, "evict_race": 0.3, "shard_kill": 0.1, "service_restart": 0.1,
         "partial_tail": 1.0, "stale_indexer": 0.6, "disk_bitflip": 0.4, "abi_mismatch": 0.2}


def _assert_campaign(rep: dict[str, Any], requests: int, partitions: int = 2) -> None:
    assert rep["partitions"] == partitions
    assert rep["checked"] == rep["requests"] == requests
    assert rep["silent_errors"] == 0
    assert rep["service_restarts"] > 0
    assert rep["reused_tokens"] > 0
    for name in DEFAULT_RATES:
        assert rep["faults_expected"][name]["seen"] > 0, (name, rep["faults_expected"])


def test_every_fault_over_two_partitions_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # (seed 1: at seed 0, since the demo's spec has a recurrent layer, no reader met a
    # misaligned copy before it aged out; seeds 1 and 2 checked)
    rep = run_workload(requests=60, seed=1, faults=RATES, check=True, workers=1, partitions=2,
                       backend="inprocess")
    assert rep["backend"] == "inprocess"
    _assert_campaign(rep, 60)


def test_every_fault_over_chains_split_across_partitions_in_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prompt's chain split every 2 blocks over 3 partitions (a prompt spans ~9
    ranges): writes, lookups (the fixed point over the ranges' partitions), reads, and the
    shards' re-confirm after each service restart all go range by range, and every output
    still equals a full recompute."""
    # (misaligned writes more often: a misaligned range is then looked up before it ages out)
    rates = {**RATES, "misaligned_handle": 0.3}
    # (seed 3: since the demo's spec has a recurrent layer, at seeds 0, 1, 2 and 4 a stale
    # indexer or a misaligned copy aged out before a reader met it; no silent error at any)
    rep = run_workload(requests=60, seed=3, faults=rates, check=True, workers=1, partitions=3,
                       range_blocks=2, backend="inprocess")
    assert rep["backend"] == "inprocess" and rep["range_blocks"] == 2
    _assert_campaign(rep, 60, partitions=3)


@pytest.fixture
def system_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    clear_stale_ray()
    monkeypatch.chdir(tmp_path)
    yield
    if ray.is_initialized():
        ray.shutdown()


# ~2.5 min on 2 cores; the default run has test_launcher.py's partition test on the system
@pytest.mark.slow
def test_every_fault_over_two_partitions_on_the_system(system_env: None) -> None:
    # (seed 3: since the demo's spec has a recurrent layer, at seeds 1 and 2 a misaligned copy
    # or a stale indexer aged out before a reader met it; no silent error at either)
    rep = run_workload(requests=48, seed=3, faults=RATES, check=True, workers=1, partitions=2,
                       range_blocks=4, backend="system")
    assert rep["backend"] == "system", rep
    _assert_campaign(rep, 48)
    assert not (Path.cwd() / "hkv-data").exists()


def test_merged_events_renumber_and_a_reset_starts_over() -> None:
    from hkv_service.core.api import TransitionEvent
    from hkv_service.core.states import Kind, State

    def ev(seq: int, oid: int) -> TransitionEvent:
        return TransitionEvent(seq, oid, Kind.COMPRESSED, State.COMPRESSED_READY, "c4",
                               b"h" * 16, 0.0)

    logs = [[ev(1, 10), ev(2, 11)], [ev(1, 20)]]
    merged = MergedEvents([lambda seq, _t, log=log: [e for e in log if e.seq > seq]
                           for log in logs])
    got = merged.since(0, 0.0)
    assert [e.seq for e in got] == [1, 2, 3] and [e.object_id for e in got] == [10, 11, 20]
    assert merged.since(3, 0.0) == []
    logs[1].append(ev(2, 21))
    assert [e.object_id for e in merged.since(3, 0.0)] == [21]
    merged.reset()
    assert merged.since(4, 0.0) == []  # a cursor from before the reset gets nothing
    assert [e.object_id for e in merged.since(0, 0.0)] == [10, 11, 20, 21]
