"""The connector's scheduler side: what hkv certifies for a request, and what to move.

A request's life, as vLLM drives it::

    on_new_request               the request's probe is queued: a leased lookup of its
                                 whole-block prefix (the lease pins what it certifies until
                                 the load read it, or the answer is dropped unused: given
                                 back from the lane, else it expires)
    get_num_new_matched_tokens   the probes queued so far go to the probe lane as one batch
                                 (hashing and one lookup call). While other requests run, a
                                 request told to wait would miss a whole step of theirs, so
                                 the step waits for its probes, in all (shared by every
                                 request it asks about), at most a tenth of the step before
                                 it and at most ``probe_step_wait_s``; a new request is
                                 then usually answered in the step that first sees it;
                                 an engine with nothing else to run does not wait (its next
                                 iteration comes within a millisecond). Not answered: None
                                 ("ask again"), and a later call answers; but while the
                                 recent answers were misses (``hit_rate`` under
                                 DEFER_MIN_HIT_RATE) a busy engine neither waits nor asks
                                 again: 0 (computed now). The answer is usable -
                                 local (tokens hkv's funnel certifies beyond vLLM's own hit),
                                 loaded asynchronously. An
                                 answer given once is given again at once (and refreshed on
                                 the lane for the next ask): vLLM waits on hkv once per
                                 request. hkv slower than ``probe_wait_s``: 0 (computed). At
                                 most one answer per request per step (asked again in the same
                                 step, the same answer)
    update_state_after_alloc     the probe's match when vLLM took exactly what it certified
                                 (no call: the step never waits on hkv for a hit); otherwise
                                 a leased lookup at exactly local + what vLLM took, shorter
                                 than that (something changed since the probe) a load error
    build_connector_meta         the step's LoadJobs, and a SaveJob per scheduled request for
                                 the blocks this step completes (saved after the forward: a
                                 sliding window's blocks are freed once it moves past them)
                                 and the recurrent states vLLM hands off in this step
                                 (``boundary_state_offloads``: the only source of states)
    update_connector_output      a failed load caps the request's next probe (it recomputes);
                                 a received one ends the request's load in flight
    request_finished_all_groups  a SaveJob for any whole block still unsaved; vLLM keeps the
                                 blocks until the worker says that save landed. Not while
                                 the request's load is in flight: vLLM then holds the blocks
                                 for the load, and a second hold would be freed twice

A request whose hkv answer is refused is never given a partial one it cannot check: multimodal
and prompt-embedding requests are not looked up (their tokens do not name their KV).

Each request that hkv was asked about gets a :class:`Certified` report in its output
(``RequestOutput.kv_transfer_params["hkv"]``): the resume point hkv certified and, when it
is shorter than the prompt allows, why (``NO_STATE_AT_BOUNDARY@960``: a recurrent group kept
no state there; vLLM keeps few, see docs/vllm-recurrent-state.md).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from hkv_service.core.api import Downgrade, LookupRequest, Match
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.ids import BlockHash
from hkv_service.core.layout import Layout
from hkv_service.core.port import MetadataPort
from hkv_service.core.states import Reason

from .geometry import Geometry
from .lane import Lane, Task
from .plan import LoadJob, SaveItem, SaveJob, load_copies, save_items, state_items
from .stats import Counters

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["Certified", "Probe", "SchedulerSide"]

log = logging.getLogger(__name__)

# A step waits for its new requests' probes at most this share of the step before it (and
# at most probe_step_wait_s): a request told to ask again loses a whole step, so the wait
# costs the engine at most a tenth of what it saves; a GPU step of a few milliseconds
# waits a fraction of one, a CPU step of 200 ms up to 20 ms.
STEP_SHARE = 0.1
# While other requests run, a request whose probe is not answered in its step's wait is told
# to ask again (a step later) only while hkv's answers have been hits: each landed answer moves
# ``SchedulerSide.hit_rate`` this far toward 1 (a hit: more than vLLM's own) or 0, and under
# DEFER_MIN_HIT_RATE the request computes at once. A step is what a miss's deferral costs; a
# no-reuse workload paid it for ~half its requests (hkv bench serve, 2026-12-07). It starts
# at 1 (every request waits for its first answers, as before this rule).
HIT_RATE_WEIGHT = 0.1
DEFER_MIN_HIT_RATE = 0.2


@dataclass(slots=True, eq=False)
class _Ask:
    """One probe on the probe lane: the lane sets ``hashes`` and ``match`` (None: the lookup
    failed), then ``done``; the step reads them only once ``done``."""

    req_id: str
    limit: int
    tokens: list[int]  # the prompt's first ``limit`` tokens, copied in the step
    extra: ExtraKeys
    started: float  # time.monotonic() when asked
    hashes: tuple[BlockHash, ...] = ()
    match: Match | None = None
    done: bool = False
    served: bool = False  # its answer was given to vLLM (a later ask refreshes it)
    submitted: bool = False  # handed to the probe lane
    deferred: bool = False  # vLLM was told to ask again (not answered in its step's wait)
    landed: threading.Event = dataclasses.field(default_factory=threading.Event)  # done set
    lent: bool = False  # its match (and lease) went to a LoadJob: the worker gives it back
    dropped: bool = False  # no one will use its answer: its lease goes back once it lands
    local: int = 0  # vLLM's own hit when last asked (an answer beyond it is a hit)


@dataclass(frozen=True, slots=True)
class Probe:
    hashes: tuple[BlockHash, ...]
    local: int  # vLLM's own hit, as it told the probe
    usable: int  # what hkv certified
    downgrades: tuple[Downgrade, ...]
    ask: _Ask | None = None  # the answered probe, whose leased match a load may take


@dataclass(frozen=True, slots=True)
class Certified:
    """What hkv answered for one request, in tokens from the prompt's start."""

    asked: int  # the longest resume point the prompt allows (whole LCM blocks before its end)
    local: int  # vLLM's own prefix-cache hit
    certified: int  # the resume point hkv's funnel certified (<= local: nothing to add)
    loaded: int = 0  # tokens restored from hkv beyond ``local`` (0: none, or the load failed)
    why: str = ""  # why less than asked: hkv's reasons, REASON@position[:group], or a failure

    def as_params(self) -> dict[str, int | str]:
        return dataclasses.asdict(self)


def _why(downgrades: Sequence[Downgrade]) -> str:
    return ", ".join(f"{d.reason.value}@{d.position}" + (f":{d.group}" if d.group else "")
                     for d in downgrades)


class SchedulerSide:
    def __init__(self, geo: Geometry, meta: MetadataPort, model_id: str,
                 lease_ttl_s: float, probe_wait_s: float = 1.0,
                 probe_step_wait_s: float = 0.05) -> None:
        self.geo = geo
        self.layout = Layout(geo.spec)
        self.meta = meta
        self.model_id = model_id
        self.lease_ttl_s = lease_ttl_s
        self.abi = geo.reader_abi()
        self.stats = Counters()
        self.null_block = 0  # vLLM's null block id (set from the block pool when bound)
        self._probes: dict[str, Probe] = {}
        self._caps: dict[str, int] = {}  # request -> most tokens its next probe may answer
        self._known: dict[str, int] = {}  # request -> tokens hkv holds for it (not re-saved)
        self._requests: dict[str, Request] = {}
        self._sources: dict[str, str] = {}
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        self._reports: dict[str, Certified] = {}
        self._loading: set[str] = set()  # a LoadJob handed out, not yet reported received
        self._step = 0  # build_connector_meta calls so far
        self._asked: dict[str, tuple[int, int, int, tuple[int | None, bool]]] = {}  # this step's
        self.block_errors = geo.block_errors
        self.probe_wait_s = probe_wait_s  # a probe pending longer: the request computes
        self._answered: dict[str, _Ask] = {}  # request -> its latest probe answered
        self._pending: dict[str, _Ask] = {}  # request -> its probe on the lane, if any
        self._new: list[_Ask] = []  # asked, not yet on the lane: one batch
        # a step waits for its probes at most this long in all (0: never waits)
        self.probe_step_wait_s = probe_step_wait_s
        self.step_share = STEP_SHARE
        self._waited: tuple[int, float] = (0, 0.0)  # (step, seconds this step waited)
        self._step_at = time.monotonic()  # the last build_connector_meta
        self._step_s = 0.0  # the time between the last two: the step before this one
        self._lane = Lane("probe")
        # leases of answers no load took, given back from the lane (the step never calls
        # hkv); the lock orders an answer landing against its request dropping it
        self._lease_lock = threading.Lock()
        self._unused: list[Match] = []
        self.hit_rate = 1.0  # recent answers' share of hits (HIT_RATE_WEIGHT; the lane sets it)

    # -- probe ----------------------------------------------------------------------------

    def added(self, request: Request) -> None:
        """``on_new_request``: the request's probe is queued now, so the requests that arrive
        together go to the lane as one batch when the first of them is asked about."""
        self._requests[request.request_id] = request
        if request.mm_features or request.prompt_embeds is not None:
            return
        n = len(request.all_token_ids)
        limit = (n - 1) // self.geo.lcm * self.geo.lcm
        if limit > 0:
            self._ask(request, limit)

    def extra_keys(self, request: Request) -> ExtraKeys:
        lora = request.lora_request
        return ExtraKeys(self.model_id, lora.lora_name if lora is not None else "",
                         request.cache_salt or "")

    def matched(self, request: Request, local: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: (tokens to load beyond ``local``, async), or
        (None, False) while the request's probe is on the lane."""
        req_id = request.request_id
        if request.mm_features or request.prompt_embeds is not None:
            self._probes.pop(req_id, None)
            return 0, False
        n = len(request.all_token_ids)
        lcm = self.geo.lcm
        limit = min((n - 1) // lcm * lcm, self._caps.get(req_id, n))
        asked = self._asked.get(req_id)
        if asked is not None and asked[:3] == (self._step, local, limit):
            return asked[3]  # hkv was asked this step already: its answer, not a second ask
        self._probes.pop(req_id, None)
        if limit <= local or local % lcm:
            self._unask(req_id)
            return 0, False
        pending = self._pending.get(req_id)
        if pending is not None and pending.done:
            self._take_answer(pending)
            pending = None
        ask = self._answered.get(req_id)
        if ask is None or ask.limit != limit:  # nothing answered for this prompt length yet
            if pending is None or pending.limit != limit:
                pending = self._ask(request, limit)
            pending.local = local
            worth = self.hit_rate >= DEFER_MIN_HIT_RATE or not self._busy()
            if self._wait(pending, worth):  # answered within the step's wait: answer it now
                ask = self._take_answer(pending)
                pending = None
            elif not worth:  # recent answers were misses: a step's wait is not worth it
                return self._compute_now(req_id, local, limit, "probe_not_waited",
                                         "hkv probe not waited (recent answers were misses)")
            elif time.monotonic() - pending.started < self.probe_wait_s:
                if not pending.deferred:
                    pending.deferred = True
                    self.stats.add("probe_deferred")
                return None, False
            else:  # hkv is slower than the bound: compute (a late answer serves a later ask)
                return self._compute_now(req_id, local, limit, "probe_late", "hkv probe late")
        elif ask.served and pending is None:  # asked again (not scheduled, or preempted):
            self._ask(request, limit)  # this answer now, a fresh one for the next ask
        answer = self._answer(req_id, ask, local, limit)
        self._asked[req_id] = (self._step, local, limit, answer)
        return answer

    def _compute_now(self, req_id: str, local: int, limit: int, counter: str, why: str
                     ) -> tuple[int | None, bool]:
        """The request computes without hkv's answer (it stays on the lane: a later ask of
        the request, a preempted one's, takes it); counted and reported ``why``."""
        self.stats.add(counter)
        self._reports[req_id] = Certified(limit, local, 0, why=why)
        now: tuple[int | None, bool] = (0, False)
        self._asked[req_id] = (self._step, local, limit, now)
        return now

    def _ask(self, request: Request, limit: int) -> _Ask:
        ask = _Ask(request.request_id, limit, list(request.all_token_ids[:limit]),
                   self.extra_keys(request), time.monotonic())
        old = self._pending.get(ask.req_id)
        if old is not None:  # (a probe for another prompt length: its answer is not wanted)
            self._drop(old)
        self._pending[ask.req_id] = ask
        self._new.append(ask)
        return ask

    def _take_answer(self, ask: _Ask) -> _Ask:
        """``ask`` (landed) becomes its request's answer; the one it replaces is dropped."""
        old = self._answered.get(ask.req_id)
        if old is not None and old is not ask:
            self._drop(old)
        self._answered[ask.req_id] = ask
        del self._pending[ask.req_id]
        return ask

    def _settle(self, ask: _Ask, match: Match | None) -> None:
        """On the lane: the answer, then ``done`` (the step reads match only once done)."""
        hit = match is not None and match.usable_tokens > ask.local
        # (the lane's thread, or the step's for a batch a closed lane abandons: a lost update
        # of this estimate costs one answer's weight, nothing else)
        self.hit_rate += HIT_RATE_WEIGHT * (hit - self.hit_rate)
        with self._lease_lock:
            ask.match = match
            ask.done = True
            if ask.dropped and match is not None and match.lease_id is not None:
                self._unused.append(match)  # its request let go of it meanwhile
        ask.landed.set()

    def _drop(self, ask: _Ask) -> None:
        """No load will take ``ask``'s answer: its lease goes back (from the lane), now if
        it landed, else when it lands. A lease lent to a LoadJob is the worker's to give
        back."""
        with self._lease_lock:
            if ask.dropped or ask.lent:
                return
            ask.dropped = True
            m = ask.match
            if ask.done and m is not None and m.lease_id is not None:
                self._unused.append(m)

    def _lend(self, probe: Probe, target: int) -> Match | None:
        """The probe's leased match for a load of exactly ``target`` tokens (what it
        certified, not lent before, not dropped), else None."""
        ask = probe.ask
        if ask is None:
            return None
        with self._lease_lock:
            m = ask.match
            if ask.lent or ask.dropped or m is None or m.lease_id is None or \
                    m.usable_tokens != target or \
                    time.monotonic() - ask.started > self.lease_ttl_s / 2:  # (may lapse)
                return None
            ask.lent = True
            return m

    def _unask(self, req_id: str) -> None:
        """vLLM's own hit covers what hkv could add: a probe queued at arrival is not sent."""
        queued = self._pending.get(req_id)
        if queued is not None and not queued.submitted:
            del self._pending[req_id]

    def _wait(self, ask: _Ask, block: bool = True) -> bool:
        """Whether ``ask`` is answered, waiting for it (its batch handed to the lane first;
        with ``block``) no longer than what is left of this step's ``probe_step_wait_s``."""
        if not ask.submitted:
            self._submit()
        step, waited = self._waited
        if step != self._step:
            waited = 0.0
        left = min(self.probe_step_wait_s, self.step_share * self._step_s) - waited
        if not ask.done and left > 0 and block and self._busy():
            start = time.perf_counter()
            ask.landed.wait(left)
            spent = time.perf_counter() - start
            self.stats.add("probe_waited_s", spent)
            waited += spent
        self._waited = (self._step, waited)
        return ask.done

    def _busy(self) -> bool:
        """Whether some request is not waiting for its probe (it runs, or waits for a load
        or for room): then a request told to ask again loses a step of the engine's work."""
        return len(self._requests) > len(self._pending)

    def _submit(self) -> None:
        """The probes asked so far, still wanted (a request may have finished since it
        asked), to the probe lane as one task."""
        asks = [a for a in self._new if self._pending.get(a.req_id) is a]
        self._new.clear()
        with self._lease_lock:
            unused, self._unused = self._unused, []
        if unused:
            self._lane.submit(Task(partial(self._give_back, unused),
                                   partial(self._not_given_back, unused)))
        for a in asks:
            a.submitted = True
        if asks:
            self.stats.add("probe_batches")
            self._lane.submit(Task(partial(self._run_probes, asks),
                                   partial(self._abandon_probes, asks)))

    def _run_probes(self, asks: list[_Ask]) -> None:
        """On the probe lane: hash each prompt, then one lookup call for all of them where the
        port takes many (the gRPC client), else one each."""
        start = time.perf_counter()
        hb = self.geo.hash_block_size
        for a in asks:
            a.hashes = tuple(hash_blocks(a.tokens, hb, a.extra))
        reqs = [LookupRequest(a.hashes, a.limit, self.abi, lease_ttl_s=self.lease_ttl_s)
                for a in asks]
        many = getattr(self.meta, "lookup_many", None)
        matches: list[Match | None]
        if many is not None and len(reqs) > 1:
            try:
                matches = list(many(reqs))
            except Exception as exc:  # hkv unreachable or refusing: vLLM computes
                log.warning("hkv lookup failed (%s): computing instead", exc)
                self.stats.add("lookup_failed")
                matches = [None] * len(reqs)
        else:
            matches = [self._lookup(r) for r in reqs]
        for a, m in zip(asks, matches, strict=True):
            self._settle(a, m)
        self.stats.add("probe_s", time.perf_counter() - start)

    def _abandon_probes(self, asks: list[_Ask], why: str) -> None:
        log.warning("hkv probes abandoned (%s): computing instead", why)
        self.stats.add("probe_abandoned", len(asks))
        for a in asks:
            self._settle(a, None)

    def _give_back(self, matches: list[Match]) -> None:
        """On the probe lane: the leases of answers no load took."""
        for m in matches:
            self._release(m)
        self.stats.add("leases_given_back", len(matches))

    def _not_given_back(self, matches: list[Match], why: str) -> None:
        log.debug("%d unused leases left to expire (%s)", len(matches), why)

    def _answer(self, req_id: str, ask: _Ask, local: int, limit: int) -> tuple[int, bool]:
        match = ask.match
        if match is None:
            self._reports[req_id] = Certified(limit, local, 0, why="hkv lookup failed")
            return 0, False
        if not ask.served:
            ask.served = True
            self.stats.add("probes")
            for d in match.downgrades:
                self.stats.add(f"downgrade.{d.reason.value}")
        usable = match.usable_tokens
        self._reports[req_id] = Certified(limit, local, usable,
                                          why=_why(match.downgrades) if usable < limit else "")
        if usable <= local:
            return 0, False
        self._probes[req_id] = Probe(ask.hashes, local, usable, match.downgrades, ask)
        self.stats.add("probe_tokens", usable - local)
        return usable - local, True

    def close(self) -> None:
        self._lane.close(0.0)

    def _lookup(self, req: LookupRequest) -> Match | None:
        start = time.perf_counter()
        try:
            return self.meta.lookup(req)
        except Exception as exc:  # hkv unreachable or refusing: vLLM computes, never waits
            log.warning("hkv lookup failed (%s): computing instead", exc)
            self.stats.add("lookup_failed")
            return None
        finally:
            self.stats.add("lookup_s", time.perf_counter() - start)

    # -- alloc ------------------------------------------------------------------------------

    def allocated(self, request: Request, block_ids: Sequence[Sequence[int]],
                  num_external: int) -> None:
        """``update_state_after_alloc``: lease what vLLM took, plan its copies."""
        probe = self._probes.pop(request.request_id, None)
        if num_external <= 0 or probe is None:
            return
        target = probe.local + num_external
        hashes = probe.hashes[: target // self.geo.hash_block_size]
        match = self._lend(probe, target)
        if match is None:  # vLLM took another length, or the answer was lent already
            start = time.perf_counter()  # (a round trip inside vLLM's step: counted apart)
            match = self._lookup(LookupRequest(hashes, target, self.abi,
                                               lease_ttl_s=self.lease_ttl_s))
            self.stats.add("alloc_lookup_s", time.perf_counter() - start)
        job = self._plan(request.request_id, hashes, probe.local, target, match, block_ids)
        self._loads.append(job)
        self._loading.add(request.request_id)
        if match is not None and job.match is not match and match.lease_id is not None:
            with self._lease_lock:  # given back from the lane
                self._unused.append(match)
        if job.match is not None:
            self._known[request.request_id] = probe.local + job.tokens
            self._sources[request.request_id] = "disk" if job.match.needs_load else "host"
        self._report(request.request_id, loaded=job.tokens, why=job.reason)

    def _report(self, req_id: str, loaded: int, why: str = "") -> None:
        got = self._reports.get(req_id)
        if got is not None:
            self._reports[req_id] = dataclasses.replace(
                got, loaded=loaded, why=", ".join(w for w in (got.why, why) if w))

    def _plan(self, req_id: str, hashes: tuple[BlockHash, ...], local: int, target: int,
              match: Match | None, block_ids: Sequence[Sequence[int]]) -> LoadJob:
        if match is None:
            return self._fail(req_id, hashes, local, target, 0, "the leased lookup failed",
                              block_ids)
        usable = match.usable_tokens
        if usable < target:
            why = ", ".join(f"{d.reason.value}@{d.position}" for d in match.downgrades)
            return self._fail(req_id, hashes, local, target, usable,
                              f"hkv certifies {usable} of {target} tokens now ({why})", block_ids,
                              match)
        copies = load_copies(self.geo, self.layout, match, local, target, block_ids,
                             self.null_block)
        if isinstance(copies, str):
            return self._fail(req_id, hashes, local, target, 0, copies, block_ids)
        return LoadJob(req_id, hashes, match, copies, target - local)

    def _fail(self, req_id: str, hashes: tuple[BlockHash, ...], local: int, target: int,
              usable: int, why: str, block_ids: Sequence[Sequence[int]],
              match: Match | None = None) -> LoadJob:
        """The leased answer fell short of ``target``: the difference becomes load errors.
        One full-attention group keeps ``[local, usable)`` and reports the blocks past it;
        any other layout fails the whole load (vLLM recomputes it) and caps the next probe
        at ``usable``."""
        self.stats.add("alloc_shortfall")
        self._caps[req_id] = usable
        if self.block_errors and match is not None and usable > local:
            g = self.geo.groups[0]
            ids = block_ids[g.vllm_group]
            errors = tuple(ids[k] for k in range(usable // g.block_size, target // g.block_size))
            copies = load_copies(self.geo, self.layout, match, local, usable, block_ids,
                                 self.null_block)
            if not isinstance(copies, str):
                return LoadJob(req_id, hashes, match, copies, usable - local, why, errors)
        if self.block_errors:
            g = self.geo.groups[0]
            ids = block_ids[g.vllm_group]
            errors = tuple(ids[k] for k in range(local // g.block_size, target // g.block_size))
            return LoadJob(req_id, hashes, None, (), 0, why, errors)
        return LoadJob(req_id, hashes, None, (), 0, why)

    def _release(self, match: Match) -> None:
        try:
            assert match.lease_id is not None
            self.meta.release_lease(match.lease_id)
        except Exception as exc:  # it expires on its own
            log.debug("lease release failed: %s", exc)

    # -- step -------------------------------------------------------------------------------

    def take_jobs(self, scheduled: Mapping[str, int],
                  block_ids_of: Callable[[str], Sequence[Sequence[int]]],
                  handoffs: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
                  gone: Collection[str] = ()) -> tuple[tuple[LoadJob, ...], tuple[SaveJob, ...]]:
        """This step's jobs. ``scheduled`` maps each scheduled request to the tokens whose KV
        this step computes for sure (speculative ones left out); ``handoffs`` are this step's
        ``boundary_state_offloads`` (read now: vLLM drains them every step); ``gone`` the
        requests finished or preempted in it, whose blocks may already be another's: their
        hand-offs are dropped (a state saved from a reused block would be a wrong state
        under a valid key)."""
        handoffs = handoffs or {}
        self._submit()
        self._step += 1
        now = time.monotonic()
        self._step_s, self._step_at = now - self._step_at, now
        self._asked.clear()
        self._lane.check()
        for req_id, n in scheduled.items():
            request = self._requests.get(req_id)
            if request is None or n <= 0:
                continue
            end = request.num_computed_tokens + n
            states: tuple[SaveItem, ...] = ()
            if req_id in handoffs and req_id not in gone:
                states, dropped = state_items(self.geo, handoffs[req_id],
                                              request.num_computed_tokens, end, self.null_block)
                self.stats.add("state_handoffs", len(handoffs[req_id]))
                if dropped:
                    self.stats.add("state_handoffs_dropped", dropped)
            self._save(request, block_ids_of(req_id), end, states=states)
        for req_id, entries in handoffs.items():
            if req_id not in scheduled or req_id in gone:
                self.stats.add("state_handoffs", len(entries))
                self.stats.add("state_handoffs_dropped", len(entries))
        loads, saves = tuple(self._loads), tuple(self._saves)
        self._loads.clear()
        self._saves.clear()
        return loads, saves

    def _save(self, request: Request, block_ids: Sequence[Sequence[int]], end: int,
              held: bool = False, states: tuple[SaveItem, ...] = ()) -> bool:
        """A SaveJob for the whole blocks of ``[known, end)`` vLLM holds, and ``states``;
        True if any."""
        req_id = request.request_id
        if request.mm_features or request.prompt_embeds is not None:
            return False
        end = min(end, len(request.all_token_ids))  # no copy of the tokens unless saved
        known = self._known.get(req_id, 0)
        items = save_items(self.geo, block_ids, end, known, self.null_block) + states
        self._known[req_id] = max(known, end // self.geo.hash_block_size
                                  * self.geo.hash_block_size)
        if not items:
            return False
        hb = self.geo.hash_block_size
        # the prefix's tokens, not its hashes: the save lane hashes them off the step, and
        # BlockStored events carry them (routers key blocks by tokens)
        arr = np.asarray(request.all_token_ids[:end // hb * hb], dtype="<i4")
        self._saves.append(SaveJob(req_id, items, arr.tobytes(), self.extra_keys(request), held))
        return True

    def failed(self, req_ids: set[str]) -> None:
        """Loads the worker reported failed: recompute, and do not offer them again."""
        for req_id in req_ids:
            self._caps.setdefault(req_id, 0)
            self._known.pop(req_id, None)
            self._report(req_id, loaded=0, why="the load failed: recomputed")

    def received(self, req_ids: set[str]) -> None:
        """Loads the worker reported done (or failed): their blocks are the request's again."""
        self._loading -= req_ids

    def source(self, req_id: str) -> str | None:
        return self._sources.pop(req_id, None)

    # -- finish -----------------------------------------------------------------------------

    def finished(self, request: Request, block_ids: Sequence[Sequence[int]]
                 ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished_all_groups``: save what is still unsaved; hold the blocks until
        the worker is done with them."""
        req_id = request.request_id
        self._probes.pop(req_id, None)
        self._caps.pop(req_id, None)
        self._sources.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._asked.pop(req_id, None)
        for asks in (self._answered, self._pending):  # a probe still on the lane answers
            ask = asks.pop(req_id, None)  # no one: its lease goes back once it lands
            if ask is not None:
                self._drop(ask)
        if req_id in self._loading:  # vLLM holds its blocks for the load; nothing to save
            self._loading.discard(req_id)
            self.stats.add("finished_while_loading")
            held = False
        else:
            held = self._save(request, block_ids, request.num_computed_tokens, held=True)
        self._known.pop(req_id, None)
        report = self._reports.pop(req_id, None)
        if report is None:
            return held, None
        self.stats.add("requests_asked")
        if report.certified < report.asked and Reason.NO_STATE_AT_BOUNDARY.value in report.why:
            self.stats.add("requests_short_no_state")  # a shorter hit for want of a state
        return held, {"hkv": report.as_params()}

    def report(self, req_id: str) -> Certified | None:
        """The request's report so far (it goes out with the request's output)."""
        return self._reports.get(req_id)
