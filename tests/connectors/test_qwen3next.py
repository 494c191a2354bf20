"""The tiny Qwen3-Next (``qwen3next.py``) and what a real vLLM engine does with its recurrent
state on this CPU (``qwen3next_facts.py``, each experiment in a subprocess).

The builder test is fast. The engine tests start a real engine each (40-90 s on 2 busy
cores): they are ``slow`` and run only with ``HKV_QWEN3NEXT=1`` (``.ci/vllm`` runs every test
in ``tests/connectors``, slow ones too)::

    HKV_QWEN3NEXT=1 .venv-vllm/bin/python -m pytest tests/connectors/test_qwen3next.py -m slow
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from qwen3next import A_LOG_RANGE, QWEN3_NEXT, write_model
from qwen3next_facts import run_one

ENGINE = pytest.mark.skipif(not os.environ.get("HKV_QWEN3NEXT"), reason="starts a real "
                            "Qwen3-Next engine (40-90 s): set HKV_QWEN3NEXT=1")
NEGATIVE = ("skip_recurrent", "zero_recurrent", "nothing", "wrong_boundary", "sync")


def test_the_builder_is_deterministic_and_decays_slowly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    a = write_model(tmp_path / "a", seed=0)
    b = write_model(tmp_path / "b", seed=0)
    c = write_model(tmp_path / "c", seed=1)
    blob = "model.safetensors"
    assert (a / blob).read_bytes() == (b / blob).read_bytes()
    assert (a / blob).read_bytes() != (c / blob).read_bytes()
    assert json.loads((a / "config.json").read_text()) == QWEN3_NEXT
    lo, hi = A_LOG_RANGE
    decays = [t.float().exp() for k, t in load_file(a / blob).items() if k.endswith("A_log")]
    assert len(decays) == 3  # one per linear_attention layer, 2 value heads each
    assert all(lo * 0.99 <= float(x) <= hi * 1.01 for t in decays for x in t)


@pytest.fixture(scope="module")
def exactness() -> dict[str, Any]:
    return run_one("exactness", "{}")


@pytest.mark.slow
@ENGINE
def test_a_resume_is_bit_identical_to_a_recompute_and_the_controls_differ(
        exactness: dict[str, Any]) -> None:
    assert "rc" not in exactness, exactness.get("stderr_tail")
    vs = exactness["vs_recompute"]
    assert exactness["resume_at"] == 960  # (1040 - 1) // 96 * 96: vLLM's own split point
    assert vs["local_resume"]["bit_identical"]  # vLLM's prefix cache
    assert vs["connector_full"]["bit_identical"]  # a connector's async load, state included
    # a shorter legitimate hit equals vLLM resuming at that same boundary (not a recompute:
    # the prefill is then split elsewhere, and the logits differ)
    assert exactness["pairs"]["local_resume_shorter vs connector_shorter"]["bit_identical"]
    for mode in NEGATIVE:
        got = vs[f"connector_{mode}"]
        assert not got["bit_identical"] and not got["tokens_equal"], mode
        assert got["max_logprob_diff"] > 0.1 or math.isinf(got["max_logprob_diff"]), mode


@pytest.mark.slow
@ENGINE
def test_the_engine_keeps_gdn_state_as_measured() -> None:
    got = run_one("engine")
    assert "rc" not in got, got.get("stderr_tail")
    fp32 = got["host"]["avx512_bf16"]  # vLLM's CPU platform then stores the SSM state fp32
    bs = 96 if fp32 else 64
    state = 3 * 512 * 2 + 2 * 128 * 128 * (4 if fp32 else 2)
    kinds = [(g["class"], g.get("mamba_type")) for g in got["groups"]]
    assert kinds == [("MambaSpec", "MambaAttentionBackendEnum.GDN_ATTN")] * 3 + [
        ("FullAttentionSpec", None)]
    assert {g["block_size"] for g in got["groups"]} == {bs}
    assert got["groups"][0]["real_page_size_bytes"] == state
    view = got["worker_views"][0]
    assert view["shape"][1:] == [1, 1, state] and view["dtype"] == "torch.int8"
    assert [s["offset_in_page"] for s in got["state_views"][0]["states"]] == [0, 3072]
    assert got["repeat_512"]["repeat_cached"] == 511 // bs * bs


@pytest.mark.slow
@ENGINE
@pytest.mark.parametrize(("settings", "kept", "hit_1000"), [
    ({}, [1280], 0),
    ({"prefix_cache_retention_interval": None}, [320, 640, 960, 1280], 960),
])
def test_which_boundaries_keep_a_state(settings: dict[str, Any], kept: list[int],
                                       hit_1000: int) -> None:
    got = run_one("boundaries", json.dumps(
        {"block_size": 160, "max_num_batched_tokens": 320, **settings}))
    assert "rc" not in got, got.get("stderr_tail")
    assert got["after_1333"]["kept"]["g0:MambaSpec"] == kept
    assert got["after_1333"]["hit_for_shared_prefix"]["1000"] == hit_1000
    # the second prompt sharing 1,000 tokens leaves a state at the junction (960)
    assert got["shared_1000"]["third_cached"] == 960
