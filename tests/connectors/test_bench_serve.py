"""``hkv bench serve --quick`` as CI runs it: real ``vllm serve`` replicas with and without
hkv (one ``hkv up``) under 8 clients; the report's fields, and that every request's output at
temperature 0 is the same with hkv as without (or differs only at a near-tie).

A subprocess (``python -m hkv_service.cli``), as a user runs it; it starts and stops its own
processes. 4-6 minutes on 2 loaded cores (five engine starts, four of them at once), hence
slow."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hkv_service.bench.serve import Workload


@pytest.mark.slow
def test_quick_serve_bench_reports_every_figure_and_hkv_changes_no_output() -> None:
    done = subprocess.run([sys.executable, "-m", "hkv_service.cli", "bench", "serve",
                           "--quick", "--json", "--vllm-python", sys.executable],
                          capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout)
    assert report["name"] == "serve" and report["quick"] is True
    w = Workload.of(quick=True)
    figures, alone = report["figures"], report["baseline"]["vllm_alone"]
    runs = {"hkv": figures["with_hkv"], "alone": alone}
    assert figures["rounds"] == 1 and len(figures["ratios_by_round"]) == 1  # --quick
    sizes = {"shared_prefix": w.conversations * w.turns, "no_reuse": w.no_reuse_requests}
    for name, run in runs.items():
        for wl, n in sizes.items():
            got = run[wl]
            assert got["requests"] == n, (name, wl, got)
            for k in ("ttft_p50_s", "ttft_p99_s", "requests_per_s", "output_tokens_per_s"):
                assert got[k] > 0 and math.isfinite(got[k]), (name, wl, k, got)
            assert got["ttft_p50_s"] <= got["ttft_p99_s"]
            # vLLM counted every prompt token the clients sent (its /metrics, both engines)
            assert got["prompt_tokens"] >= n * w.doc_tokens, (name, wl, got)
        assert run["no_reuse"]["hkv_hit_tokens"] == 0  # nothing to reuse
        assert run["no_reuse"]["local_prefix_hit_tokens"] == 0
    assert alone["shared_prefix"]["hkv_hit_tokens"] == 0  # no connector there
    sp = figures["with_hkv"]["shared_prefix"]
    # The engines hold a quarter of the working set: hkv serves a good part of the prompts.
    assert sp["hkv_hit_tokens"] > 0 and 0 < figures["hkv_share_shared_prefix"] <= 1
    assert sp["connector"]["loaded_tokens"] == sp["hkv_hit_tokens"], sp["connector"]
    assert figures["outputs_compared"] == sum(sizes.values())
    # Every output is the same with hkv as alone, but where greedy decoding met a near-tie
    # (float noise of KV computed in another batch can flip it; vLLM's prefix cache does the
    # same) or a later turn follows an earlier answer that flipped: none unexplained.
    assert figures["outputs_differing_unexplained"] == 0, figures["outputs_differing"]
    assert figures["outputs_identical"] + len(figures["outputs_differing"]) \
        == figures["outputs_compared"]
    for name, run in runs.items():  # the logprobs came back: the margins are real numbers
        for wl in sizes:
            assert 0 <= run[wl]["min_top2_margin"] < 100, (name, wl, run[wl])
    for key in ("shared_prefix_ttft_p50", "shared_prefix_ttft_p99",
                "shared_prefix_requests_per_s", "no_reuse_requests_per_s",
                "no_reuse_output_tokens_per_s"):
        assert report["ratios"][key] > 0, key
    assert figures["ratios_by_round"][0] == report["ratios"]  # one round: the same ratios
    # Replica i's model ran on core i in both configurations (left to vLLM, a connector
    # engine gets another thread layout than a plain one).
    binding = figures["engine_cpu_binding"]
    assert binding["alone"] == binding["hkv"] and None not in binding["hkv"], binding
    assert len(set(binding["hkv"])) == 2, binding  # one core each, not one shared
    assert set(figures["targets"].values()) <= {True, False}
    assert "not run" in figures["native_cpu_offload"]
