"""A real ``vllm.LLM`` on CPU with hkv behind it: engine A writes a long prompt's KV, a fresh
engine B reads it. Run by ``test_e2e.py`` in a subprocess (vLLM keeps process-wide state), or
by hand: ``.venv-vllm/bin/python tests/connectors/vllm_e2e.py DIR`` prints one JSON object.

The model is a tiny Llama written here (no hub): 4 layers alternating sliding-window (128) and
full attention, weights from transformers' own init at ``initializer_range`` 0.1, seeded and
saved as safetensors, so greedy top tokens are far apart (vLLM's dummy weights give near-ties).
vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its connectors reach the
in-process hkv (real shards, real LMDB tiers) published here.

What is checked (``main`` returns the figures, the test asserts them):

* A: hkv had nothing (0 tokens loaded), so A is a full prefill; its blocks are saved.
* B: loads every token hkv certifies, computes only the rest; every block it loaded is
  byte-equal to A's full-prefill KV for that block; its first-token logprobs match A's.
* faults between runs on B (evict everything, a bit flipped on disk, a shard killed): B
  recomputes and its logprobs still match A's.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PROMPT_TOKENS = 1000
TOP = 5


def write_model(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm_harness import TINY, write_tiny_config

    write_tiny_config(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(json.dumps(TINY))  # the one the tests read, as written
    return path


def engine(model: Path, system: str) -> Any:
    from vllm import LLM
    from vllm_harness import transfer_config

    return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               block_size=16, max_model_len=2048, max_num_seqs=4, gpu_memory_utilization=0.5,
               kv_transfer_config=transfer_config(system), enable_prefix_caching=True,
               seed=0)


def first_token(llm: Any, tokens: list[int]) -> tuple[int, dict[int, float]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, detokenize=False)
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    comp = out.outputs[0]
    lps = {int(t): float(lp.logprob) for t, lp in comp.logprobs[0].items()}
    return int(comp.token_ids[0]), lps


def connectors(llm: Any) -> tuple[Any, Any]:
    """The engine's scheduler-side and worker-side HkvConnector (all in this process)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector, get_kv_transfer_group()


class Recorder:
    """Keeps the jobs the scheduler-side connector hands the worker (test instrumentation)."""

    def __init__(self, sched: Any) -> None:
        self.loads: list[Any] = []
        self.saves: list[Any] = []
        side = sched.scheduler
        take = side.take_jobs

        def recording(*args: Any) -> Any:
            loads, saves = take(*args)
            self.loads += loads
            self.saves += saves
            return loads, saves

        side.take_jobs = recording


def kv_of(worker: Any, column: str, block_id: int) -> bytes:
    w = worker.worker
    g = next(g for g in w.geo.groups if g.name == column)
    return bytes(w._get(g, block_id).tobytes())


def flip_on_disk(shard_dir: Path, head: bytes) -> int:
    """Flip one bit 100 bytes past every copy of ``head`` in the shard's LMDB files."""
    from hkv_service.demo.faults import flip_on_disk as flip

    return flip(shard_dir, head)


def shutdown(llm: Any) -> None:
    import gc

    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
    )

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    destroy_model_parallel()
    destroy_distributed_environment()
    del llm
    gc.collect()


def main(work: Path) -> dict[str, Any]:
    from vllm_harness import prompt

    from hkv_service.connectors import systems
    from hkv_service.core.api import LookupRequest
    from hkv_service.core.hashing import ExtraKeys, hash_blocks
    from hkv_service.core.layout import Layout
    from workers.inprocess import InProcessConfig, InProcessSystem

    model = write_model(work / "model")
    systems.publish("e2e", lambda spec: InProcessSystem(
        spec, work / "hkv", InProcessConfig(shards=2, blocks_per_group=1024)))
    tokens = prompt(PROMPT_TOKENS, seed=11)
    out: dict[str, Any] = {}

    t = time.perf_counter()
    a = engine(model, "e2e")
    out["engine_start_s"] = time.perf_counter() - t
    a_sched, a_work = connectors(a)
    a_rec = Recorder(a_sched)
    t = time.perf_counter()
    out["a_token"], a_lps = first_token(a, tokens)
    out["a_s"] = time.perf_counter() - t
    out["a_loaded"] = a_work.worker.stats.total["loaded_tokens"]
    assert a_work.worker.drain(30.0), "A's saves still in flight after 30 s"
    out["a_saved"] = a_work.worker.stats.total["saved_blocks"]
    full = {(it.column, it.depth): kv_of(a_work, it.column, it.block_id)
            for job in a_rec.saves for it in job.items}
    shutdown(a)

    system = systems.published("e2e")
    assert system is not None
    geo_spec = system.spec  # type: ignore[attr-defined]
    lcm = geo_spec.lcm_block_size
    limit = (len(tokens) - 1) // lcm * lcm
    hashes = hash_blocks(tokens[:limit], geo_spec.hash_block_size, ExtraKeys(geo_spec.model_id))
    probe = system.meta.lookup(LookupRequest(hashes, limit, handles=False))
    out["certified"] = probe.usable_tokens
    out["block_size"] = geo_spec.groups[0].block_size

    b = engine(model, "e2e")
    b_sched, b_work = connectors(b)
    b_rec = Recorder(b_sched)
    t = time.perf_counter()
    out["b_token"], b_lps = first_token(b, tokens)
    out["b_s"] = time.perf_counter() - t
    out["b_loaded"] = b_work.worker.stats.total["loaded_tokens"]
    out["b_computed"] = PROMPT_TOKENS - out["b_loaded"]
    lay = Layout(b_work.worker.geo.spec)
    mismatched, compared = 0, 0
    for job in b_rec.loads:
        for c in job.copies:  # the copy's depth: the c.index-th block its column needs
            depth = lay.needed_depths(lay.by_name[c.column], job.match.usable_tokens)[c.index]
            compared += 1
            mismatched += kv_of(b_work, c.column, c.block_id) != full[(c.column, depth)]
    out["b_blocks_compared"], out["b_blocks_mismatched"] = compared, mismatched
    out["b_max_logprob_diff"] = _diff(a_lps, b_lps)

    out["faults"] = {}
    for fault in ("evict", "disk_bitflip", "shard_kill"):
        # B's own saves of the last run (they land off the step) are what the fault hits
        assert b_work.worker.drain(30.0), "B's saves still in flight after 30 s"
        assert b.reset_prefix_cache()
        before = dict(b_work.worker.stats.total)
        injected = _inject(fault, system, hashes, limit, work)
        token, lps = first_token(b, tokens)
        after = b_work.worker.stats.total
        out["faults"][fault] = {
            "injected": injected, "token": token, "max_logprob_diff": _diff(a_lps, lps),
            "loaded": after["loaded_tokens"] - before.get("loaded_tokens", 0),
            "load_failed": after["load_failed"] - before.get("load_failed", 0),
        }
    shutdown(b)
    system.close()  # type: ignore[attr-defined]
    return out


def _diff(a: dict[int, float], b: dict[int, float]) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(abs(a[t] - b[t]) for t in a)


def _inject(fault: str, system: Any, hashes: list[Any], limit: int, work: Path) -> int:
    from hkv_service.core.api import LookupRequest

    m = system.meta.lookup(LookupRequest(hashes, limit))
    handles = [h for col in m.handles.values() for h in col]
    if fault == "evict":
        for h in handles:
            with contextlib.suppress(Exception):  # gone already with its partner
                system.meta.evict(h.object_id)
        return len(handles)
    if fault == "shard_kill":  # a shard holding part of the prefix
        system.kill_shard(sorted({h.shard for h in handles})[0])
        return 1
    # disk_bitflip: every object to disk, then one bit of each record's payload flipped
    plane = system.dataplane()
    got = plane.read(m, hashes, release=False)
    res = plane.offload(handles, None, evict_memory=True)
    assert all(r.ok for r in res), res
    n = 0
    heads = [bytes(memoryview(arr).cast("B")[:64]) for col in got.values() for arr in col]
    for sid in system.links:
        for head in heads:
            n += flip_on_disk(system.shard_dir(sid), head)
    return n


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    print(json.dumps(main(Path(sys.argv[1]))))
