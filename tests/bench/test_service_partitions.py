"""The service bench's ``partitions`` section at a tiny size: the JSON shape, rates that are
numbers above zero, the ratio keys, and lookups and objects really spread over the
partitions (each partition's own stats). No timing is asserted (the machine is shared and
noisy); every process the bench started is gone after it."""

from __future__ import annotations

import json
import math
import multiprocessing
from typing import Any

import pytest

from hkv_service.bench import partitions, service

TINY = partitions.Sizes(counts=(1, 2), lookups=200, writes=8, client_processes=2, threads=2,
                        rounds=1, compare_threads=True)
RATES = ("lookups_per_s", "write_objects_per_s", "write_prompts_per_s")
CPU = ("lookups_client_cpu_cores", "lookups_server_cpu_cores",
       "write_objects_client_cpu_cores", "write_objects_server_cpu_cores")


_BEFORE: set[Any] = set()  # child processes alive before the bench ran (other tests')


@pytest.fixture(scope="module")
def section() -> dict[str, Any]:
    _BEFORE.update(multiprocessing.active_children())
    return partitions.run(sizes=TINY)


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_every_count_reports_its_rates_and_ratios(section: dict[str, Any]) -> None:
    assert json.loads(json.dumps(section)) == section  # plain JSON, no NaN
    assert section["counts"] == [1, 2] and section["partitions_are"] == "processes"
    assert section["objects_per_prompt"] == 64  # 16 blocks, 4 objects each
    assert section["clients"] == {"processes": 2, "threads_each": 2}
    assert set(section["by_count"]) == {"1", "2"}
    for fig in section["by_count"].values():
        for key in RATES:
            assert _positive(fig[key]), (key, fig[key])
        for key in CPU:
            assert isinstance(fig[key], float) and fig[key] >= 0, (key, fig[key])
    assert set(section["ratios"]) == {"lookups_per_s_2_vs_1", "write_objects_per_s_2_vs_1"}
    assert all(_positive(v) for v in section["ratios"].values())
    assert section["ray"] == {"skipped": "not asked"}
    load = section["loadavg_1m"]
    assert set(load) == {"start", "end", "max"} and load["max"] >= load["start"]


def test_lookups_and_objects_spread_over_the_partitions(section: dict[str, Any]) -> None:
    rounds = TINY.rounds * 2  # both ways of running the clients asked the same partitions
    for n, fig in section["by_count"].items():
        looked, objects = fig["lookups_by_partition"], fig["objects_by_partition"]
        assert len(looked) == len(objects) == int(n)
        assert min(looked) > 0 and min(objects) > 0, (n, looked, objects)
        assert sum(looked) == TINY.lookups * rounds  # each lookup answered by one partition
        assert sum(objects) == 64 * TINY.writes * rounds  # every object of every prompt
    partitions.check_spread(section)  # what the bench itself checks
    with pytest.raises(RuntimeError, match="did not spread"):
        partitions.check_spread({"by_count": {"2": {"lookups_by_partition": [5, 0]}}})


def test_threads_only_comparison(section: dict[str, Any]) -> None:
    threads = section["threads_only"]
    assert threads["clients"] == {"processes": 1, "threads_each": 4}
    for fig in threads["by_count"].values():
        assert all(_positive(fig[key]) for key in RATES)
    assert set(threads["ratios"]) == set(section["ratios"])
    assert set(threads["vs_client_processes"]) == {
        f"{unit}_{n}" for unit in partitions.UNITS for n in ("1", "2")}
    assert all(_positive(v) for v in threads["vs_client_processes"].values())


def test_every_process_it_started_is_gone(section: dict[str, Any]) -> None:
    assert section["by_count"]  # the bench ran in this process
    assert set(multiprocessing.active_children()) <= _BEFORE


def test_the_service_bench_reports_the_headline_flat(section: dict[str, Any]) -> None:
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    service._headline_partitions(section, figures, baseline, ratios)
    assert set(baseline) == {"partitions_lookups_per_s_1", "partitions_write_objects_per_s_1"}
    assert set(figures) == {"partitions_lookups_per_s_2", "partitions_write_objects_per_s_2"}
    assert ratios == {f"partitions_{k}": v for k, v in section["ratios"].items()}
    assert math.isclose(ratios["partitions_lookups_per_s_2_vs_1"],
                        figures["partitions_lookups_per_s_2"]
                        / baseline["partitions_lookups_per_s_1"])


def test_quick_mode_measures_one_and_two_partitions_and_no_ray() -> None:
    assert partitions.QUICK.counts == (1, 2) and partitions.QUICK.ray is None
    assert not partitions.QUICK.compare_threads
    assert partitions.FULL.counts == (1, 2, 4) and partitions.FULL.ray is not None
    with pytest.raises(ValueError, match="must be 1"):
        partitions.run(sizes=partitions.Sizes(counts=(2,), lookups=1, writes=1,
                                               client_processes=1, threads=1, rounds=1))


@pytest.mark.slow
def test_partitions_as_ray_actors_on_two_nodes() -> None:
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    before = set(multiprocessing.active_children())
    tiny = partitions.Sizes(counts=(1, 2), lookups=200, writes=8, client_processes=1,
                            threads=2, rounds=1)
    out = partitions._on_ray(tiny)
    assert not ray.is_initialized()  # shut down again
    assert out["counts"] == [1, 2] and out["partitions_are"] == "ray actors"
    two = out["by_count"]["2"]
    assert len(set(two["nodes_by_partition"])) == 2  # one partition on each node
    assert min(two["lookups_by_partition"]) > 0
    assert set(out["ratios"]) == {"lookups_per_s_2_vs_1", "write_objects_per_s_2_vs_1"}
    assert set(multiprocessing.active_children()) <= before
