"""A service restart while another fault crashes a shard (the demo's two workers inject faults
at once): ``InProcessSystem.restart_service`` waits for the shards that were alive to rejoin
the fresh view, and must not wait for one that crashed meanwhile, or was crashed and revived
(a new incarnation: its successor registers with whichever view is there). Found by
``hkv bench e2e --quick`` in a fresh-clone CI: "shards did not rejoin the restarted metadata
view" aborted the demo."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from workers.inprocess import InProcessSystem


def test_a_restart_does_not_wait_for_a_shard_that_crashed_meanwhile(
        inprocess: Callable[..., InProcessSystem], monkeypatch: pytest.MonkeyPatch) -> None:
    system = inprocess(shards=2)
    part = system.parts[0]
    swap = part.swap

    def swap_then_crash(state: Any) -> None:
        swap(state)
        system.kill_shard("shard-1")

    monkeypatch.setattr(part, "swap", swap_then_crash)
    system.restart_service(timeout_s=5.0)  # returned, not TimeoutError / ShardUnavailable
    assert system.restarts == 1
