"""workers/link.py: the in-process shard link's crash and revive."""

from __future__ import annotations

from typing import Any


def test_crashing_a_crashed_shard_again_is_harmless(inprocess: Any) -> None:
    """Regression: the demo's two workers could both crash one shard before its revive (seen
    under host load 20: ``test_all_ten_faults_land_at_the_default_request_count[3]``); the
    second kill raised RuntimeError (its call thread was shut down) out of the worker."""
    system = inprocess(shards=1, blocks_per_group=4)
    system.crash_shard("shard-0")
    system.crash_shard("shard-0")
    assert system.revive_shard("shard-0") > 0
