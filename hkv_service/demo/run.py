"""``hkv demo``: drive the reference-model workload through hkv and report.

Wiring choice (``--backend``, a setting of ``settings.DemoSettings``): ``system`` or
``inprocess`` (``wiring.py``); the same backend and the same real shards, disk tiers and data
plane run on both, and every fault is injected on both. ``hkv demo`` defaults to the embedded
system, and when it cannot start says so on stderr and runs in-process; a wiring asked for by
name that cannot start is an error. ``run_workload`` defaults to in-process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import queue
import sys
import threading
import time
from typing import Any, TextIO

import torch

from hkv_service.core.errors import InvalidInput
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import check_range_blocks
from hkv_service.refmodel import RefModel
from hkv_service.settings import DemoSettings, SettingsError
from hkv_service.specs import RECURRENT_SPEC, demo_spec

from .backend import DemoBackend
from .faults import EXPECTED, OPPORTUNITY, FaultPlan, FaultSpecError, parse_faults
from .worker import STATE_RETENTION, Totals, Worker
from .workload import long_prompt_workload, make_workload

__all__ = ["run_demo", "run_long_prompts", "run_workload"]

NORMAL_POOL = 192  # blocks per column per shard; long prompts spill to disk
PRESSURE_POOL = 96  # pool_pressure: constant eviction


def _shapes(model: RefModel) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for g in model.spec.groups:
        shapes[g.name] = model.block_shape(g.name)
        if g.kind.value == "COMPRESSED" and g.tail_tokens_max:
            # a TAIL object at a resume point: its overlap rows (groups without one have none)
            shapes[f"{g.name}.tail"] = (g.tail_tokens_max, *g.abi.head_shape)
    return shapes


def pool_pressure_on(rates: dict[str, float]) -> bool:
    return rates.get("pool_pressure", 0.0) > 0.0


def make_backend(model: RefModel, rates: dict[str, float], note: Any = None,
                 backend: str | None = None, partitions: int = 1, range_blocks: int = 0
                 ) -> DemoBackend:
    """The backend on the wiring ``backend`` names (``system`` or ``inprocess``); None: the
    system, or in-process with a note when it cannot start."""
    from .wiring import InProcessWiring, SystemWiring, Wiring

    if backend not in (None, "system", "inprocess"):
        raise FaultSpecError(f"the demo's backend must be 'inprocess' or 'system', "
                             f"got {backend!r}")
    choice = backend or "system"
    # asked for by name: a system that cannot start is an error, never a silent run on the
    # other wiring; only the default falls back, and says so
    asked = backend is not None
    pool = PRESSURE_POOL if pool_pressure_on(rates) else NORMAL_POOL
    odd = rates.get("misaligned_handle", 0.0) > 0
    wiring: Wiring | None = None
    if choice == "system":
        try:
            wiring = SystemWiring(model.spec, pool, odd, emit=note, partitions=partitions,
                                  range_blocks=range_blocks, spec_file=RECURRENT_SPEC)
        except Exception as err:
            if asked:
                raise
            if note is not None:
                note(f"the system backend could not start ({type(err).__name__}: "
                     f"{str(err).splitlines()[0] if str(err) else ''}); running in-process")
    if wiring is None:
        wiring = InProcessWiring(model.spec, pool, odd, partitions, range_blocks)
    return DemoBackend(wiring, _shapes(model))


def run_workload(
    requests: int = 48,
    seed: int = 0,
    faults: str | dict[str, float] = "none",
    check: bool = True,
    workers: int = 2,
    duration: float | None = None,
    progress: Any = None,
    backend: str | None = "inprocess",
    partitions: int = 1,
    range_blocks: int = 0,
    states: str = "every",
) -> dict[str, Any]:
    """The demo's workload through hkv; ``states``: which resume points the workers write
    recurrent states at (``worker.STATE_RETENTION``: every one, or each prompt's last)."""
    if states not in STATE_RETENTION:
        raise FaultSpecError(f"states must be one of {STATE_RETENTION}, got {states!r}")
    rates = parse_faults(faults) if isinstance(faults, str) else dict(faults)
    spec = demo_spec()
    model = RefModel(spec)
    be = make_backend(model, rates, progress, backend, partitions, range_blocks)
    plan = FaultPlan(rates, seed, requests)
    if pool_pressure_on(rates):
        plan.count("pool_pressure")  # it is the whole run's pools (make_backend sized them)
    wl = make_workload(requests, seed, vocab=model.config.vocab)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // max(1, workers)))
    totals = Totals()
    todo: queue.Queue[Any] = queue.Queue()
    for r in wl.requests:
        todo.put(r)
    start = time.perf_counter()
    errors: list[BaseException] = []

    def loop() -> None:
        w = Worker(model, be, plan, check, states)
        while True:
            if duration is not None and time.perf_counter() - start > duration:
                return
            try:
                req = todo.get_nowait()
            except queue.Empty:
                return
            try:
                w.run(req, totals)
            except BaseException as err:
                errors.append(err)
                return
            if progress is not None and totals.requests % 8 == 0:
                progress(f"{totals.requests}/{len(wl.requests)} requests, "
                         f"reused {totals.reused_tokens}/{totals.prompt_tokens} tokens")

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    try:
        st = be.stats()
    finally:
        be.close()
    if errors:
        raise errors[0]
    rep = _report(totals, plan, st, elapsed, rates)
    rep["recurrent_state"]["retention"] = states
    rep["partitions"] = partitions
    rep["range_blocks"] = range_blocks
    return rep


def run_long_prompts(prefix: int, resumed: int, seed: int = 0, check: bool = True
                     ) -> dict[str, Any]:
    """Requests at realistic prompt lengths through the in-process wiring, one at a time.

    A document of ``prefix`` tokens is asked about ``resumed + 1`` times (see
    :func:`long_prompt_workload`): the first request computes it cold, the others resume from
    what it wrote back. The pools hold the whole document (a deployment sizes them for its
    working set), so the resumed requests read memory copies; the write-through disk tier is
    on as in the demo. With ``check`` every resumed request is also recomputed from scratch
    (``full_s``) and compared with the cached run's logits (the cold one reuses nothing and
    is not checked).
    """
    spec = demo_spec()
    model = RefModel(spec)
    wl = long_prompt_workload(prefix, resumed, seed, vocab=model.config.vocab)
    depths = sum(len(r.tokens) for r in wl.requests) // spec.hash_block_size + len(wl.requests)
    from .wiring import InProcessWiring

    be = DemoBackend(InProcessWiring(spec, depths + 64), _shapes(model))
    plan = FaultPlan({}, seed)
    # one thread, as each demo worker has: another process on a shared machine cannot then
    # stall a parallel region (two threads made a 1 s prefill take 18 s under load)
    torch.set_num_threads(1)
    totals = Totals()
    start = time.perf_counter()
    try:
        # the first request has nothing to reuse: it is not checked against itself
        Worker(model, be, plan, False).run(wl.requests[0], totals)
        # What a long-running Python worker does after warm-up: move the long-lived heap
        # (model, cache state) out of the collector's sight. Otherwise a full collection of it
        # lands in whichever phase is running (the bench once printed a 74 ms transfer
        # average against ~6 ms).
        gc.collect()
        gc.freeze()
        w = Worker(model, be, plan, check)
        for req in wl.requests[1:]:
            w.run(req, totals)
        elapsed = time.perf_counter() - start
        st = be.stats()
    finally:
        gc.unfreeze()
        be.close()
    return _report(totals, plan, st, elapsed, {})


def _report(totals: Totals, plan: FaultPlan, st: dict[str, Any], elapsed: float,
            rates: dict[str, float]) -> dict[str, Any]:
    transitions: dict[str, dict[str, int]] = {}
    for key, n in st["transitions"].items():
        kind, _, state = key.partition(":")
        transitions.setdefault(kind, {})[state] = n
    expected = {}
    for name in sorted(rates):
        want = EXPECTED[name]
        if want == "EVICTED":
            seen = sum(s.get("EVICTED", 0) for s in transitions.values())
        else:
            seen = totals.fallbacks.get(want, 0)
        expected[name] = {"reason": want, "seen": seen}
    return {
        "requests": totals.requests,
        "prompt_tokens": totals.prompt_tokens,
        "reused_tokens": totals.reused_tokens,
        "recomputed_tokens": totals.recomputed_tokens,
        "oracle_reusable_tokens": totals.oracle_tokens,
        "reuse_efficiency": round(totals.reused_tokens / totals.oracle_tokens, 4)
        if totals.oracle_tokens else 1.0,
        "checked": totals.checked,
        "silent_errors": totals.silent_errors,
        "fallbacks": dict(sorted(totals.fallbacks.items())),
        "transitions": transitions,
        "faults_injected": dict(sorted(plan.injected.items())),
        "faults_missing": {name: f"needs {OPPORTUNITY[name]}: none came from its turn "
                                 f"(request {plan.turn[name] + 1} of {totals.requests}) on"
                           for name in plan.missing()},
        "faults_expected": expected,
        "recurrent_state": _state_report(totals, st),
        "time_s": {k: round(v, 4) for k, v in sorted(totals.time_s.items())},
        "elapsed_s": round(elapsed, 3),
        "backend": st.get("backend"),
        "disk": st.get("disk"),
        "service_restarts": st.get("restarts", 0),
        "per_request": totals.per_request,
    }


def _state_report(totals: Totals, st: dict[str, Any]) -> dict[str, Any]:
    """Issue 37 item 3: how often a request resumed at a shorter prefix, or recomputed all,
    because the funnel found no recurrent state at a longer boundary (NO_STATE_AT_BOUNDARY),
    and how many tokens that cost (the boundary without a state minus what was reused)."""
    short = [r for r in totals.per_request if r["no_state_at"] > r["reused_tokens"]]
    return {
        "requests_short_of_state": len(short),
        "resumed_shorter": sum(1 for r in short if r["reused_tokens"] > 0),
        "recomputed_all": sum(1 for r in short if r["reused_tokens"] == 0),
        "tokens_short": sum(r["no_state_at"] - r["reused_tokens"] for r in short),
        "states_refused": int(st.get("events", {}).get("state_refused", 0)),
    }


def _summary(rep: dict[str, Any]) -> str:
    lines = [
        f"hkv demo: {rep['requests']} requests on the {rep['backend']} backend "
        f"(disk tier: {rep['disk']}) in {rep['elapsed_s']:.1f} s",
        f"  prompt tokens     {rep['prompt_tokens']}",
        f"  reused tokens     {rep['reused_tokens']} "
        f"({rep['reused_tokens'] / max(1, rep['prompt_tokens']):.1%} of prompt; "
        f"{rep['reuse_efficiency']:.1%} of what was safely reusable)",
        f"  recomputed tokens {rep['recomputed_tokens']}",
        f"  silent errors     {rep['silent_errors']}"
        + ("" if rep["checked"] else "  (not checked; pass --check)"),
    ]
    if rep["fallbacks"]:
        lines.append("  fallbacks         " + ", ".join(f"{k}={v}" for k, v in
                                                         rep["fallbacks"].items()))
    if rep["faults_injected"]:
        lines.append("  faults injected   " + ", ".join(f"{k}={v}" for k, v in
                                                         rep["faults_injected"].items()))
    for name, why in rep["faults_missing"].items():
        lines.append(f"  fault missing     {name}: {why}")
    rs = rep["recurrent_state"]
    lines.append(f"  no state at a longer boundary: {rs['requests_short_of_state']} requests "
                 f"({rs['resumed_shorter']} resumed shorter, {rs['recomputed_all']} recomputed "
                 f"all; {rs['tokens_short']} tokens); states refused at write "
                 f"{rs['states_refused']}")
    t = rep["time_s"]
    lines.append(f"  time (s)          lookup {t.get('lookup', 0):.3f}  transfer "
                 f"{t.get('transfer', 0):.3f}  compute {t.get('compute', 0):.3f}  "
                 f"write-back {t.get('writeback', 0):.3f}")
    return "\n".join(lines)


def _json_stdout() -> TextIO:
    """With ``--json`` stdout carries exactly one JSON object: from here on file descriptor 1
    points at stderr, so whatever else writes there (Ray's log lines, from this process or
    the ones it starts, which inherit it, until the very end) goes to stderr. Returns the
    real stdout, for the object."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return real


def run_demo(args: argparse.Namespace) -> int:
    def note(msg: str) -> None:
        sys.stderr.write(f"hkv demo: {msg}\n")

    try:
        cfg = DemoSettings.from_args(args)
    except SettingsError as err:
        sys.stderr.write(f"hkv: error: {err}.\n")
        return 2
    try:
        rates = parse_faults(cfg.faults)
    except FaultSpecError as err:
        sys.stderr.write(f"hkv: error: {err}.\n")
        return 2
    try:
        check_range_blocks(cfg.range_blocks, Layout(demo_spec()).period)
    except InvalidInput as err:
        sys.stderr.write(f"hkv: error: --range-blocks: {err}.\n")
        return 2
    out = _json_stdout() if cfg.json else sys.stdout
    try:
        rep = run_workload(cfg.requests, cfg.seed, rates, cfg.check, cfg.workers,
                           cfg.duration, note, backend=cfg.backend,
                           partitions=cfg.service_replicas, range_blocks=cfg.range_blocks)
    except FaultSpecError as err:
        sys.stderr.write(f"hkv: error: {err}.\n")
        return 2
    rep.pop("per_request", None)
    text = json.dumps(rep, sort_keys=True) if cfg.json else _summary(rep)
    out.write(text + "\n")
    out.flush()  # before interpreter teardown (ray/grpc threads) can lose a pipe buffer
    return 1 if cfg.check and rep["silent_errors"] else 0
