"""Saves and loads run off vLLM's step (issue 38 item 1), through vLLM's real Scheduler over a
real in-process hkv (real shards, real LMDB tiers), no model weights.

The step only stages a save (a copy of the pages out of vLLM's cache); hkv's writes and
commit run on a background lane. A write is held back here by delaying the real data plane
(a gate in front of ``write_prefix`` / ``read``, which then run as they are), so each fault
lands while a save or a load is in flight: vLLM overwriting the pages once the step returned
(a finished or preempted request's blocks reused), a shard killed, the lane's thread dying,
the connector shut down, the staging budget full, a request aborted mid-load. In each: no
object hkv certifies holds other bytes than the forward wrote, and the engine's steps never
wait on the gate.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1.request import RequestStatus
from vllm_harness import Harness, harnesses, prompt, write_tiny_config

from hkv_service.connectors.lane import Task
from hkv_service.connectors.worker import WorkerSide
from hkv_service.core.api import LookupRequest
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import ShardId
from hkv_service.core.layout import Layout
from workers.dataplane import DataPlane
from workers.shared import SharedLink

N = 400  # prompt tokens; 384 of them in whole LCM blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make(model: Path, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    with harnesses(model, tmp_path, "async") as build:
        yield build


class Gate:
    """Holds every call of ``obj.name`` until opened (bounded: 30 s), then lets it run."""

    def __init__(self, obj: Any, name: str) -> None:
        self.open_ = threading.Event()
        self.entered = threading.Event()
        real = getattr(obj, name)

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.entered.set()
            assert self.open_.wait(30.0), "the gate was never opened"
            return real(*args, **kwargs)

        setattr(obj, name, gated)

    def open(self) -> None:
        self.open_.set()


def work(h: Harness) -> WorkerSide:
    w = h.worker.worker
    assert w is not None
    return w


def certified_bytes(h: Harness, tokens: list[int]) -> int:
    """What hkv certifies for ``tokens`` now; every certified object is read back and must
    hold exactly the bytes the forward wrote for it."""
    lcm = h.geo.lcm
    limit = (len(tokens) - 1) // lcm * lcm
    hs = hash_blocks(tokens[:limit], h.geo.hash_block_size, ExtraKeys(h.geo.spec.model_id))
    m = h.system.meta.lookup(LookupRequest(hs, limit, h.geo.reader_abi()))
    if not m.usable_tokens:
        return 0
    got = h.system.dataplane().read(m, hs)
    assert isinstance(got, dict), got
    lay = Layout(h.geo.spec)
    for g in h.geo.groups:
        depths = lay.needed_depths(lay.by_name[g.name], m.usable_tokens)
        for depth, arr in zip(depths, got[g.name], strict=True):
            k = h.geo.block_of(g, depth)
            want = torch.cat([h.expected(tokens, g.vllm_group, k, li).reshape(-1)
                              .view(torch.uint8) for li in range(len(g.layers))])
            assert np.array_equal(np.asarray(arr).view(np.uint8), want.numpy()), \
                f"{g.name} block {k}: hkv certifies bytes the forward did not write"
    if m.lease_id is not None:
        h.system.meta.release_lease(m.lease_id)
    return m.usable_tokens


def steps_while_gated(h: Harness, gate: Gate, max_steps: int = 20) -> None:
    """vLLM runs the request to its end while every hkv write is held at the gate: the
    engine never waits on it (the steps end; the gate is still shut)."""
    for _ in range(max_steps):
        if not h.sched.has_requests():
            break
        h.step()
    assert not h.sched.has_requests(), "vLLM still holds the request: the engine waits on hkv"
    assert gate.entered.wait(10.0) and not gate.open_.is_set()


def scribble(h: Harness) -> None:
    """vLLM reuses every page once the step returned (freed, preempted, reallocated)."""
    for t in h.caches.values():
        t.view(torch.uint8).fill_(0xA5)


def test_a_save_lands_with_the_bytes_of_its_step_though_vllm_reuses_the_pages(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=1)
    held = threading.Event()  # the save lane busy with a task ahead of A's saves

    def busy() -> None:
        assert held.wait(30.0)

    work(h)._saves.submit(Task(busy, lambda why: None))
    gate = Gate(work(h).plane, "write_prefix")
    h.add("A", tokens)
    for _ in range(20):
        if not h.sched.has_requests():
            break
        h.step()
    assert not h.sched.has_requests(), "vLLM still holds the request: the engine waits on hkv"
    assert certified_bytes(h, tokens) == 0  # nothing certified before its bytes landed
    scribble(h)
    held.set()
    assert gate.entered.wait(10.0)
    gate.open()
    assert work(h).drain(30.0)
    assert certified_bytes(h, tokens) == 384  # the staged copy, not the reused pages
    assert work(h).stats.total["saved_blocks"] > 0
    assert work(h).stats.total["save_failed"] == 0


def test_a_shard_silent_at_startup_holds_up_neither_vllms_start_nor_its_steps(
        make: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker maps the shards' segments when vLLM registers its caches, on the save lane:
    a mapping that hangs (a shard not answering) delays the first save, never the engine.
    Once it is done the segments are mapped before any save needed them."""
    monkeypatch.setattr(DataPlane, "attach_shared", DataPlane.attach_shared)  # (restored)
    gate = Gate(DataPlane, "attach_shared")
    h = make()  # (registers the caches: returns with the mapping still held at the gate)
    assert gate.entered.wait(10.0)
    tokens = prompt(N, seed=11)
    h.add("A", tokens)
    steps_while_gated(h, gate)
    assert certified_bytes(h, tokens) == 0  # the save waits behind the mapping
    gate.open()
    assert work(h).drain(30.0)
    assert certified_bytes(h, tokens) == 384
    links = [link for link in work(h).plane.shards.values() if isinstance(link, SharedLink)]
    assert links and all(link.mapped is not None for link in links)


def test_a_request_preempted_with_its_save_in_flight_leaves_hkv_its_bytes(
        make: Callable[..., Harness]) -> None:
    """vLLM preempts A (its blocks freed, its KV dropped) while A's saves wait on the lane;
    the freed pages are overwritten, C and A (rescheduled, recomputing) run on; A's saves
    land with A's bytes."""
    h = make()
    a_tokens, c_tokens = prompt(N, seed=8), prompt(N, seed=9)
    held = threading.Event()

    def busy() -> None:
        assert held.wait(30.0)

    work(h)._saves.submit(Task(busy, lambda why: None))
    h.add("A", a_tokens, max_tokens=8)
    h.admit("A")  # A's prefill: its blocks staged and handed to the (busy) lane
    assert h.sched.reset_prefix_cache(reset_running_requests=True)  # A preempted
    assert h.sched.requests["A"].num_computed_tokens == 0
    scribble(h)  # A's freed blocks are anyone's now
    h.add("C", c_tokens)
    for _ in range(5):  # C (and A again) reuse the freed blocks while A's saves wait
        h.step()
    assert certified_bytes(h, a_tokens) == 0
    held.set()
    h.run()
    assert certified_bytes(h, a_tokens) == 384
    assert certified_bytes(h, c_tokens) == 384


def test_a_shard_killed_under_a_save_in_flight_certifies_nothing_wrong(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=2)
    gate = Gate(work(h).plane, "_write")  # allocated on both shards, nothing written yet
    h.add("A", tokens)
    steps_while_gated(h, gate)
    h.system.crash_shard("shard-0")
    h.system.meta.mark_owner_lost(ShardId("shard-0"))
    gate.open()
    assert work(h).drain(30.0)
    assert work(h).stats.total["save_failed"] > 0  # counted, and nothing blocked
    assert certified_bytes(h, tokens) < 384  # what is certified (if any) is A's bytes
    h.forget_local()  # the engine goes on: B gets what hkv still certifies, or computes
    h.add("B", tokens)
    h.run()
    assert "B" not in h.sched.requests


class Die(BaseException):
    """What kills a lane's thread (no task raises it on purpose)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_save_thread_is_replaced_and_its_task_settled(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=3)
    w = work(h)
    settled: list[str] = []
    gate = threading.Event()

    def poison() -> None:
        assert gate.wait(30.0)
        raise Die

    w._saves.submit(Task(poison, settled.append))  # ahead of A's saves
    h.add("A", tokens)
    for _ in range(20):
        if not h.sched.has_requests():
            break
        h.step()
    assert not h.sched.has_requests()
    gate.set()
    deadline = time.monotonic() + 10.0
    while w._saves.deaths == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    h.step()  # the next step finds the lane's thread dead and starts another
    assert w.drain(30.0)
    assert settled and "died" in settled[0]
    assert certified_bytes(h, tokens) == 384  # A's saves, queued behind, still landed


def test_shutdown_with_saves_in_flight_is_bounded_and_counted(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=4)
    w = work(h)
    w.drain_s = 0.2
    gate = Gate(w.plane, "write_prefix")
    h.add("A", tokens)
    h.admit("A")  # A's prefill: its first saves staged and handed over
    h.add("C", prompt(N, seed=5))
    steps_while_gated(h, gate)
    start = time.monotonic()
    h.worker.shutdown()
    assert time.monotonic() - start < 5.0  # drain_s, not the gate's 30 s
    assert w.stats.total["save_abandoned"] > 0
    gate.open()  # the write running at shutdown lands whole or not at all
    time.sleep(0.5)
    certified_bytes(h, tokens)


def test_a_save_past_the_staging_budget_is_dropped_not_waited_for(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=6)
    w = work(h)
    w.staging_bytes = h.geo.groups[0].block_bytes  # room for one block
    h.add("A", tokens)
    h.run()
    assert w.stats.total["save_dropped"] > 0
    assert w._staged_bytes == 0
    assert certified_bytes(h, tokens) < 384


def test_a_request_aborted_while_its_load_is_in_flight_is_freed_after_it(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=7)
    h.add("A", tokens)
    h.run()
    h.forget_local()
    assert certified_bytes(h, tokens) == 384
    gate = Gate(work(h).plane, "read")
    h.add("B", tokens)
    h.admit("B")  # B allocated, its load handed over
    assert gate.entered.wait(10.0)
    h.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    for _ in range(5):  # steps go on while the load is held; vLLM keeps B's blocks
        h.step()
    assert "B" in h.sched.requests
    gate.open()
    h.run()
    assert "B" not in h.sched.requests  # freed once the load reported
    assert h.connector.scheduler.stats.total["finished_while_loading"] == 1  # type: ignore[union-attr]


def leases(h: Harness) -> int:
    gauges: Any = h.system.meta.state.stats()["gauges"]
    return int(gauges["leases"])


def test_a_hit_runs_before_its_lease_is_given_back(make: Callable[..., Harness]) -> None:
    """A load reports landed (vLLM schedules the rest of the prompt) before the load lane
    gives the lease back: that round trip to the service is not on the request's path. The
    lease still goes once it is let through."""
    h = make()
    tokens = prompt(N, seed=11)
    h.add("A", tokens)
    h.run()
    h.forget_local()
    gate = Gate(h.system.meta, "release_lease")  # the service answers the release late
    h.add("B", tokens)
    deadline = time.monotonic() + 10.0  # under the gate's own 30 s
    while not any(out.num_scheduled_tokens.get("B") for out in h.outputs):
        assert time.monotonic() < deadline, "B waited for its lease's release"
        h.step()
        time.sleep(0.001)
    assert h.scheduled("B") == N - 384  # the hit loaded; the rest computed
    # the probe's leased match was lent to the load: no leased lookup inside the step
    assert h.connector.scheduler.stats.total["alloc_lookup_s"] == 0  # type: ignore[union-attr]
    assert gate.entered.wait(10.0) and not gate.open_.is_set() and leases(h) == 1
    gate.open()
    h.run()
    deadline = time.monotonic() + 10.0
    while leases(h):
        assert time.monotonic() < deadline, "the lease was never given back"
        time.sleep(0.01)


def test_a_prompt_is_saved_when_a_second_request_brings_it(make: Callable[..., Harness]) -> None:
    """``save_min_sightings=2``: a one-off prompt costs no write; the second request with the
    same prefix saves it (whole, its bytes the forward's); the third one hits."""
    h = make()
    w = work(h)
    w.min_sightings = 2  # (what ``save_min_sightings`` in the extra config sets)
    tokens = prompt(N, seed=6)
    h.add("A", tokens)
    h.run()
    assert w.drain(30.0)
    assert w.stats.total["saved_blocks"] == 0
    assert w.stats.total["save_unadmitted"] > 0
    assert certified_bytes(h, tokens) == 0
    h.forget_local()  # the next request computes (vLLM's own cache forgot the prompt)
    h.add("B", tokens)
    h.run()
    assert w.drain(30.0)
    assert w.stats.total["saved_blocks"] > 0
    assert w.stats.total["save_failed"] == 0
    assert certified_bytes(h, tokens) == 384


def test_a_failed_admission_call_loses_that_save_only(make: Callable[..., Harness]) -> None:
    """``admit_save`` failing (the service unreachable, say) is a lost save: counted, the
    staging budget and the held request given back, nothing certified; the engine never
    waits on it, and the next request's save goes through once the service answers."""
    h = make()
    w = work(h)
    w.min_sightings = 2
    meta = w.plane.meta
    real = meta.admit_save
    calls: list[int] = []

    def unreachable(*args: Any, **kwargs: Any) -> int:
        calls.append(1)
        raise ConnectionError("metadata service unreachable")

    meta.admit_save = unreachable  # type: ignore[method-assign]
    tokens = prompt(N, seed=8)
    for name in ("A", "B"):  # B would be A's second sighting
        h.forget_local()
        h.add(name, tokens)
        h.run()
        assert not h.sched.has_requests()  # the engine ran it to its end and let it go
    assert w.drain(30.0)
    assert calls and w.stats.total["save_failed"] > 0
    assert w.stats.total["saved_blocks"] == 0
    assert w._staged_bytes == 0 and not w._held
    assert certified_bytes(h, tokens) == 0
    meta.admit_save = real  # type: ignore[method-assign]
    for name in ("C", "D"):  # the service answers again: offered twice, then saved
        h.forget_local()
        h.add(name, tokens)
        h.run()
    assert w.drain(30.0)
    assert w.stats.total["saved_blocks"] > 0
    assert certified_bytes(h, tokens) == 384
