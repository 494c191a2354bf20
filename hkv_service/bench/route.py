"""``hkv bench route``: routing on hybrid models by (a) round robin, (b) raw block counts from
KV events, (c) hkv's usable-token answer (issue 39), in the same run.

N replicas, each with its own small cache: a state view of its own (the real allocator and
its per-kind eviction, the real funnel) with small pools. A multi-turn workload over a few
shared system prompts: each conversation's turn t is its turn t-1 prompt plus new blocks.
A replica that serves a request writes what it computed, as an engine does: every
full-attention and SWA block; a recurrent group's state at chunk ends (``state_every``
blocks, vLLM's "align" mode) and at the prompt's end. Its pools are small, SWA blocks and
states smaller still (an engine keeps few states: each is a whole history's summary), so
full-attention blocks outlive the window or state a resume needs beside them.

Requests arrive in rounds of N at once and a replica takes at most one per round (load: a
real router weighs it too), so each policy's second choice matters::

    (a) round robin    replica i of the round, in turn
    (b) block counts   per replica, the prompt's leading blocks its events say it stores in
                       the full-attention group (a router that keeps only full-attention
                       events, as Dynamo's does), highest first
    (c) hkv            per replica, ``core.resumable`` over its view: the tokens it can
                       certify for resuming, highest first; among replicas alike (none can
                       resume, say), (b)'s count (hkv's stream carries it too)

Remaining ties go to the replica with the fewest requests so far. Served on the chosen replica, a
request reuses what that replica's funnel certifies and recomputes the rest. Reported per
spec (``swa`` = full attention + SWA, ``recurrent`` = full attention + a GatedDeltaNet-style
state group): tokens recomputed and the share of requests routed to a replica where their
prefix was resumable (usable > 0), each against (a) in the same run; what one
``resumable`` answer cost (its lookups, microseconds); and prompts written per second into
a view with a KV event publisher running and a subscriber that never reads, against a view
without one (``writes_events_on_vs_off``: the writers only append to the log they always
did; the publisher's thread competes for the interpreter, never for the state lock long).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from ..core.api import AllocRequest, Params, PoolConfig
from ..core.errors import PoolExhausted
from ..core.ids import BlockHash, ShardId
from ..core.kvevents import ResidencyFeed
from ..core.layout import Layout
from ..core.resumable import resumable
from ..core.spec import CacheSpec, spec_from_dict
from ..core.state_view import CacheState
from ..core.states import Event, Kind

__all__ = ["run"]

H = 64
ABI = {"dtype": "float32", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "k1"}
FULL = {"name": "full", "kind": "COMPRESSED", "block_size": H, "ratio": 1, "abi": ABI}
SPECS: dict[str, dict[str, Any]] = {
    "swa": {"model_id": "route-swa", "hash_block_size": H, "groups": [
        FULL, {"name": "swa", "kind": "SWA", "block_size": H, "window": 2 * H, "abi": ABI}]},
    "recurrent": {"model_id": "route-gdn", "hash_block_size": H, "groups": [
        FULL, {"name": "gdn", "kind": "RECURRENT", "block_size": H, "state_kind": "GDN",
               "layers": 2, "state": [{"shape": [4, 8], "dtype": "float32"}],
               "abi": {"dtype": "float32", "layout": "conv-then-ssm", "head_shape": [2],
                       "kernel_version": "gdn-1"}}]},
}
OWNER = ShardId("replica")


@dataclass(frozen=True, slots=True)
class Workload:
    replicas: int = 4
    systems: int = 3  # shared system prompts
    system_blocks: int = 8
    conversations: int = 24
    turns: int = 5
    turn_blocks: int = 2  # blocks each turn adds
    pool_blocks: int = 48  # full-attention blocks per replica: a few conversations' worth
    swa_blocks: int = 16  # SWA blocks per replica (out-of-window ones go first)
    state_blocks: int = 4  # recurrent states per replica (each a whole history's summary)
    seed: int = 0
    # a recurrent state is kept every this many blocks (vLLM's "align" mode: at chunk ends)
    # and at the prompt's end
    state_every: int = 4


@dataclass(slots=True)
class Replica:
    view: CacheState
    feed: ResidencyFeed = field(default_factory=ResidencyFeed)
    full: set[BlockHash] = field(default_factory=set)  # full-attention blocks, from events
    served: int = 0

    def hear(self) -> None:
        """Apply this replica's KV events (the residency feed the stream publishes)."""
        col = self.view.layout.by_name["full"]
        while True:
            batch = self.view.poll_residency(self.feed)
            if batch.cleared:
                self.full.clear()
            for c in batch.changes:
                if c.column == col and c.medium != "DISK":
                    (self.full.add if c.stored else self.full.discard)(c.span[-1])
            if not batch.changes:
                return


def _chain(parent: bytes, label: bytes, n: int) -> list[BlockHash]:
    out = []
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + label + b"%d" % i)
        out.append(BlockHash(parent))
    return out


def _requests(w: Workload) -> list[list[BlockHash]]:
    """Rounds of turns: every conversation's turn t before any turn t + 1, interleaved."""
    systems = [_chain(b"root", b"system %d" % s, w.system_blocks) for s in range(w.systems)]
    prompts = [list(systems[c % w.systems]) for c in range(w.conversations)]
    out = []
    rng = random.Random(w.seed)
    for t in range(w.turns):
        order = list(range(w.conversations))
        rng.shuffle(order)  # conversations come back in their own time
        for c in order:
            prompts[c] = prompts[c] + _chain(prompts[c][-1], b"turn %d.%d" % (c, t),
                                             w.turn_blocks)
            out.append(list(prompts[c]))
    return out


_POOL: dict[Kind, Callable[[Workload], int]] = {
    Kind.COMPRESSED: lambda w: w.pool_blocks, Kind.SWA: lambda w: w.swa_blocks,
    Kind.STATE: lambda w: w.state_blocks}


def _replica(spec: CacheSpec, w: Workload) -> Replica:
    view = CacheState(spec)
    pools: dict[str, PoolConfig] = {
        c.name: PoolConfig(_POOL[c.kind](w), max(256, -(-c.nbytes // 256) * 256))
        for c in view.layout.columns}
    view.register_owner(OWNER, pools)
    r = Replica(view)
    r.hear()
    return r


def _serve(r: Replica, hashes: list[BlockHash], state_every: int) -> int:
    """Reuse what the replica certifies, write the rest as an engine does; tokens reused."""
    view, lay = r.view, r.view.layout
    usable = resumable(view.lookup, hashes, lay).tokens
    n = len(hashes)
    slots = [AllocRequest(d, c.name) for d in range(usable // H, n) for c in lay.columns
             if c.kind is not Kind.STATE or d == n - 1 or (d + 1) % state_every == 0]
    try:
        allocs = view.allocate(hashes, slots)
    except PoolExhausted:  # everything live is pinned: this request's blocks are not kept
        return usable
    for a in allocs:
        if not a.existing:
            view.transition(a.handle.object_id, Event.WRITE_DONE, Params())
    r.served += 1
    return usable


Score = Callable[[Replica, list[BlockHash]], Any]


def _count_score(r: Replica, hashes: list[BlockHash]) -> float:
    n = 0
    for h in hashes:
        if h not in r.full:
            break
        n += 1
    return n * H


def _hkv_score(r: Replica, hashes: list[BlockHash]) -> tuple[float, float]:
    """hkv's answer first; among replicas it ranks alike (none can resume, say), the one
    holding more of the prompt's blocks (the events' count: hkv publishes both), where
    writing the prompt back evicts the least."""
    return resumable(r.view.lookup, hashes, r.view.layout).tokens, _count_score(r, hashes)


def _ranker(score: Score, replicas: list[Replica], hashes: list[BlockHash]
            ) -> Callable[[int], tuple[Any, int, int]]:
    return lambda i: (score(replicas[i], hashes), -replicas[i].served, -i)


def _simulate(spec: CacheSpec, w: Workload, policy: str) -> dict[str, float]:
    replicas = [_replica(spec, w) for _ in range(w.replicas)]
    reqs = _requests(w)
    score: Score | None = {"round_robin": None, "block_counts": _count_score,
                           "hkv": _hkv_score}[policy]
    recomputed = prompt = resumable_n = 0
    for start in range(0, len(reqs), w.replicas):
        free = list(range(w.replicas))
        for hashes in reqs[start:start + w.replicas]:
            if score is None:
                pick = free[0]  # the next replica in turn (one request each a round)
            else:
                rank = _ranker(score, replicas, hashes)
                pick = max(free, key=rank)
            free.remove(pick)
            usable = _serve(replicas[pick], hashes, w.state_every)
            replicas[pick].hear()
            recomputed += len(hashes) * H - usable
            prompt += len(hashes) * H
            resumable_n += usable > 0
    return {"recomputed_tokens": recomputed, "prompt_tokens": prompt,
            "resumable_share": resumable_n / len(reqs), "requests": len(reqs)}


def _answer_cost(spec: CacheSpec, w: Workload) -> dict[str, float]:
    """Microseconds per ``resumable`` answer on a warm replica, and lookups per answer."""
    r = _replica(spec, w)
    reqs = _requests(w)[: 2 * w.conversations]
    for h in reqs:
        _serve(r, h, w.state_every)
    t0, lookups = time.perf_counter(), 0
    for h in reqs:
        lookups += resumable(r.view.lookup, h, r.view.layout).lookups
    dt = time.perf_counter() - t0
    return {"resumable_us": dt / len(reqs) * 1e6, "lookups_per_answer": lookups / len(reqs)}


def _write_rate(spec: CacheSpec, prompts: int, publish: bool) -> tuple[float, dict[str, int]]:
    """Prompts written (allocate + commit, every column) per second into one view, with a
    KV event publisher running and a subscriber that never reads (``publish``), or none."""
    import zmq

    from ..server.kvevents import KvEventPublisher, KvEventsConfig
    from ..server.tokenbook import TokenBook
    from ..testing import commit_prefix, pools_for, prompt_hashes

    view = CacheState(spec)
    view.register_owner(OWNER, pools_for(view.layout, prompts * 16 + 64))
    chains = [prompt_hashes(spec, 16, seed=i) for i in range(prompts)]
    pub = ctx = None
    if publish:
        pub = KvEventPublisher(view, KvEventsConfig("127.0.0.1", 0, hwm=1000),
                               TokenBook(spec.hash_block_size), view.partition)
        ctx = zmq.Context()
        stalled = ctx.socket(zmq.SUB)  # connected, subscribed, never read
        stalled.setsockopt(zmq.SUBSCRIBE, b"")
        stalled.setsockopt(zmq.RCVHWM, 10)
        stalled.connect(pub.endpoint)
        time.sleep(0.2)
    t0 = time.perf_counter()
    for chain in chains:
        commit_prefix(view, chain, OWNER)
    dt = time.perf_counter() - t0
    stats: dict[str, int] = {}
    if pub is not None and ctx is not None:
        time.sleep(0.3)
        stats = dict(pub.stats)
        pub.close()
        ctx.destroy(0)
    return prompts / dt, stats


def run(quick: bool = False) -> dict[str, Any]:
    w = Workload(conversations=16, turns=4) if quick else Workload()
    figures: dict[str, float] = {}
    baseline: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for name, raw in SPECS.items():
        spec = spec_from_dict(raw)
        Layout(spec)  # (a spec that does not lay out fails here, not mid-run)
        res = {p: _simulate(spec, w, p) for p in ("round_robin", "block_counts", "hkv")}
        rr = res["round_robin"]
        baseline[f"{name}_round_robin_recomputed_tokens"] = rr["recomputed_tokens"]
        baseline[f"{name}_round_robin_resumable_share"] = rr["resumable_share"]
        for p in ("block_counts", "hkv"):
            figures[f"{name}_{p}_recomputed_tokens"] = res[p]["recomputed_tokens"]
            figures[f"{name}_{p}_resumable_share"] = res[p]["resumable_share"]
            ratios[f"{name}_{p}_recomputed_vs_round_robin"] = (
                res[p]["recomputed_tokens"] / max(1, rr["recomputed_tokens"]))
            ratios[f"{name}_{p}_resumable_share_vs_round_robin"] = (
                res[p]["resumable_share"] / max(1e-9, rr["resumable_share"]))
        ratios[f"{name}_hkv_recomputed_vs_block_counts"] = (
            res["hkv"]["recomputed_tokens"] / max(1, res["block_counts"]["recomputed_tokens"]))
        figures[f"{name}_prompt_tokens"] = rr["prompt_tokens"]
        figures[f"{name}_requests"] = rr["requests"]
        for k, v in _answer_cost(spec, w).items():
            figures[f"{name}_{k}"] = v
    # a slow subscriber never slows the service: writes with the publisher on and a stalled
    # subscriber, against none, alternated (the same machine noise on both)
    spec = spec_from_dict(SPECS["swa"])
    n = 40 if quick else 200
    off, on = [], []
    for _ in range(3):
        off.append(_write_rate(spec, n, False)[0])
        rate, stats = _write_rate(spec, n, True)
        on.append(rate)
    figures["writes_per_s_events_on"] = sorted(on)[1]
    baseline["writes_per_s_events_off"] = sorted(off)[1]
    ratios["writes_events_on_vs_off"] = sorted(on)[1] / sorted(off)[1]
    figures["events_published"] = stats.get("events", 0)
    return {"name": "route", "quick": quick, "workload": vars_of(w), "figures": figures,
            "baseline": baseline, "ratios": ratios}


def vars_of(w: Workload) -> dict[str, int]:
    return {k: getattr(w, k) for k in w.__dataclass_fields__}
