"""A real ``vllm.LLM`` on CPU through hkv: see ``vllm_e2e.py`` (run here in a subprocess,
because vLLM keeps process-wide state; about 70 s on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
LOGPROB_ATOL = 1e-4  # float32 on one CPU: B's suffix pass vs A's full prefill


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    work = tmp_path_factory.mktemp("e2e")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE)]))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_e2e.py"), str(work)], env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow
def test_b_loads_what_hkv_certifies_byte_equal_and_computes_only_the_suffix(
        run: dict[str, object]) -> None:
    assert run["a_loaded"] == 0  # A had no hit: a full prefill, the reference below
    # vLLM's CPU backend runs 32-token blocks: 31 whole blocks of 1000 tokens in each group
    assert run["block_size"] == 32
    assert run["a_saved"] == 31 + 31
    assert run["certified"] == 992  # the last whole block before the prompt's last token
    assert run["b_loaded"] == 992 and run["b_computed"] == 8
    assert run["b_blocks_compared"] == 31 + 4  # full attention [0, 992), SWA [864, 992)
    assert run["b_blocks_mismatched"] == 0
    assert run["b_token"] == run["a_token"]
    assert float(run["b_max_logprob_diff"]) <= LOGPROB_ATOL  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["evict", "disk_bitflip", "shard_kill"])
def test_after_a_fault_b_recomputes_and_still_matches(run: dict[str, object],
                                                      fault: str) -> None:
    got = run["faults"][fault]  # type: ignore[index]
    assert got["injected"] > 0
    assert got["loaded"] < 992  # not the whole prefix from hkv: it was (partly) recomputed
    if fault == "disk_bitflip":
        assert got["load_failed"] == 1  # the checksum caught it at load: a failed receive
    assert got["token"] == run["a_token"]
    assert got["max_logprob_diff"] <= LOGPROB_ATOL
