"""The service's GC policy (``server/gcpolicy.py``) and a caller that walks the heap itself.
``hkv bench scale`` times one full collection over the unfrozen heap as the baseline of the
policy's bounded ones; the policy's thread froze the heap again in between (every 0.25 s),
and the baseline timed nothing (0.02 ms "full collections" at 100k and 1M objects).
``paused()`` keeps the policy off the heap meanwhile."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from hkv_service.server import gcpolicy


@pytest.fixture
def policy() -> Iterator[gcpolicy.GcStats]:
    stop = threading.Event()
    was = gc.isenabled()
    stats = gcpolicy.install(stop, every_s=0.01)
    yield stats
    stop.set()
    time.sleep(0.05)  # its thread sees the stop
    gc.unfreeze()
    if was:
        gc.enable()


def _until(cond: object, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_paused_keeps_the_policy_off_an_unfrozen_heap(policy: gcpolicy.GcStats) -> None:
    kept = [[i] for i in range(10_000)]
    assert _until(lambda: policy.collections >= 2)  # it runs, and freezes what it finds
    assert gc.get_freeze_count() >= len(kept)
    with gcpolicy.paused():
        gc.unfreeze()
        seen = policy.collections
        time.sleep(0.2)  # twenty of its periods
        assert gc.get_freeze_count() == 0  # nobody froze it behind the caller's back
        assert policy.collections == seen
    assert _until(lambda: gc.get_freeze_count() >= len(kept))  # and then it goes on
