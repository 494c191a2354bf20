"""End to end on the in-process wiring of the real parts (metadata view, ShardActors, their
LMDB tiers, the data plane), every fault on.

Reused state must give exactly the logits of a full recompute (zero silent errors), on two
seeds; each fault is injected and produces its downgrade; each planted bug (layer 3 off in the
core, the shard's read re-check skipped) makes the same check find silent errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from hkv_service.core.hashing import hash_blocks
from hkv_service.core.layout import Layout
from hkv_service.demo.backend import DemoBackend, place_column
from hkv_service.demo.faults import DEFAULT_RATES, EXPECTED, FaultPlan, FaultSpecError, parse_faults
from hkv_service.demo.run import _shapes, run_long_prompts, run_workload
from hkv_service.demo.wiring import InProcessWiring
from hkv_service.demo.worker import Totals, Worker
from hkv_service.demo.workload import long_prompt_workload
from hkv_service.refmodel import BlockRun, RefModel
from hkv_service.specs import default_spec, demo_spec

# every fault, with the rare ones raised so a short run sees each of them
# (a stalled tail or a stale indexer shows only to a later reader resuming right there, before
# pool pressure evicts it: they are raised most)
RATES = {**DEFAULT_RATES, "shard_kill": 0.1, "service_restart": 0.1, "partial_tail": 1.0,
         "stale_indexer": 0.6, "disk_bitflip": 0.4, "abi_mismatch": 0.2,
         "state_off_boundary": 0.4, "state_dtype": 0.4}
REQUESTS = 120


# (seed 7 left when the demo's spec gained the recurrent layer: its STATE objects move the
# schedule, and at seed 7 no reader met a misaligned copy before it aged out; 8 and 9 checked)
@pytest.fixture(scope="module", params=[6, 8], ids=["seed6", "seed8"])
def faulty(request: pytest.FixtureRequest) -> dict[str, Any]:
    rep = run_workload(requests=REQUESTS, seed=request.param, faults=RATES, check=True,
                       workers=1)
    assert rep["backend"] == "inprocess"
    return rep


def test_no_silent_errors_under_every_fault(faulty: dict[str, Any]) -> None:
    assert faulty["checked"] == faulty["requests"] == REQUESTS
    assert faulty["silent_errors"] == 0
    assert faulty["service_restarts"] > 0  # the real rejoin path ran


def test_each_fault_injected_and_downgraded(faulty: dict[str, Any]) -> None:
    for name in DEFAULT_RATES:
        assert faulty["faults_injected"].get(name, 0) > 0 or name == "pool_pressure", name
        assert faulty["faults_expected"][name]["seen"] > 0, (name, EXPECTED[name], faulty)


def test_reuse_stays_substantial(faulty: dict[str, Any]) -> None:
    # raised fault rates here; at the default rates (`--faults all`) it is >= 0.90
    assert faulty["reuse_efficiency"] >= 0.5
    # Of all prompt tokens, at these rates: 0.13-0.39 seen. Since shards keep their memory
    # across a service restart, the odd shard's misaligned copies last longer and block their
    # slots (a misaligned copy is not replaced: issue 19's note), so this is lower than the
    # 0.15-0.3 it was when a restart emptied every shard.
    assert faulty["reused_tokens"] >= 0.10 * faulty["prompt_tokens"]


def test_no_faults_reuses_everything_safe() -> None:
    rep = run_workload(requests=24, seed=1, faults="none", check=True, workers=2)
    assert rep["silent_errors"] == 0
    assert rep["reuse_efficiency"] >= 0.99
    assert rep["reused_tokens"] >= 0.4 * rep["prompt_tokens"]
    # a state at every resume point: no request is ever short of one
    assert rep["recurrent_state"]["requests_short_of_state"] == 0


def test_states_kept_only_at_each_prompts_end_cost_shared_prefixes() -> None:
    # vLLM's align mode keeps one state per prompt, at its last boundary: a request sharing
    # only a shorter prefix (a RAG document under another question) finds no state there and
    # resumes at a shorter one (issue 37 item 3; the same workload as the test above)
    rep = run_workload(requests=24, seed=1, faults="none", check=True, workers=2,
                       states="last")
    rs = rep["recurrent_state"]
    assert rep["silent_errors"] == 0
    assert rs["retention"] == "last" and rs["requests_short_of_state"] > 0
    assert rep["fallbacks"].get("NO_STATE_AT_BOUNDARY", 0) >= rs["requests_short_of_state"]
    assert rs["tokens_short"] >= 128 * rs["requests_short_of_state"]


def test_a_wrong_state_is_refused_and_the_reader_resumes_short() -> None:
    rep = run_workload(requests=24, seed=3, faults={"state_off_boundary": 0.5,
                                                    "state_dtype": 0.5}, check=True, workers=1)
    assert rep["silent_errors"] == 0 and rep["checked"] == 24
    injected = rep["faults_injected"]
    assert injected.get("state_off_boundary", 0) > 0 and injected.get("state_dtype", 0) > 0
    rs = rep["recurrent_state"]
    assert rs["states_refused"] == injected["state_off_boundary"] + injected["state_dtype"]
    assert rep["fallbacks"].get("NO_STATE_AT_BOUNDARY", 0) > 0
    assert rs["resumed_shorter"] > 0


@pytest.mark.usefixtures("state_boundary_unchecked")
def test_state_boundary_check_skipped_is_caught() -> None:
    rep = run_workload(requests=24, seed=3, faults={"state_off_boundary": 1.0}, check=True,
                       workers=1)
    assert rep["faults_injected"]["state_off_boundary"] > 0
    assert rep["recurrent_state"]["states_refused"] == 0
    assert rep["silent_errors"] > 0


@pytest.mark.usefixtures("layer3_off")
def test_layer3_off_in_the_core_is_caught() -> None:
    # one worker: the interleaving (and so the count) is the same every run
    rep = run_workload(requests=48, seed=3, faults=RATES, check=True, workers=1)
    assert rep["silent_errors"] > 0


@pytest.mark.usefixtures("read_check_skipped")
def test_shard_read_check_skipped_is_caught() -> None:
    rep = run_workload(requests=32, seed=3, faults={"evict_race": 0.6}, check=True, workers=1)
    assert rep["faults_injected"]["evict_race"] > 0
    assert rep["silent_errors"] > 0


def test_parse_faults() -> None:
    assert parse_faults("none") == {}
    assert set(parse_faults("all")) == set(DEFAULT_RATES)
    assert parse_faults("evict_race=0.2,stale_indexer") == {
        "evict_race": 0.2, "stale_indexer": DEFAULT_RATES["stale_indexer"]}
    for bad in ("nope", "evict_race=2", "evict_race=x"):
        with pytest.raises(FaultSpecError):
            parse_faults(bad)


def _hkv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hkv_service.cli", "demo", *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_json_prints_one_object() -> None:
    out = _hkv("--json", "--check", "--requests", "12", "--faults", "all")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    for key in ("requests", "prompt_tokens", "reused_tokens", "recomputed_tokens",
                "silent_errors", "fallbacks", "transitions", "faults_injected"):
        assert key in rep
    assert rep["requests"] == 12 and rep["silent_errors"] == 0


def test_cli_bad_faults_exit_2() -> None:
    out = _hkv("--faults", "meteor_strike")
    assert out.returncode == 2
    assert "unknown fault" in out.stderr and out.stdout == ""


# ---- realistic prompt lengths and the batched read path --------------------------------------


def test_long_prompts_resume_the_whole_document_exactly() -> None:
    rep = run_long_prompts(prefix=2048, resumed=2, seed=4, check=True)
    assert rep["requests"] == 3 and rep["checked"] == 2  # the cold request has nothing to check
    assert rep["silent_errors"] == 0
    cold, *resumed = rep["per_request"]
    assert cold["reused_tokens"] == 0
    assert [r["reused_tokens"] for r in resumed] == [2048, 2048]
    assert rep["reuse_efficiency"] == 1.0


def test_read_hands_each_column_over_as_one_run() -> None:
    spec = demo_spec()
    model = RefModel(spec)
    be = DemoBackend(InProcessWiring(spec, 64), _shapes(model))
    try:
        w = Worker(model, be, FaultPlan({}, 0), check=True)
        totals = Totals()
        for req in long_prompt_workload(640, 1, seed=2).requests:
            w.run(req, totals)
        assert totals.silent_errors == 0 and totals.reused_tokens == 640
        req = long_prompt_workload(640, 0, seed=2).requests[0]
        hashes = hash_blocks(req.tokens, w.layout.hash_block, w.extra)
        lk = be.lookup(hashes, 640)
        res = be.read(lk)
        be.release(lk)
        assert res.ok and res.blocks is not None and res.tails is not None
        # every c4/idx block (64 tokens), every c128 block (128), the swa blocks of the window
        want = {"c4": range(10), "idx": range(10), "c128": range(5), "swa": range(8, 10)}
        for group, ks in want.items():
            run = res.blocks[group]
            assert isinstance(run, BlockRun) and list(run) == list(ks), group
        # the recurrent state as of exactly 640, nothing else of its group
        assert set(res.states) == {"gla"} and "gla" not in res.blocks
        assert torch.equal(res.states["gla"], model.export_state(
            model.prefill(torch.from_numpy(req.tokens[:640]))[1], "gla"))
        cache = model.import_cache(640, res.blocks, res.tails, res.states)
        logits, _ = model.extend(cache, torch.from_numpy(req.tokens[640:]))
        assert torch.equal(logits, model.forward_full(torch.from_numpy(req.tokens))[640:])
    finally:
        be.close()


def test_place_column_files_gaps_block_by_block() -> None:
    lay = Layout(default_spec())
    col = lay.columns[lay.by_name["c4"]]
    arrays = [np.full((16, 2, 16), d, np.float32) for d in (0, 1, 3)]
    blocks: dict[str, Any] = {}
    place_column(blocks, {}, lay, col, [0, 1, 3], arrays, 256)
    assert isinstance(blocks["c4"], dict) and sorted(blocks["c4"]) == [0, 1, 3]
    assert float(blocks["c4"][3][0, 0, 0]) == 3.0
    place_column(blocks, {}, lay, col, [0, 1, 2], arrays, 256)
    assert isinstance(blocks["c4"], BlockRun) and blocks["c4"].first == 0
    assert not np.shares_memory(blocks["c4"].stacked.numpy(), arrays[0])  # one copy, owned


def test_a_shard_two_workers_kill_before_either_reads_is_killed_once() -> None:
    # regression: with two workers, both lookups matched blocks of one shard and both rolled
    # shard_kill before either read revived it; the second kill met the dead link's closed
    # executor ("cannot schedule new futures after shutdown") and ended the run (seen at
    # test_all_ten_faults_land_at_the_default_request_count[3] and on the base commit)
    spec = demo_spec()
    model = RefModel(spec)
    be = DemoBackend(InProcessWiring(spec, 64), _shapes(model))
    try:
        w = Worker(model, be, FaultPlan({}, 0), check=False)
        req = long_prompt_workload(256, 0, seed=2).requests[0]
        w.run(req, Totals())
        hashes = hash_blocks(req.tokens, w.layout.hash_block, w.extra)
        first, second = be.lookup(hashes, 256), be.lookup(hashes, 256)
        assert first.usable == second.usable == 256
        assert be.inject_shard_kill(first)
        assert not be.inject_shard_kill(second)  # already down: nothing more to inject
        assert be.read(first).reason == "OWNER_LOST"  # the read revives it, cold
        assert be.read(second).reason in ("OWNER_LOST", "STALE_HANDLE")
        for lk in (first, second):
            be.release(lk)
        again = be.lookup(hashes, 256)  # revived (cold): the disk copies serve after a load
        assert again.match.needs_load or again.usable == 256
        be.release(again)
    finally:
        be.close()
