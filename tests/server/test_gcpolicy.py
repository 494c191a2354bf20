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
from svc_util import hashes, register, start_live

from hkv_service.client import MetadataClient
from hkv_service.core.api import ObjectReport
from hkv_service.core.states import State
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


# ---- the interval follows the pauses ---------------------------------------------------------
# A collection scans what was allocated since the last one: its pause is the allocation rate
# times the interval. A re-confirm rebuilding a 1M-object view at ~100k reports/s made 0.25 s
# of objects a 66-90 ms pause; the interval halves while pauses run over the target and grows
# back while they are well under it.


def test_the_interval_halves_while_pauses_run_over_the_target() -> None:
    wait = gcpolicy.COLLECT_EVERY_S
    target = gcpolicy.PAUSE_TARGET_S
    seen = []
    for _ in range(12):
        pause = target * 4.5 * wait / gcpolicy.COLLECT_EVERY_S  # a steady allocation rate
        wait = gcpolicy.next_wait(wait, pause)
        seen.append(wait)
    assert seen[0] == gcpolicy.COLLECT_EVERY_S / 2
    assert seen == sorted(seen, reverse=True) and min(seen) >= gcpolicy.MIN_EVERY_S
    last_pause = target * 4.5 * seen[-1] / gcpolicy.COLLECT_EVERY_S
    assert last_pause <= target or seen[-1] == gcpolicy.MIN_EVERY_S


def test_the_interval_grows_back_when_idle_and_stays_when_on_target() -> None:
    wait = gcpolicy.MIN_EVERY_S
    for _ in range(20):
        wait = gcpolicy.next_wait(wait, 0.0)
    assert wait == gcpolicy.COLLECT_EVERY_S  # never longer than the policy's period
    on_target = gcpolicy.PAUSE_TARGET_S / 2
    assert gcpolicy.next_wait(0.1, on_target) == 0.1
    assert gcpolicy.next_wait(gcpolicy.MIN_EVERY_S, 1.0) == gcpolicy.MIN_EVERY_S


def test_a_collection_is_due_at_the_interval_or_at_a_burst_of_new_objects() -> None:
    assert not gcpolicy.due(0.05, 0.1, gcpolicy.YOUNG_OBJECTS - 1)
    assert gcpolicy.due(0.1, 0.1, 0)
    assert gcpolicy.due(0.0, 0.25, gcpolicy.YOUNG_OBJECTS)
    assert not gcpolicy.due(0.0, 0.25, -5_000)  # old objects freed: the count reads low


def test_a_burst_of_new_objects_is_collected_before_the_interval_ends() -> None:
    """The policy's thread sees a burst (a re-confirm starting after an idle stretch) and
    collects it then, not when its long interval ends."""
    stop = threading.Event()
    was = gc.isenabled()
    stats = gcpolicy.install(stop, every_s=30.0)
    try:
        frozen = gc.get_freeze_count()
        kept = [[i] for i in range(3 * gcpolicy.YOUNG_OBJECTS)]
        assert _until(lambda: stats.collections >= 1, timeout_s=5.0)
        assert gc.get_freeze_count() >= frozen + len(kept) // 2
    finally:
        stop.set()
        time.sleep(0.05)
        gc.unfreeze()
        if was:
            gc.enable()


def test_the_policy_thread_shortens_its_interval_after_long_pauses(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collection too long: the loop collects 0.25 s, then 0.125 s, 0.0625 s... after
    the one before (on a clock its polls advance)."""
    now = [0.0]
    at: list[float] = []

    class Polls(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            now[0] += float(timeout or 0)
            return len(at) >= 4

    def collect(stats: gcpolicy.GcStats) -> float:
        at.append(now[0])
        return 1.0

    monkeypatch.setattr(gcpolicy, "collect_young", collect)
    monkeypatch.setattr(gcpolicy.gc, "get_count", lambda: (0, 0, 0))
    gcpolicy._collect_loop(Polls(), gcpolicy.COLLECT_EVERY_S, gcpolicy.GcStats(),
                           clock=lambda: now[0])
    gaps = [b - a for a, b in zip([0.0, *at], at, strict=False)]
    want = [gcpolicy.COLLECT_EVERY_S / 2**k for k in range(4)]
    assert all(abs(g - w) <= gcpolicy.POLL_S + 1e-9 for g, w in zip(gaps, want, strict=True))


# ---- a confirm's records are frozen as it returns --------------------------------------------


def _tracked(objs: list[object]) -> int:
    """How many of ``objs`` a collection would still scan (frozen ones are not listed)."""
    ids = {id(o) for o in objs}
    return sum(1 for o in gc.get_objects() if id(o) in ids)


@pytest.fixture
def idle_policy() -> Iterator[gcpolicy.GcStats]:
    """The policy running, its own collections 30 s apart: what is frozen within a test was
    frozen by what the test called."""
    stop = threading.Event()
    was = gc.isenabled()
    stats = gcpolicy.install(stop, every_s=30.0)
    yield stats
    stop.set()
    gc.unfreeze()
    if was:
        gc.enable()


def test_what_a_confirm_made_is_frozen_unscanned(idle_policy: gcpolicy.GcStats) -> None:
    """The servicer's Confirm freezes the records it re-created at once: a collection would
    scan each once (~0.8 us at 1M objects, 10-25% of a re-confirm), and they live as long as
    the view. Through the real RPC, with the policy running; while a caller walks the heap
    (``paused``) it freezes nothing."""
    live = start_live()
    try:
        with MetadataClient(live.endpoint, timeout_s=5.0) as c:
            inc = register(c, "s0", blocks=64)
            hs = hashes(8, seed=5)
            kv = [ObjectReport(h, hs[d - 1] if d else None, d, "c4", State.COMPRESSED_READY,
                               block=d + 1, version=1) for d, h in enumerate(hs)]
            swa = [ObjectReport(h, hs[d - 1] if d else None, d, "swa", State.SWA_VALID,
                                block=d + 1, lo=64 * d, hi=64 * d + 64)
                   for d, h in enumerate(hs)]
            with gcpolicy.paused():
                assert c.confirm("s0", kv, inc) == 8
                assert _tracked(list(live.state.objects.values())) == 8
            assert c.confirm("s0", swa, inc) == 8
        made = list(live.state.objects.values())
        assert len(made) == 16 and _tracked(made) == 0 and idle_policy.collections == 0
    finally:
        live.service.stop(0).wait()


def test_nothing_is_frozen_for_a_confirm_without_the_policy() -> None:
    """A process that does not run the policy (a test's, a library user's) keeps CPython's
    own collections: the confirm freezes nothing there."""
    kept = [[i] for i in range(1000)]
    before = gc.get_freeze_count()
    gcpolicy.freeze_confirmed()
    assert gc.get_freeze_count() == before and _tracked(kept) == len(kept)
