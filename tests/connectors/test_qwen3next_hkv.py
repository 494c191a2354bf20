"""The proof with a real engine: a ``vllm.LLM`` on CPU running the tiny Qwen3-Next (GatedDeltaNet
+ full attention) with hkv in process resumes from hkv's recurrent states bit for bit, and
never gives a different logprob after a fault. ``qwen3next_hkv.py`` runs the engines (one
subprocess for the module: vLLM keeps process-wide state; three engine starts, about 2-4
minutes on 2 busy cores) and returns the figures asserted here.

"Bit-identical" is against a baseline engine without hkv that resumes at the same boundary
(align mode splits a prefill where it resumes, and a bf16 prefill split elsewhere gives
other logits: docs/vllm-recurrent-state.md), for every generated step's logprobs of the
whole vocabulary (1,024) and the 16 greedy tokens.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
BLOCK_FP32, BLOCK_BF16 = 96, 64  # vLLM's block: the SSM state is fp32 on AVX-512-BF16 hosts


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("qwen3next-hkv")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE)]))
    proc = subprocess.run([sys.executable, str(HERE / "qwen3next_hkv.py"), str(work)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _resume(run: dict[str, Any]) -> tuple[int, int]:
    """(the full prompt's resume point, the shorter prompt's) for vLLM's block size here."""
    bs = run["spec"]["groups"][-1]["block_size"]
    assert bs in (BLOCK_FP32, BLOCK_BF16)
    n = run["prompt"] + run["suffix"]
    return (n - 1) // bs * bs, (run["short"] - 1) // bs * bs


def test_hkv_maps_the_gdn_groups_to_recurrent_groups(run: dict[str, Any]) -> None:
    groups = run["spec"]["groups"]
    assert [g["kind"] for g in groups] == ["RECURRENT"] * 3 + ["COMPRESSED"]
    ssm = "float32" if groups[0]["block_size"] == BLOCK_FP32 else "bfloat16"
    for g in groups[:3]:
        assert g["state_kind"] == "GDN_ATTN" and g["layers"] == 1
        assert g["state"] == [{"shape": [3, 512], "dtype": "bfloat16"},
                              {"shape": [2, 128, 128], "dtype": ssm}]


def test_a_writes_the_states_vllm_hands_off(run: dict[str, Any]) -> None:
    at, short = _resume(run)
    c = run["a_counters"]
    # one state per recurrent group per prompt (vLLM's default keeps one boundary a prompt):
    # A's warm-up prompt, P and P[:900]
    assert c["state_saves"] == c["state_handoffs"] == 3 * 3
    assert not c.get("state_handoffs_dropped")
    assert run["held_before_b"]["certified"] == at
    # A's second prompt found the first one's attention blocks in hkv but no state below
    # them: it computed in full, and its report says why
    second = run["a_runs"][1]
    assert second["certified"] == 0 and f"NO_STATE_AT_BOUNDARY@{short}" in second["why"]


def test_b_resumes_from_hkv_bit_identical_to_vllm_resuming_at_the_same_boundary(
        run: dict[str, Any]) -> None:
    at, _ = _resume(run)
    assert run["baseline"]["at_960"]["cached"] == at  # vLLM's own cache: the same boundary
    hit = run["b"]["hit"]
    assert hit["cached"] == at  # every cached token came from hkv (B's own cache was reset)
    (job,) = hit["load_jobs"]
    assert job["tokens"] == at and job["state_copies"] == 3 and job["leased"]
    assert hit["hkv"] == {"asked": at, "local": 0, "certified": at, "loaded": at, "why": ""}
    vs = hit["vs_baseline"]
    assert vs["bit_identical"] and vs["tokens_equal"] and vs["max_logprob_diff"] == 0.0
    assert vs["steps_with_nan"] == 0 and len(hit["tokens"]) == 16


@pytest.mark.parametrize("control", ["skip_recurrent", "nothing"])
def test_the_negative_controls_differ(run: dict[str, Any], control: str) -> None:
    """The same hit with the recurrent groups' copies dropped, or every copy: the check above
    would see it (a lost state changes the tokens, not only the logprobs: slow-decay A_log)."""
    at, _ = _resume(run)
    got = run["b"][control]
    assert got["cached"] == at  # the hit was claimed all the same
    vs = got["vs_baseline"]
    assert not vs["bit_identical"] and not vs["tokens_equal"]
    assert vs["max_logprob_diff"] > 0.1 or math.isinf(vs["max_logprob_diff"])


@pytest.mark.parametrize(("fault", "baseline"), [
    ("other_boundary", "at_864"),  # 960's states evicted: hkv certifies 864, shorter
    ("corrupt_disk", "recompute"),  # a state's disk copy flipped: the load fails, recompute
    ("evicted", "recompute"),  # every state evicted: nothing certified, said why
])
def test_after_a_fault_b_recomputes_or_resumes_shorter_never_a_different_logprob(
        run: dict[str, Any], fault: str, baseline: str) -> None:
    at, short = _resume(run)
    assert run["injected"][fault] > 0
    got = run["b"][fault]
    assert got["baseline"] == baseline
    vs = got["vs_baseline"]
    assert vs["bit_identical"] and vs["max_logprob_diff"] == 0.0, vs
    report = got["hkv"]
    if fault == "other_boundary":
        assert got["cached"] == short == run["baseline"]["at_864"]["cached"]
        assert report["certified"] == report["loaded"] == short
        assert f"NO_STATE_AT_BOUNDARY@{at}" in report["why"]
    elif fault == "corrupt_disk":
        assert report["certified"] == at and report["loaded"] == 0
        assert "load failed" in report["why"]
        assert got["counters"]["load_failed.CORRUPT"] == 1
        assert run["after_corrupt_state_equals_a"]  # hkv kept no garbage at 960
    else:
        assert got["cached"] == 0 and report["certified"] == 0
        assert f"NO_STATE_AT_BOUNDARY@{at}" in report["why"]


def test_a_recompute_equals_a_resume_at_the_last_boundary(run: dict[str, Any]) -> None:
    """Why the two faults that recompute compare with ``recompute``: align mode splits a full
    prefill at the same boundary a resume starts from, so the two agree bit for bit."""
    assert run["recompute_vs_at_960"]["bit_identical"]
