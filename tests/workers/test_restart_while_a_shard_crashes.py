"""A service restart while another fault crashes a shard (the demo's two workers inject faults
at once): ``InProcessSystem.restart_service`` waits for the shards that were alive to rejoin
the fresh view, and must not wait for one that crashed meanwhile, or was crashed and revived
(a new incarnation: its successor registers with whichever view is there). Found by
``hkv bench e2e --quick`` in a fresh-clone CI: "shards did not rejoin the restarted metadata
view" aborted the demo."""

from __future__ import annotations

import threading
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


def test_a_restart_that_begins_while_a_shard_rejoins_the_one_before_returns(
        inprocess: Callable[..., InProcessSystem], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two restarts close together (the demo's two workers): the second begins while a
    shard, rejoining the first, is still registering. That registration lands with the
    second view (or is refused by it and retried inside the same rejoin), so the shard joins
    the second view without rejoining again; the second restart must see that registration,
    not wait for a rejoin that never comes (it did: "shards did not rejoin", 60 s, in a
    fresh-clone CI)."""
    system = inprocess(shards=1)
    shard = system.links["shard-0"].shard
    inside, release = threading.Event(), threading.Event()
    part, swapped = system.parts[0], threading.Semaphore(0)
    swap = part.swap

    def counted_swap(state: Any) -> None:
        swap(state)
        swapped.release()

    monkeypatch.setattr(part, "swap", counted_swap)
    real = shard._register_once
    calls: list[int] = []

    def held_once(partitions: Any) -> None:
        calls.append(1)
        if len(calls) == 1:  # the rejoin of the first restart: held while the second begins
            inside.set()
            assert release.wait(30.0)
        real(partitions)  # lands with whichever view is there by then: the second one

    monkeypatch.setattr(shard, "_register_once", held_once)
    first = threading.Thread(target=system.restart_service, kwargs={"timeout_s": 30.0})
    first.start()
    assert swapped.acquire(timeout=30.0)  # the first restart's view
    assert inside.wait(30.0)  # shard-0 is registering with it
    second_done = threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            system.restart_service(timeout_s=10.0)
        except BaseException as exc:
            errors.append(exc)
        second_done.set()

    threading.Thread(target=second).start()
    # the second restart took its snapshot (before its swap) while the registration is held
    assert swapped.acquire(timeout=30.0)
    release.set()
    assert second_done.wait(30.0)
    first.join(30.0)
    assert not errors, errors
    assert system.restarts == 2 and calls
    system.meta.heartbeat("shard-0", shard.incarnation)  # the current view knows it
