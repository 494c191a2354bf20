"""Recurrent (``MambaSpec``, align mode) groups through vLLM's real Scheduler, no model: what
vLLM hands a KV connector for them, with Nemotron-H's shapes (fp32 SSM state). Nemotron-H,
Mamba2 and Granite 4 fail at their first prefill on this CPU with prefix caching on
(``mamba_mixer2.py:880``), so these facts are checked without running one.

A 1,333-token prompt, 160-token blocks, 320-token chunks. The connector is
``state_ref_connector.StateRefConnector`` (loads off): it records each step's
``kv_connector_block_state.boundary_state_offloads``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import state_ref_connector as ref
import torch
from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm_harness import nemotron_h_specs, prompt, recurrent_scheduler, write_tiny_config

REF = KVTransferConfig(kv_connector="StateRefConnector",
                       kv_connector_module_path="state_ref_connector", kv_role="kv_both")
N = 1333


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_config(tmp_path_factory.mktemp("tiny"))


def serve(model: Path, retention: int | None) -> dict[str, Any]:
    """One request through the scheduler; each step's block table, the hand-offs, and the
    block ids vLLM names when the request finishes."""
    ref.reset()
    ref.MODE["load"] = "off"
    _, kvc, sched = recurrent_scheduler(model, nemotron_h_specs(), retention=retention,
                                        transfer=REF)
    init_none_hash(sha256)
    sched.add_request(Request("r", prompt(N, seed=3), SamplingParams(max_tokens=2,
                              ignore_eos=True), None,
                              block_hasher=get_request_block_hasher(160, sha256)))
    finished: list[list[list[int]]] = []
    conn: Any = sched.connector
    assert conn is not None
    done = conn.request_finished_all_groups

    def record(request: Request, block_ids: tuple[list[int], ...]) -> Any:
        finished.append([list(b) for b in block_ids])
        return done(request, block_ids)

    conn.request_finished_all_groups = record
    tables: list[list[list[int]]] = []
    while sched.has_requests():
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        if "r" in sched.requests:
            tables.append([list(b) for b in sched.kv_cache_manager.get_block_ids("r")])
        req = sched.requests.get("r")
        prefilling = req is not None and req.num_computed_tokens < req.num_prompt_tokens
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[] if prefilling else [7] for _ in ids],
                                kv_connector_output=KVConnectorOutput())
        sched.update_from_output(out, mro)
    return {"kvc": kvc, "tables": tables, "finished": finished,
            "handoffs": list(ref.LOG["handoffs"]),
            "chunks": [n for s in ref.LOG["steps"] for n in s["scheduled"].values()]}


def test_the_config_has_two_recurrent_groups_of_nemotron_h_shapes(model: Path) -> None:
    _, kvc, _ = recurrent_scheduler(model, nemotron_h_specs())
    specs = [g.kv_cache_spec for g in kvc.kv_cache_groups]
    assert [type(s) for s in specs] == [MambaSpec, MambaSpec, FullAttentionSpec]
    m = specs[0]
    assert isinstance(m, MambaSpec)
    assert m.shapes == ((3, 384), (8, 32, 64)) and m.dtypes == (torch.bfloat16, torch.float32)
    assert m.real_page_size_bytes == 3 * 384 * 2 + 8 * 32 * 64 * 4 == 67_840
    assert m.page_size_bytes == specs[2].page_size_bytes == 81_920  # padded to attention's
    assert {t.size for t in kvc.kv_cache_tensors} == {kvc.num_blocks * 81_920}  # one overlay


@pytest.mark.parametrize(("retention", "boundaries"), [
    (0, [1280]),  # the default: only the prompt's last cacheable boundary
    # dense: every chunk end and, Mamba2 exporting one checkpoint inside each chunk (its
    # last block boundary), every block here (GatedDeltaNet has no in-chunk checkpoint:
    # chunk ends only, see qwen3next_facts.py boundaries)
    (None, list(range(160, 1281, 160))),
    (640, [640, 1280]),  # periodic: states on a multiple of 640, and the last one
])
def test_boundary_states_are_handed_off_in_the_step_that_computes_them(
        model: Path, retention: int | None, boundaries: list[int]) -> None:
    got = serve(model, retention)
    assert got["chunks"][:5] == [320, 320, 320, 320, 53]
    offs = got["handoffs"]
    assert sorted({h["boundary"] for h in offs}) == boundaries
    for h in offs:  # in the step whose forward writes it, one per recurrent group
        assert h["computed"] < h["boundary"] <= h["computed"] + h["scheduled"]
    assert sorted(h["group"] for h in offs) == sorted([0, 1] * len(boundaries))
    # the block handed off is at index boundary / bs - 1 of that step's block table
    for h in offs:
        step = h["step"] - 1
        assert got["tables"][step][h["group"]][h["boundary"] // 160 - 1] == h["block_id"]


def test_state_blocks_are_not_append_only_and_finish_does_not_name_them(model: Path) -> None:
    got = serve(model, 0)
    h = next(h for h in got["handoffs"] if h["group"] == 0)
    (final,) = got["finished"]
    # the 1280 state lives on in vLLM's prefix cache, but the request's table nulls it
    assert final[0][1280 // 160 - 1] == 0 and h["block_id"] not in final[0]
    # interior entries turn null once the state moved on: an id seen earlier is gone
    first = got["tables"][0][0]
    assert any(b and b not in t[0] for t in got["tables"][1:] for b in first)
    assert all(b for b in final[2])  # attention: every block, append-only

