"""workers/nodekey.py: a node's disk tiers name themselves, so every hkv up that starts on a
data dir finds the tiers there; nodes sharing a data dir divide them, and get new ones past
that."""

from __future__ import annotations

import os
from pathlib import Path

from workers.nodekey import assign_keys, tier_keys


def _tier(data: Path, name: str, written: float) -> None:
    (data / name).mkdir(parents=True)
    (data / name / "data.mdb").write_bytes(b"")
    os.utime(data / name / "data.mdb", (written, written))


def test_the_tiers_in_a_data_dir_are_found_newest_first(tmp_path: Path) -> None:
    assert tier_keys(str(tmp_path / "missing")) == []
    _tier(tmp_path, "shard-ab12cd34-0", 100.0)
    _tier(tmp_path, "shard-ab12cd34-1", 300.0)  # a key's newest tier counts
    _tier(tmp_path, "shard-4e878306-0", 200.0)  # an older hkv's: named after a Ray node id
    (tmp_path / "shard-notes.txt").write_text("")  # not a directory
    (tmp_path / "other").mkdir()
    (tmp_path / "shard-x-y").mkdir()  # not a tier's name
    assert tier_keys(str(tmp_path)) == ["ab12cd34", "4e878306"]


def test_a_node_takes_the_newest_key_no_other_node_holds() -> None:
    keys = assign_keys([("n1", ["k1", "k2"]), ("n2", ["k1", "k2"]), ("n3", ["k1", "k2"])])
    assert keys["n1"] == "k1" and keys["n2"] == "k2"  # one data dir, two tiers: one each
    assert keys["n3"] not in {"k1", "k2"} and len(keys["n3"]) == 8  # a new one
    again = assign_keys([("n4", ["k1"]), ("n5", [])], taken=["k1"])
    assert again["n4"] != "k1" and again["n5"] != again["n4"]
