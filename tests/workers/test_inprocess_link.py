"""The in-process link behaves as a shard process does when it is crashed.

Found by the demo's fault test with two workers: both readers met the same shard and both
injected its crash; the second crash raised (the call thread was already shut down) and
aborted the demo. A dead process cannot die again: crashing it twice is a no-op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from workers.inprocess import InProcessSystem
from workers.link import ShardUnavailable

SHARD = "shard-0"


@pytest.fixture
def system(inprocess: Callable[..., InProcessSystem]) -> InProcessSystem:
    return inprocess(shards=1)


def test_crashing_a_crashed_shard_again_is_a_no_op(system: InProcessSystem) -> None:
    system.crash_shard(SHARD)
    system.crash_shard(SHARD)  # raised RuntimeError before the fix
    with pytest.raises(ShardUnavailable):
        system.links[SHARD].submit("ping").result(5.0)
    assert system.revive_shard(SHARD) >= 1
    assert system.links[SHARD].submit("ping").result(5.0) is not None


def test_two_threads_crash_the_same_shard_at_once(system: InProcessSystem) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def crash() -> None:
        start.wait()
        try:
            system.crash_shard(SHARD)
        except BaseException as exc:  # the test reports whatever escaped
            errors.append(exc)

    threads = [threading.Thread(target=crash) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert not system.links[SHARD].alive
