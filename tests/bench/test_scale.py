"""The scale bench's quick path at a tiny size: the JSON shape, and figures that are sane
numbers. No timing is asserted (the machine is shared and noisy)."""

from __future__ import annotations

import json
import math

from hkv_service.bench import scale

SIZES = (1500, 3000)


def test_quick_path_at_a_tiny_size_reports_every_figure() -> None:
    result = scale.run(quick=True, sizes=SIZES, doc_blocks=64, window_s=0.4, write_requests=4,
                       reconfirm_budget_s=2.0, dataplane_requests=2)
    assert json.loads(json.dumps(result)) == result  # plain JSON, no NaN
    assert set(result) == {"name", "quick", "figures", "baseline", "ratios"}
    assert result["name"] == "scale" and result["quick"] is True
    figures, ratios = result["figures"], result["ratios"]
    for n in SIZES:
        tag = scale.label(n)
        assert figures[f"objects_{tag}"] >= n
        assert 0.05 < figures[f"disk_fraction_{tag}"] < 0.2  # ~9% disk copies
        for key in ("bytes_per_object", "rss_mib", "full_gc_ms", "fill_objects_per_s",
                    "lookup1_p50_ms", "lookup1_p99_ms", "lookup1_max_ms", "lookup2048_p50_ms",
                    "lookup2048_p99_ms", "lookup2048_max_ms", "longest_pause_ms",
                    "write_objects_per_s", "owner_loss_hold_ms", "reconfirm_reports_per_s"):
            value = figures[f"{key}_{tag}"]
            assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
        assert figures[f"lookup1_p50_ms_{tag}"] <= figures[f"lookup1_max_ms_{tag}"]
        assert figures[f"lookup2048_matched_blocks_{tag}"] == 64  # the document, whole
        assert figures[f"write_objects_per_request_{tag}"] == 64  # 16 blocks, 4 objects each
        assert figures[f"healthy_owners_expired_{tag}"] == 0
        assert figures[f"owners_alive_after_{tag}"] == 6  # 8, less the two lost for good
        assert figures[f"reconfirm_complete_{tag}"] == 1.0
        assert figures[f"reconfirm_in_place_complete_{tag}"] == 1.0  # the same reports, twice
        for scene in ("", "in_place_"):
            rate = figures[f"reconfirm_{scene}with_summaries_reports_per_s_{tag}"]
            assert 0 < rate <= figures[f"reconfirm_{scene}reports_per_s_{tag}"]
        assert figures[f"reconfirm_confirmed_{tag}"] == figures[f"reconfirm_reports_total_{tag}"]
        assert figures[f"reconfirm_restarts_{tag}"] == 1  # --quick: one restart
        assert figures[f"lookup_errors_{tag}"] == 0
    assert figures["write_rpcs_per_request"] >= 1  # one allocate at least
    assert figures["write_rpcs_allocate_per_request"] == 1
    assert figures["dataplane_objects_per_request"] == 64
    for key, value in figures.items():
        if key.startswith("target_"):
            assert value == scale.TARGETS[key]
        if key.endswith("_met"):
            assert isinstance(value, bool)
    small, big = (scale.label(n) for n in SIZES)
    assert result["baseline"][f"rss_mib_{small}"] == figures[f"rss_mib_{small}"]
    assert math.isclose(ratios[f"rss_mib_{big}_vs_{small}"],
                        figures[f"rss_mib_{big}"] / figures[f"rss_mib_{small}"])
    assert all(math.isfinite(v) and v > 0 for v in ratios.values())


def test_the_median_restart_is_given_with_the_slowest_and_fastest() -> None:
    rate = scale.RESTART_RATE
    runs = [{rate: 90.0, "reconfirm_settle_ms": 3.0}, {rate: 130.0, "reconfirm_settle_ms": 1.0},
            {rate: 110.0, "reconfirm_settle_ms": 2.0}]
    out = scale.median_restart(runs)
    assert out[rate] == 110.0 and out["reconfirm_settle_ms"] == 2.0  # one run's figures, whole
    assert (out[f"{rate}_min"], out[f"{rate}_max"], out["reconfirm_restarts"]) == (90, 130, 3)
    assert scale.median_restart(runs[:1])[rate] == 90.0
