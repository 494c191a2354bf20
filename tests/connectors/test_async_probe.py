"""The scheduler side's probe runs off vLLM's step (issue 38 item 1), through vLLM's real
Scheduler over a real in-process hkv (real shards, real LMDB tiers), no model weights.

``get_num_new_matched_tokens`` answers None ("ask again") until the request's probe (hashing
and a leased lookup on the probe lane) is answered; vLLM skips the request meanwhile and
schedules the others. Faults land while a probe is held at a gate in front of the real port's
``lookup``: the steps go on; a probe slower than ``probe_wait_s`` and an unreachable hkv
resolve to 0 (the request computes); a request aborted with its probe in flight leaves
nothing behind; a preempted request is probed again and loads what its own saves left; a
probe's answer pins what it certified until the load read it (and its lease goes back when
no load takes it); a probe whose lease lapsed before vLLM allocated is never loaded past what
the leased lookup at allocation certifies. Steps here never wait on probes
(``Harness.wait_probes`` off) unless a test says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_async_transfers import Gate, certified_bytes, leases
from test_scheduler import fault_before_lease, handles
from vllm.v1.request import RequestStatus
from vllm_harness import Harness, harnesses, prompt, write_tiny_config

from hkv_service.connectors.scheduler import DEFER_MIN_HIT_RATE, STEP_SHARE, SchedulerSide

N = 400  # prompt tokens; 384 of them in whole LCM blocks


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def make(model: Path, tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    with harnesses(model, tmp_path, "probe") as build:
        yield lambda **kw: _no_wait(build(**kw))


def _no_wait(h: Harness) -> Harness:
    h.wait_probes = False  # these tests decide when a probe's answer is there
    return h


def side(h: Harness) -> SchedulerSide:
    s = h.connector.scheduler
    assert s is not None
    return s


def saved(h: Harness, tokens: list[int]) -> None:
    """A's blocks in hkv (its saves landed), vLLM's own prefix cache dropped."""
    h.wait_probes = True
    h.add("A", tokens)
    h.run()
    h.forget_local()
    h.wait_probes = False


def steps_until(h: Harness, done: Callable[[], bool], max_s: float = 30.0) -> int:
    """Step (as vLLM's engine loop: 1 ms after a step that ran nothing) until ``done``."""
    deadline, n = time.monotonic() + max_s, 0
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        out = h.step()
        n += 1
        if not out.total_num_scheduled_tokens:
            time.sleep(0.001)
    return n


def test_the_step_goes_on_while_a_probe_is_held_and_takes_its_answer_after(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=1)
    saved(h, tokens)
    batches = side(h).stats.total["probe_batches"]
    gate = Gate(side(h).meta, "lookup")
    h.add("B", tokens)
    h.add("C", prompt(N, seed=2))  # asked in the same step: one batch on the lane
    for _ in range(5):  # the steps return while the probes wait at the gate
        out = h.step()
        assert not out.num_scheduled_tokens and not h.loads("B")
    assert gate.entered.wait(10.0) and not gate.open_.is_set()
    assert side(h).stats.total["probe_batches"] == batches + 1
    gate.open()
    steps_until(h, lambda: bool(h.loads("B")))
    (job,) = h.loads("B")
    assert job.tokens == 384  # hkv's answer, then the leased lookup's, both certified all
    h.run()
    assert h.scheduled("B") == N - 384 and h.scheduled("C") == N
    s = side(h)
    assert not s._pending and not s._answered and not s._new  # nothing left behind


def running(h: Harness, req_id: str = "R") -> None:
    """A request in its decode steps (another request's work for every step to come)."""
    h.wait_probes = True
    h.add(req_id, prompt(N, seed=99), max_tokens=200)
    h.admit(req_id)
    h.wait_probes = False


def held_while_running(h: Harness, seed: int) -> tuple[list[int], SchedulerSide, Gate]:
    """A prompt saved in hkv, another request running, and hkv's lookups held at a gate."""
    tokens = prompt(N, seed=seed)
    saved(h, tokens)
    running(h)
    s = side(h)
    return tokens, s, Gate(s.meta, "lookup")


def test_a_new_request_is_answered_in_the_step_that_first_sees_it(
        make: Callable[..., Harness]) -> None:
    """While another request runs, a new request's probe (queued when vLLM added it) is
    waited for inside the step, up to ``probe_step_wait_s``: a hit loads and a miss computes
    from that first step on, instead of a step later."""
    h = make()
    tokens = prompt(N, seed=7)
    saved(h, tokens)
    running(h)
    s = side(h)
    batches, deferred = s.stats.total["probe_batches"], s.stats.total["probe_deferred"]
    h.probe_step_wait_s = 10.0  # far above an in-process lookup: the answer comes first
    h.add("B", tokens)  # a hit
    h.add("C", prompt(N, seed=8))  # a miss
    out = h.step()
    (job,) = h.loads("B")
    assert job.tokens == 384 and out.num_scheduled_tokens.get("C") == N
    assert s.stats.total["probe_batches"] == batches + 1  # both asked as one lane batch
    assert s.stats.total["probe_deferred"] == deferred  # neither told to ask again
    h.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.scheduled("B") == N - 384 and h.scheduled("C") == N
    assert not s._pending and not s._answered and not s._new


def test_a_step_waits_for_its_probes_at_most_probe_step_wait_s_in_all(
        make: Callable[..., Harness]) -> None:
    """Two new requests held at hkv while another runs: the step waits its budget once, for
    both together, then goes on without them; they are answered in a later step."""
    h = make()
    tokens, s, gate = held_while_running(h, seed=9)
    h.probe_step_wait_s = 0.5
    waited, deferred = s.stats.total["probe_waited_s"], s.stats.total["probe_deferred"]
    h.add("B", tokens)
    h.add("C", prompt(N, seed=10))
    out = h.step()
    assert set(out.num_scheduled_tokens) == {"R"} and gate.entered.is_set()
    spent = s.stats.total["probe_waited_s"] - waited
    assert 0.45 <= spent < 1.0  # the budget, shared: not 0.5 for each request
    assert s.stats.total["probe_deferred"] == deferred + 2
    h.probe_step_wait_s = 0.0
    gate.open()
    steps_until(h, lambda: bool(h.loads("B")))
    (job,) = h.loads("B")
    assert job.tokens == 384
    h.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.scheduled("B") == N - 384 and h.scheduled("C") == N


def test_after_a_run_of_misses_a_busy_engine_computes_at_once_until_hits_come_back(
        make: Callable[..., Harness]) -> None:
    """While hkv's recent answers are misses (hit_rate under DEFER_MIN_HIT_RATE), a request
    whose probe is not answered in its step is computed in that step, not told to ask again
    a step later; its answer still lands and counts, and once answers are hits again a held
    probe is waited for as before. An idle engine keeps asking again (that costs ~1 ms)."""
    h = make()
    tokens, s, gate = held_while_running(h, seed=21)
    h.probe_step_wait_s = 0.0
    s.hit_rate = DEFER_MIN_HIT_RATE * 0.9  # the answers so far were misses (one hit: over)
    deferred, not_waited = s.stats.total["probe_deferred"], s.stats.total["probe_not_waited"]
    h.add("B", tokens, max_tokens=20)  # in hkv, but its answer is held
    out = h.step()
    assert out.num_scheduled_tokens.get("B") == N and not h.loads("B")  # computed at once
    assert s.stats.total["probe_not_waited"] == not_waited + 1
    assert s.stats.total["probe_deferred"] == deferred
    why = s.report("B")
    assert why is not None and why.certified == 0 and "not waited" in why.why
    gate.open()
    deadline = time.monotonic() + 10.0
    while s.hit_rate < DEFER_MIN_HIT_RATE:  # B's answer landed: a hit, counted
        assert time.monotonic() < deadline, (s.hit_rate, dict(s.stats.total), s._pending)
        time.sleep(0.01)
    gate2 = Gate(s.meta, "lookup")
    h.add("C", prompt(N, seed=22))
    out = h.step()
    assert "C" not in out.num_scheduled_tokens  # its answer waited for again: a step later
    assert s.stats.total["probe_deferred"] == deferred + 1
    gate2.open()
    steps_until(h, lambda: "C" in h.outputs[-1].num_scheduled_tokens)
    h.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.scheduled("C") == N and h.scheduled("B") == N
    assert not s._pending and not s._new


def test_the_wait_is_at_most_a_tenth_of_the_step_before(
        make: Callable[..., Harness]) -> None:
    """A step of 1 s before (the time between two build_connector_meta calls): a held probe
    is waited for about 0.1 s, not the 10 s allowed."""
    h = make()
    tokens, s, gate = held_while_running(h, seed=13)
    h.probe_step_wait_s, h.step_share = 10.0, STEP_SHARE
    h.step()
    time.sleep(1.0)
    h.step()  # the step before the next one: ~1 s
    waited = s.stats.total["probe_waited_s"]
    h.add("B", tokens)
    out = h.step()
    assert "B" not in out.num_scheduled_tokens and gate.entered.is_set()
    assert 0.09 <= s.stats.total["probe_waited_s"] - waited < 0.6  # 0.1 of ~1 s
    gate.open()
    h.probe_step_wait_s = 0.0
    steps_until(h, lambda: bool(h.loads("B")))
    h.sched.finish_requests("R", RequestStatus.FINISHED_ABORTED)
    h.run()
    assert h.scheduled("B") == N - 384


def test_an_engine_with_nothing_else_to_run_does_not_wait_for_a_probe(
        make: Callable[..., Harness]) -> None:
    """Alone, a request told to ask again costs an empty iteration, not another's step: the
    step does not wait, and a later one answers."""
    h = make()
    tokens = prompt(N, seed=12)
    saved(h, tokens)
    s = side(h)
    gate = Gate(s.meta, "lookup")
    h.probe_step_wait_s = 0.5
    waited, deferred = s.stats.total["probe_waited_s"], s.stats.total["probe_deferred"]
    h.add("B", tokens)
    out = h.step()
    assert not out.num_scheduled_tokens and gate.entered.wait(10.0)
    assert s.stats.total["probe_waited_s"] == waited  # not a moment
    assert s.stats.total["probe_deferred"] == deferred + 1
    gate.open()
    steps_until(h, lambda: bool(h.loads("B")))
    h.run()
    assert h.scheduled("B") == N - 384


def test_a_probe_slower_than_its_bound_and_an_unreachable_hkv_resolve_to_compute(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=3)
    saved(h, tokens)
    s = side(h)
    s.probe_wait_s = 0.3
    gate = Gate(s.meta, "lookup")  # held past the bound
    h.add("B", tokens)
    start = time.monotonic()
    steps_until(h, lambda: "B" in {r for o in h.outputs[-1:] for r in o.num_scheduled_tokens})
    assert time.monotonic() - start < 10.0  # the bound, not the gate's 30 s
    assert s.stats.total["probe_late"] == 1 and not h.loads("B")
    gate.open()
    h.run()
    assert h.scheduled("B") == N  # computed, hkv's late answer never used

    def down(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("hkv unreachable")

    s.meta.lookup = down  # type: ignore[method-assign]
    h.forget_local()
    h.add("D", tokens)
    h.run()
    assert h.scheduled("D") == N and not h.loads("D")
    assert s.stats.total["lookup_failed"] >= 1
    assert h.connector.scheduler.report("D") is None  # reported and gone with D


def test_a_request_aborted_with_its_probe_in_flight_leaves_nothing(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=4)
    saved(h, tokens)
    gate = Gate(side(h).meta, "lookup")
    h.add("B", tokens)
    h.step()  # B's probe asked, handed to the lane, held at the gate
    assert gate.entered.wait(10.0)
    h.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    assert "B" not in h.sched.requests  # never allocated: freed at once
    gate.open()
    assert side(h)._lane.drain(10.0)  # the probe's answer arrives for no one
    for _ in range(3):
        h.step()
    s = side(h)
    assert not s._pending and not s._answered and not s._probes and not s._requests
    h.add("B2", tokens)  # the engine goes on; the next request's probe is its own
    h.run()
    assert h.scheduled("B2") == N - 384


def test_a_preempted_request_is_probed_again_and_loads_its_own_saves(
        make: Callable[..., Harness]) -> None:
    h = make()
    tokens = prompt(N, seed=5)
    h.add("A", tokens, max_tokens=4)
    h.wait_probes = True
    h.admit("A")  # A's prefill; its blocks staged and saved off the step
    assert h.worker.worker is not None and h.worker.worker.drain(30.0)
    h.wait_probes = False
    assert h.sched.reset_prefix_cache(reset_running_requests=True)  # A preempted
    assert h.sched.requests["A"].num_computed_tokens == 0
    out = h.step()  # A's longer prompt (one token sampled) is asked again: not yet answered
    assert "A" not in out.num_scheduled_tokens
    steps_until(h, lambda: bool(h.loads("A")))
    (job,) = h.loads("A")
    assert job.tokens == N  # what A's prefill saved: its 25 whole blocks
    h.run()
    assert "A" not in h.sched.requests


def test_a_probe_answer_pins_what_it_certified_until_the_load(
        make: Callable[..., Harness]) -> None:
    """The probe's lookup took a lease: evicting what it certified between the probe and
    vLLM's allocation is refused, the load takes the probe's match (no call to hkv inside
    the step) and B loads the whole hit; its lease goes back after the load."""
    h = make()
    tokens = prompt(N, seed=16)
    saved(h, tokens)
    s = side(h)
    refused: list[Exception] = []

    def try_to_evict() -> None:
        _, m = handles(h, tokens)
        if m.lease_id is not None:
            h.system.meta.release_lease(m.lease_id)
        for name in m.handles:
            try:
                h.system.meta.evict(m.handles[name][0].object_id)
            except Exception as exc:  # held by the probe's lease
                refused.append(exc)

    real = s.allocated

    def allocated(request: Any, block_ids: Any, num_external: int) -> None:
        if num_external > 0 and not refused:
            try_to_evict()
        real(request, block_ids, num_external)

    s.allocated = allocated  # type: ignore[method-assign]
    before = s.stats.total["alloc_lookup_s"]
    h.add("B", tokens)
    steps_until(h, lambda: bool(h.loads("B")))
    (job,) = h.loads("B")
    assert len(refused) == len(h.geo.groups)  # every column's first object stayed pinned
    assert job.match is not None and job.tokens == 384
    assert s.stats.total["alloc_lookup_s"] == before  # no leased lookup inside the step
    h.run()
    assert h.scheduled("B") == N - 384
    assert certified_bytes(h, tokens) == 384  # still there, the bytes the forward wrote
    deadline = time.monotonic() + 10.0
    while leases(h):  # the load lane gives the probe's lease back
        assert time.monotonic() < deadline, "a probe's lease was never given back"
        time.sleep(0.01)


def test_a_stale_probe_answer_is_never_loaded_past_the_leased_lookup(
        make: Callable[..., Harness]) -> None:
    """The probe certified the prompt; steps later (its answer waited on the lane, then for
    vLLM, long enough that its lease lapsed) the first block is evicted just before vLLM
    allocates: the leased lookup certifies nothing, so nothing is loaded and B computes all
    of it."""
    h = make()
    tokens = prompt(N, seed=6)
    saved(h, tokens)
    s = side(h)

    def evict_first_block() -> None:
        _, m = handles(h, tokens)
        if m.lease_id is not None:
            h.system.meta.release_lease(m.lease_id)
        for name in m.handles:
            h.system.meta.evict(m.handles[name][0].object_id)

    fault_before_lease(h, evict_first_block)
    h.add("B", tokens)
    steps_until(h, lambda: bool(h.loads("B")))
    (job,) = h.loads("B")
    assert job.match is None and job.tokens == 0  # the lease certified less: nothing read
    assert s.stats.total["alloc_shortfall"] == 1
    h.run()
    assert h.scheduled("B") == N  # recomputed


def test_an_answer_no_load_takes_gives_its_lease_back(make: Callable[..., Harness]) -> None:
    """A probe's lease that no load takes goes back from the lane: the request aborted after
    its answer landed, and aborted while its probe was still on the lane (the answer lands
    after the request is gone)."""
    h = make()
    tokens = prompt(N, seed=17)
    saved(h, tokens)
    s = side(h)

    def no_lease_left() -> None:
        deadline = time.monotonic() + 10.0
        while leases(h):
            assert time.monotonic() < deadline, "an unused probe's lease was never given back"
            h.step()  # (a step hands the unused leases to the lane)
            time.sleep(0.01)

    h.add("B", tokens)
    h.step()  # asked; not answered in this step (no wait here)
    assert s._lane.drain(30.0) and leases(h) == 1  # landed, with its lease
    h.sched.finish_requests("B", RequestStatus.FINISHED_ABORTED)
    no_lease_left()
    gate = Gate(s.meta, "lookup")
    h.add("C", tokens)
    h.step()
    assert gate.entered.wait(10.0)
    h.sched.finish_requests("C", RequestStatus.FINISHED_ABORTED)
    h.step()
    gate.open()
    assert s._lane.drain(30.0)
    no_lease_left()
    assert s.stats.total["leases_given_back"] == 2
    assert h.loads("B") == [] and h.loads("C") == []
