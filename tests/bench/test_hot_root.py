"""The service bench's ``hot_root`` section at its quick size: the JSON shape, the split's
answers equal to whole chains', and the hot root's objects and lookup work spread over the
partitions (shares counted, not timed: the lookup-time share compares partitions of one
run; no rate is asserted)."""

from __future__ import annotations

import json
import math

from hkv_service.bench import hot_root


def test_a_split_hot_root_spreads_and_answers_as_whole_chains_do() -> None:
    section = hot_root.run(quick=True)
    assert json.loads(json.dumps(section)) == section
    assert set(section["by_count"]) == {"2"}
    fig = section["by_count"]["2"]
    whole = fig["whole"]
    assert whole["hottest_objects_share"] == 1.0  # every chain in the root's partition
    assert whole["rounds_per_lookup"] == 1.0
    for split in (fig["split"], fig["split_long"]):  # 16-block ranges, and memoised 32-block
        assert split["usable_tokens_equal"] == 1.0
        assert split["hottest_objects_share"] < 0.9  # ranges elsewhere hold the rest
        assert split["rounds_per_lookup"] >= 1.0
    for key, value in section["ratios"].items():
        assert math.isfinite(value) and value > 0, key
