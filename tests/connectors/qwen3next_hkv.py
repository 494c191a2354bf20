"""A real ``vllm.LLM`` on CPU with the tiny Qwen3-Next (``qwen3next.py``: 3 GatedDeltaNet + 1
full-attention layer) and hkv in process: what ``test_qwen3next_hkv.py`` asserts. Run in a
subprocess of its own (vLLM keeps process-wide state), or by hand::

    PYTHONPATH=. .venv-vllm/bin/python tests/connectors/qwen3next_hkv.py DIR   # one JSON object

Three engines, one after the other (each shut down before the next starts):

* **baseline**, vLLM alone (no connector): the reference runs, each resuming where the hkv
  run under test resumes (align mode splits a prefill at the resume point, and a prefill
  split elsewhere gives other bf16 logits: docs/vllm-recurrent-state.md):
  ``at_960`` (it served the prompt P first: its own prefix cache resumes P + S at 960),
  ``at_864`` (it served P[:900] first: 864 with vLLM's 96-token blocks, 896 with 64-token
  ones), ``recompute`` (nothing cached).
* **A**, with hkv: serves P, then (its own cache reset) P[:900]; hkv keeps what vLLM hands
  off: the attention blocks and the states at 960 and P[:900]'s boundary.
* **B**, a fresh engine with hkv: serves P + S (16 greedy tokens, the logprobs of the whole
  vocabulary at every step). First two negative controls (the recurrent groups' copies
  dropped from the load; every copy dropped, the hit still claimed), then the real load,
  then three faults injected into hkv between runs (vLLM's own cache reset before each):
  ``other_boundary`` (the states at 960 evicted: hkv certifies P[:900]'s), ``corrupt_disk`` (every
  object moved to disk, one bit of a state flipped there: the load fails, vLLM recomputes),
  ``evicted`` (every state evicted: hkv certifies nothing and says why).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

SYSTEM = "qwen3next-hkv"
# P + S ends before the block after 960 for both of vLLM's block sizes here (96 with an fp32 SSM
# state on AVX-512-BF16 hosts, 64 without): the full prompt's resume point is P's, 960, and a
# prefill from P[:900]'s boundary (864 or 896) hands off the state at 960 again
PROMPT, SHORT, SUFFIX = 1000, 900, 20
AT = 960  # the resume point of P and of P + S, for either block size


def engine(system: str | None) -> Any:
    from qwen3next_facts import engine as make
    from vllm_harness import transfer_config

    return make(connector=False, kv_transfer_config=transfer_config(system) if system else None)


def run(llm: Any, tokens: list[int], n: int = 16) -> dict[str, Any]:
    """Greedy tokens and every step's logprobs (the whole vocabulary), cached tokens, and
    hkv's per-request report (``kv_transfer_params["hkv"]``)."""
    from qwen3next_facts import VOCAB
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=VOCAB if n > 1 else 1,
                            detokenize=False, ignore_eos=True)
    t = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    comp = out.outputs[0]
    return {"s": round(time.perf_counter() - t, 3), "cached": out.num_cached_tokens,
            "tokens": [int(x) for x in comp.token_ids],
            "logprobs": [{int(k): float(v.logprob) for k, v in d.items()}
                         for d in (comp.logprobs or [])],
            "hkv": (out.kv_transfer_params or {}).get("hkv")}


def reset(llm: Any) -> None:
    """vLLM's prefix cache dropped once hkv's saves in flight landed (the bench's rule)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    from hkv_service.bench.vllm import reset_prefix_cache

    worker = get_kv_transfer_group().worker if has_kv_transfer_group() else None
    reset_prefix_cache(llm, worker)


def shutdown(llm: Any) -> None:
    from vllm_e2e import shutdown as stop

    stop(llm)


class Loads:
    """Test instrumentation on B's scheduler side: the load jobs it hands the worker, and the
    negative controls (drop the recurrent groups' copies, or every copy) applied to them."""

    def __init__(self, connector: Any) -> None:
        self.mode = "full"
        self.jobs: list[Any] = []
        side = connector.scheduler
        self.recurrent = {g.name for g in side.geo.groups if g.recurrent}
        take = side.take_jobs

        def filtered(*args: Any, **kwargs: Any) -> Any:
            loads, saves = take(*args, **kwargs)
            if self.mode == "skip_recurrent":
                loads = tuple(dataclasses.replace(j, copies=tuple(
                    c for c in j.copies if c.column not in self.recurrent)) for j in loads)
            elif self.mode == "nothing":
                loads = tuple(dataclasses.replace(j, copies=()) for j in loads)
            self.jobs += loads
            return loads, saves

        side.take_jobs = filtered


def counters(connector: Any) -> dict[str, float]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = get_kv_transfer_group()
    assert worker.worker.drain(30.0), "hkv saves still in flight after 30 s"
    return {k: v for side in (connector.scheduler, worker.worker)
            for k, v in side.stats.total.items() if not k.endswith("_s")}


def main(work: Path) -> dict[str, Any]:
    from qwen3next_facts import compare, prompt

    from hkv_service.connectors import systems
    from workers.inprocess import InProcessConfig, InProcessSystem

    p_tokens = prompt(PROMPT, seed=11)
    full = p_tokens + prompt(SUFFIX, seed=12)
    warm = prompt(200, seed=99)
    out: dict[str, Any] = {"prompt": PROMPT, "short": SHORT, "suffix": SUFFIX, "starts_s": {}}

    def start(name: str, system: str | None) -> Any:
        t = time.perf_counter()
        llm = engine(system)
        out["starts_s"][name] = round(time.perf_counter() - t, 1)
        run(llm, warm, n=1)  # the first request of an engine pays one-time costs
        return llm

    # -- the baseline: vLLM alone, resuming at each boundary a run under test resumes at --
    base = start("baseline", None)
    ref: dict[str, dict[str, Any]] = {}
    reset(base)
    run(base, p_tokens, n=1)
    ref["at_960"] = run(base, full)
    reset(base)
    run(base, p_tokens[:SHORT], n=1)
    ref["at_864"] = run(base, full)
    reset(base)
    ref["recompute"] = run(base, full)
    shutdown(base)
    out["baseline"] = {k: {"cached": v["cached"], "s": v["s"]} for k, v in ref.items()}
    out["recompute_vs_at_960"] = compare(ref["at_960"], ref["recompute"])

    systems.publish(SYSTEM, lambda spec: InProcessSystem(
        spec, work / "hkv", InProcessConfig(shards=2, blocks_per_group=512)))
    try:
        # -- A writes --
        a = start("a", SYSTEM)
        a_conn = a.llm_engine.engine_core.engine_core.scheduler.connector
        reset(a)
        out["a_runs"] = [run(a, p_tokens, n=1)["hkv"]]
        reset(a)
        out["a_runs"].append(run(a, p_tokens[:SHORT], n=1)["hkv"])
        out["a_counters"] = counters(a_conn)
        shutdown(a)
        system: Any = systems.published(SYSTEM)
        assert system is not None
        out["spec"] = system.spec.to_dict()
        out["held_before_b"] = held(system, full)
        bs = system.spec.groups[-1].block_size
        assert (len(full) - 1) // bs * bs == (PROMPT - 1) // bs * bs == AT, bs
        short = (SHORT - 1) // bs * bs
        a_states = state_digests(system, full, AT)

        # -- B reads --
        b = start("b", SYSTEM)
        b_conn = b.llm_engine.engine_core.engine_core.scheduler.connector
        loads = Loads(b_conn)
        runs: dict[str, dict[str, Any]] = {}

        def b_run(name: str, baseline: str, mode: str = "full") -> None:
            reset(b)
            loads.mode = mode
            before = len(loads.jobs)
            before_counts = counters(b_conn)
            got = run(b, full)
            after = counters(b_conn)
            jobs = loads.jobs[before:]
            runs[name] = {
                "cached": got["cached"], "s": got["s"], "hkv": got["hkv"],
                "tokens": got["tokens"], "baseline": baseline,
                "vs_baseline": compare(ref[baseline], got),
                "load_jobs": [{"tokens": j.tokens, "copies": len(j.copies),
                               "state_copies": sum(c.column in loads.recurrent
                                                   for c in j.copies),
                               "leased": j.match is not None} for j in jobs],
                "counters": {k: after[k] - before_counts.get(k, 0) for k in after
                             if after[k] != before_counts.get(k, 0)},
            }

        b_run("skip_recurrent", "at_960", "skip_recurrent")
        b_run("nothing", "at_960", "nothing")
        b_run("hit", "at_960")
        out["injected"] = {"other_boundary": evict_states(system, full, (AT,))}
        b_run("other_boundary", "at_864")
        out["injected"]["corrupt_disk"] = corrupt_state(system, full, AT)
        b_run("corrupt_disk", "recompute")
        # the state hkv holds at 960 now is the recompute's (never the block the failed load
        # was to fill): equal to A's, which came from the same one-chunk prefill
        out["after_corrupt_state_equals_a"] = state_digests(system, full, AT) == a_states
        out["injected"]["evicted"] = evict_states(system, full, (short, AT))
        b_run("evicted", "recompute")
        out["b"] = runs
        out["b_counters"] = counters(b_conn)
        shutdown(b)
    finally:
        got = systems.published(SYSTEM)
        systems.withdraw(SYSTEM)
        if got is not None:
            got.close()  # type: ignore[attr-defined]
    return out


def _hashes(system: Any, tokens: list[int], p: int) -> list[Any]:
    from hkv_service.core.hashing import ExtraKeys, hash_blocks

    spec = system.spec
    return hash_blocks(tokens[:p], spec.hash_block_size, ExtraKeys(spec.model_id))


def _state_columns(system: Any) -> list[str]:
    from hkv_service.core.spec import GroupKind

    return [g.name for g in system.spec.groups if g.kind is GroupKind.RECURRENT]


def held(system: Any, tokens: list[int]) -> dict[str, Any]:
    """What hkv certifies for ``tokens`` (lcm-aligned below the last token) and why not more."""
    from hkv_service.core.api import LookupRequest

    lcm = system.spec.lcm_block_size
    limit = (len(tokens) - 1) // lcm * lcm
    m = system.meta.lookup(LookupRequest(_hashes(system, tokens, limit), limit, handles=False))
    return {"limit": limit, "certified": m.usable_tokens,
            "why": [f"{d.reason.value}@{d.position}" for d in m.downgrades]}


def state_digests(system: Any, tokens: list[int], p: int) -> dict[str, str]:
    """sha256 of each recurrent group's state hkv holds at ``p`` (empty if none)."""
    import hashlib

    from hkv_service.core.api import LookupRequest

    hashes = _hashes(system, tokens, p)
    m = system.meta.lookup(LookupRequest(hashes, p))
    if m.usable_tokens != p:
        return {}
    got = system.dataplane().read(m, hashes)
    return {c: hashlib.sha256(memoryview(got[c][0]).cast("B")).hexdigest()
            for c in _state_columns(system)}


def evict_states(system: Any, tokens: list[int], boundaries: tuple[int, ...]) -> int:
    """Evict every recurrent group's state at each boundary; how many were evicted."""
    from hkv_service.core.api import LookupRequest

    n = 0
    for p in boundaries:
        hashes = _hashes(system, tokens, p)
        m = system.meta.lookup(LookupRequest(hashes, p))
        for col in _state_columns(system):
            for h in m.handles.get(col, ()):
                system.meta.evict(h.object_id)
                n += 1
    return n


def corrupt_state(system: Any, tokens: list[int], p: int) -> int:
    """Every object a resume at ``p`` needs moved to disk (memory copies evicted), then one bit
    flipped in the disk copy of the first recurrent group's state; how many bits."""
    from vllm_e2e import flip_on_disk

    from hkv_service.core.api import LookupRequest

    hashes = _hashes(system, tokens, p)
    m = system.meta.lookup(LookupRequest(hashes, p))
    assert m.usable_tokens == p, m
    plane = system.dataplane()
    handles = [h for col in m.handles.values() for h in col]
    assert all(r.ok for r in plane.offload(handles, None, evict_memory=True))
    group = _state_columns(system)[0]
    for sid in system.links:
        # the payload as the disk tier stored it: raw, or a zstd frame when that saves >= 10%
        # (a bf16 SSM state does, an fp32 one not), so the state's own bytes are not always
        # in the file; one bit mid-payload
        stored = _stored_state(system.shard_dir(sid), hashes[-1], group)
        if stored is not None:
            return flip_on_disk(system.shard_dir(sid), stored[len(stored) // 2:][:64])
    return 0


_STORED = """
import sys, lmdb
path, key_head, group = sys.argv[1], bytes.fromhex(sys.argv[2]), sys.argv[3].encode()
env = lmdb.open(path, readonly=True, lock=False, max_dbs=16)
with env.begin() as txn:
    for key, value in txn.cursor(env.open_db(b"records", txn=txn, create=False)):
        if key[:16] + key[24:25] == key_head and key[25:] == group:
            print(bytes(value).hex())
"""


def _stored_state(shard_dir: Path, block_hash: bytes, group: str) -> bytes | None:
    """The disk tier's stored payload of ``group``'s state at ``block_hash``, if this shard
    holds it (storage/record.py: the key is hash, ABI, kind code, group name). Read in a
    child process: LMDB refuses a second open of an environment in the process holding it."""
    import subprocess

    from storage.record import KIND_CODES

    head = block_hash + bytes([KIND_CODES["STATE"]])
    out = subprocess.run([sys.executable, "-c", _STORED, str(shard_dir), head.hex(), group],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    return bytes.fromhex(out[0]) if out else None


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
