"""The demo on the real system: `hkv serve` subprocess + local Ray shard actors + LMDB tiers.

Reused state must give exactly the logits of a full recompute (zero silent errors), every one
of the ten faults is injected through the real components and ends in its reason, on two
seeds, and close() leaves no process it started behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hkv_service.demo import wiring
from hkv_service.demo.faults import DEFAULT_RATES
from hkv_service.demo.run import run_workload
from hkv_service.demo.wiring import SystemWiring
from workers.launcher import clear_stale_ray

pytest.importorskip("ray")

RATES = {**DEFAULT_RATES, "evict_race": 0.3, "shard_kill": 0.1, "service_restart": 0.1,
         "partial_tail": 1.0, "stale_indexer": 0.6, "disk_bitflip": 0.4, "abi_mismatch": 0.2}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def system_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path
               ) -> Iterator[list[SystemWiring]]:
    """Select the system wiring, run it in tmp_path, and keep the instances it builds."""
    import ray

    if ray.is_initialized():  # another module's Ray: the wiring must own its instance
        ray.shutdown()
    clear_stale_ray()
    monkeypatch.chdir(tmp_path)
    built: list[SystemWiring] = []
    real_init = SystemWiring.__init__

    def init(self: SystemWiring, *args: Any, **kwargs: Any) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(wiring.SystemWiring, "__init__", init)
    yield built
    for b in built:
        b.close()
    if ray.is_initialized():
        ray.shutdown()


def _assert_clean(built: list[SystemWiring]) -> None:
    assert len(built) == 1
    b = built[0]
    assert b.pids, "no pids recorded"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in b.pids):
        time.sleep(0.2)
    assert [p for p in b.pids if _alive(p)] == []
    assert not (Path.cwd() / "hkv-data").exists()  # shard dirs of this run removed


def test_demo_on_system_backend_reuses_catches_evict_race_and_stops_cleanly(
        system_run: list[SystemWiring]) -> None:
    rep = run_workload(requests=10, seed=1, faults={"evict_race": 0.6}, check=True, workers=2,
                       backend="system")
    assert rep["backend"] == "system", rep
    assert rep["checked"] == rep["requests"] == 10
    assert rep["silent_errors"] == 0
    assert rep["reused_tokens"] > 0
    assert rep["faults_injected"].get("evict_race", 0) > 0, rep["faults_injected"]
    assert rep["fallbacks"].get("STALE_HANDLE", 0) > 0  # the shard's generation re-check
    assert rep["transitions"]["COMPRESSED"]["COMPRESSED_READY"] > 0
    assert rep["transitions"]["DISK"]["ON_DISK"] > 0  # write-through to the LMDB tiers
    _assert_clean(system_run)


@pytest.mark.parametrize("seed", [6, 7])
def test_all_ten_faults_on_the_system_no_silent_errors(system_run: list[SystemWiring],
                                                        seed: int) -> None:
    rep = run_workload(requests=120, seed=seed, faults=RATES, check=True, workers=1,
                       backend="system")
    assert rep["backend"] == "system", rep
    assert rep["checked"] == rep["requests"] == 120
    assert rep["silent_errors"] == 0
    assert rep["service_restarts"] > 0  # `hkv serve` was killed and started again
    for name in DEFAULT_RATES:
        if name != "pool_pressure":
            assert rep["faults_injected"].get(name, 0) > 0, (name, rep["faults_injected"])
        assert rep["faults_expected"][name]["seen"] > 0, (name, rep["faults_expected"])
    assert rep["reused_tokens"] > 0
    _assert_clean(system_run)
