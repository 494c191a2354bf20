"""Facts about vLLM's recurrent-state (Mamba / GatedDeltaNet) cache on this machine, measured
with a real ``vllm.LLM`` on CPU and the tiny Qwen3-Next of ``qwen3next.py``. No hkv: the
engine runs with ``state_ref_connector.StateRefConnector`` (a reference connector in a
process-global dict) where a connector is needed.

Each experiment runs in a process of its own (vLLM keeps process-wide state) and prints one
JSON object::

    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py engine        # config, layout
    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py boundaries '{"block_size": 160}'
    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py exactness     # resume vs recompute
    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py offload simple|native
    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py family nemotron_h|mamba2|granite4 [pc]
    .venv-vllm/bin/python tests/connectors/qwen3next_facts.py all OUT.json  # each of them

(``PYTHONPATH`` = the repository root; ``VLLM_CPU_KVCACHE_SPACE=1`` is set here. Figures
such as times and RSS depend on the host's load: they are measurements, not limits.)
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

T0 = time.perf_counter()  # process start, near enough (before vLLM is imported)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

PROMPT = 1000  # the long prompt A serves
SUFFIX = 40  # B serves PROMPT + SUFFIX tokens
GENERATE = 16  # tokens B generates (greedy); logprobs of the whole vocabulary at each
VOCAB = 1024


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def rss_mib() -> dict[str, float]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024
    return out


def engine(connector: bool = True, **kw: Any) -> Any:
    from qwen3next import cached_model
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args: dict[str, Any] = dict(
        model=str(cached_model()), skip_tokenizer_init=True, enforce_eager=True,
        block_size=32, max_model_len=2048, max_num_seqs=4, enable_prefix_caching=True,
        seed=0, max_logprobs=VOCAB)
    if connector:
        args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="StateRefConnector", kv_connector_module_path="state_ref_connector",
            kv_role="kv_both")
    args.update(kw)
    return LLM(**args)


def core_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def generate(llm: Any, tokens: list[int], n: int = GENERATE, logprobs: int = VOCAB
             ) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, logprobs=logprobs,
                            detokenize=False, ignore_eos=True)
    t = time.perf_counter()
    (out,) = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    comp = out.outputs[0]
    return {
        "s": round(time.perf_counter() - t, 3), "cached": out.num_cached_tokens,
        "tokens": [int(x) for x in comp.token_ids],
        "logprobs": [{int(k): float(v.logprob) for k, v in d.items()}
                     for d in (comp.logprobs or [])],
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Tokens equal? every step's logprobs bit-identical? the largest difference."""
    steps, nan = [], 0
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        nan += any(math.isnan(v) for v in y.values())
        d = max((abs(x[t] - y[t]) for t in x if t in y), default=math.inf)
        steps.append(math.inf if set(x) != set(y) or math.isnan(d) else d)
    diff = max(steps, default=0.0)
    tokens_equal = a["tokens"] == b["tokens"]
    return {"tokens_equal": tokens_equal, "bit_identical": tokens_equal and diff == 0.0,
            "max_logprob_diff": diff, "step0_logprob_diff": steps[0] if steps else None,
            "steps_with_nan": nan,
            "first_step_differing": next((i for i, d in enumerate(steps) if d), None),
            "first_token_differing": next((i for i, (x, y) in enumerate(
                zip(a["tokens"], b["tokens"], strict=True)) if x != y), None)}


def slim(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "logprobs"}


# -- the engine's cache: config, groups, the worker's views ---------------------------------

def _spec(spec: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"class": type(spec).__name__, "block_size": spec.block_size,
                           "page_size_bytes": spec.page_size_bytes}
    for name in ("shapes", "dtypes", "page_size_padded", "mamba_type", "mamba_cache_mode",
                 "num_speculative_blocks", "num_prefill_checkpoint_blocks",
                 "prefill_checkpoint_alignment", "real_page_size_bytes", "num_kv_heads",
                 "head_size", "dtype"):
        if hasattr(spec, name):
            v = getattr(spec, name)
            out[name] = str(v) if not isinstance(v, (int, float, type(None))) else v
    return out


def cache_facts(llm: Any) -> dict[str, Any]:
    core = core_of(llm)
    cfg = llm.llm_engine.vllm_config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    kvc = core.scheduler.kv_cache_config
    mgr = core.scheduler.kv_cache_manager
    return {
        "model_dtype": str(cfg.model_config.dtype),
        "cache_config": {k: getattr(cc, k) for k in (
            "block_size", "mamba_block_size", "mamba_cache_mode", "mamba_cache_dtype",
            "mamba_ssm_cache_dtype", "mamba_page_size_padded", "prefix_cache_retention_interval",
            "enable_mamba_shared_prefix_checkpoint", "enable_prefix_caching")},
        "scheduler_config": {k: getattr(sc, k) for k in (
            "max_num_batched_tokens", "long_prefill_token_threshold", "enable_chunked_prefill")},
        "hash_block_size": mgr.block_pool.hash_block_size,
        "num_blocks": kvc.num_blocks,
        "groups": [{"layers": list(g.layer_names), **_spec(g.kv_cache_spec)}
                   for g in kvc.kv_cache_groups],
        "tensors": [{"size": t.size, "layers": list(t.layers), "offset": t.offset,
                     "layer_stride": t.layer_stride, "block_stride": t.block_stride}
                    for t in kvc.kv_cache_tensors],
    }


def state_views(llm: Any) -> list[dict[str, Any]]:
    """Each recurrent layer's bound states: byte offset inside the block's page, shape, dtype."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker: Any = get_kv_transfer_group()
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    out = []
    for name, view in worker.views.items():
        layer = ctx.get(name)
        states = getattr(layer, "kv_cache", None)
        if not isinstance(states, (tuple, list)) or not states:
            continue
        page = view[1].data_ptr()
        out.append({"layer": name, "states": [
            {"offset_in_page": s[1].data_ptr() - page, "shape": list(s.shape[1:]),
             "dtype": str(s.dtype), "bytes": s[1].numel() * s.element_size()}
            for s in states]})
    return out


def engine_main(ssm_dtype: str = "") -> dict[str, Any]:
    import torch
    from state_ref_connector import LOG, MODE

    MODE["load"] = "off"
    kw: dict[str, Any] = {"mamba_ssm_cache_dtype": ssm_dtype} if ssm_dtype else {}
    t = time.perf_counter()
    llm = engine(**kw)
    out: dict[str, Any] = {
        "host": {"avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
                 "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "engine_start_s": round(time.perf_counter() - t, 1),
        "process_start_to_engine_ready_s": round(time.perf_counter() - T0, 1),
        "rss_after_start_mib": rss_mib(),
        **cache_facts(llm), "worker_views": list(LOG["views"]), "state_views": state_views(llm),
    }
    tokens = prompt(512, seed=1)
    first = generate(llm, tokens, n=8, logprobs=5)
    other = generate(llm, prompt(512, seed=2), n=8, logprobs=5)
    again = generate(llm, tokens, n=8, logprobs=5)
    out["repeat_512"] = {"first_s": first["s"], "second_prompt_s": other["s"],
                         "first_cached": first["cached"], "repeat_cached": again["cached"],
                         "repeat_s": again["s"], "tokens_equal": first["tokens"] == again["tokens"]}
    out["handoffs_512"] = [h for h in LOG["handoffs"]]
    out["steps_512"] = LOG["steps"][:6]
    out["rss_end_mib"] = rss_mib()
    return out


# -- which boundaries keep a state -----------------------------------------------------------

def state_map(llm: Any, tokens: list[int]) -> dict[str, Any]:
    """Per group, the boundaries (tokens) whose block is in vLLM's prefix cache for
    ``tokens``; and the hit a later prompt sharing exactly the first p tokens gets."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes
    from vllm.v1.request import Request

    core = core_of(llm)
    mgr = core.scheduler.kv_cache_manager
    pool = mgr.block_pool
    req = Request("probe", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=core.request_block_hasher)
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    kept: dict[str, list[int]] = {}
    for gid, g in enumerate(groups):
        bs = g.kv_cache_spec.block_size
        hashes = resolve_block_hashes(req.block_hashes, pool.hash_block_size, bs)
        kept[f"g{gid}:{type(g.kv_cache_spec).__name__}"] = [
            (k + 1) * bs for k in range(len(hashes))
            if pool.get_cached_block(hashes[k], [gid]) is not None]
    lcm = max(g.kv_cache_spec.block_size for g in groups)
    hits = {}
    for p in sorted({*range(lcm, len(tokens) + 1, lcm), 1000, len(tokens)}):
        if p > len(tokens):
            continue
        probe = Request(f"probe{p}", [*tokens[:p], 1], SamplingParams(max_tokens=1), None,
                        block_hasher=core.request_block_hasher)
        _, hit, _ = mgr.coordinator.find_longest_cache_hit(probe.block_hashes, p)
        hits[p] = hit
    return {"kept": kept, "hit_for_shared_prefix": hits}


def boundaries_main(settings_json: str = "{}") -> dict[str, Any]:
    """Serve one 1,333-token prompt under ``settings`` (engine keyword arguments), then map
    which boundaries kept a state; then a second prompt sharing its first 1,000 tokens, and
    a third sharing the same 1,000 (the shared-prefix junction)."""
    from state_ref_connector import LOG, MODE

    MODE["load"] = "off"
    settings = json.loads(settings_json)
    llm = engine(**settings)
    cf = cache_facts(llm)
    tokens = prompt(1333, seed=3)
    generate(llm, tokens, n=1, logprobs=1)
    out: dict[str, Any] = {
        "settings": settings, "block_size": cf["groups"][0]["block_size"],
        "cache_config": cf["cache_config"], "scheduler_config": cf["scheduler_config"],
        "chunks": [n for s in LOG["steps"] for n in s["scheduled"].values()],
        "handoffs": sorted({h["boundary"] for h in LOG["handoffs"]}),
        "after_1333": state_map(llm, tokens),
    }
    second = tokens[:1000] + prompt(300, seed=4)
    r2 = generate(llm, second, n=1, logprobs=1)
    third = tokens[:1000] + prompt(300, seed=5)
    r3 = generate(llm, third, n=1, logprobs=1)
    out["shared_1000"] = {"second_cached": r2["cached"], "third_cached": r3["cached"],
                          "handoffs_all": sorted({(h["req"], h["boundary"])
                                                  for h in LOG["handoffs"]})}
    return out


# -- bit-exactness: recompute, vLLM's own prefix cache, a connector's load ------------------

def _zero_cached(llm: Any, tokens: list[int], p: int, recurrent_only: bool) -> list[int]:
    """Zero the pages vLLM's prefix cache holds for ``tokens[:p]`` (the recurrent groups'
    state at p; with ``recurrent_only`` False every attention block below p too)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.request import Request

    core = core_of(llm)
    pool = core.scheduler.kv_cache_manager.block_pool
    views = cast(Any, get_kv_transfer_group()).views
    req = Request("z", [*tokens[:p], 1], SamplingParams(max_tokens=1), None,
                  block_hasher=core.request_block_hasher)
    zeroed = []
    for gid, g in enumerate(core.scheduler.kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        recurrent = isinstance(spec, MambaSpec)
        if recurrent_only and not recurrent:
            continue
        hashes = resolve_block_hashes(req.block_hashes, pool.hash_block_size, spec.block_size)
        ks = [p // spec.block_size - 1] if recurrent else range(p // spec.block_size)
        for k in ks:
            blocks = pool.get_cached_block(hashes[k], [gid])
            assert blocks is not None, (gid, k)
            for layer in g.layer_names:
                views[layer][blocks[0].block_id].view(torch.uint8).zero_()
            zeroed.append(blocks[0].block_id)
    return zeroed


def exactness_main(settings_json: str = "{}") -> dict[str, Any]:
    from state_ref_connector import LOG, MODE, STORE, reset

    llm = engine(**json.loads(settings_json))
    base_tokens = prompt(PROMPT, seed=11)
    full = base_tokens + prompt(SUFFIX, seed=12)
    out: dict[str, Any] = {"prompt": PROMPT, "suffix": SUFFIX, "generate": GENERATE}
    runs: dict[str, dict[str, Any]] = {}

    def fresh() -> None:
        assert llm.reset_prefix_cache()

    MODE["load"] = "off"
    generate(llm, prompt(200, seed=99), n=1, logprobs=1)  # warm-up, not compared
    fresh()
    runs["recompute"] = generate(llm, full)
    fresh()
    runs["recompute_again"] = generate(llm, full)
    # vLLM's own prefix cache: A serves the prompt, then prompt + suffix resumes from it
    fresh()
    generate(llm, base_tokens, n=1, logprobs=1)
    runs["local_resume"] = generate(llm, full)
    p = runs["local_resume"]["cached"]
    out["resume_at"] = p
    # ... and from a state one block earlier (A served a shorter prompt): a legitimate,
    # shorter hit, computed in other chunks than the recompute
    fresh()
    generate(llm, base_tokens[: p - 40], n=1, logprobs=1)
    runs["local_resume_shorter"] = generate(llm, full)
    # negative controls with vLLM alone: the cached state (or everything) zeroed before B
    for name, rec_only in (("local_state_zeroed", True), ("local_all_zeroed", False)):
        fresh()
        generate(llm, base_tokens, n=1, logprobs=1)
        out[f"{name}_blocks"] = _zero_cached(llm, full, p, rec_only)
        runs[name] = generate(llm, full)
    # the reference connector: A saves (attention blocks; states from the hand-off), B loads
    fresh()
    reset()
    MODE["load"] = "off"
    generate(llm, base_tokens, n=1, logprobs=1)
    generate(llm, base_tokens[: p - 40], n=1, logprobs=1)  # a state one block earlier too
    out["stored_objects"] = len(STORE)
    out["handoffs"] = [(h["req"], h["group"], h["boundary"]) for h in LOG["handoffs"]]
    for mode in ("full", "shorter", "skip_recurrent", "zero_recurrent", "nothing",
                 "wrong_boundary", "sync"):
        fresh()
        MODE["load"] = mode
        LOG["loads"].clear()
        runs[f"connector_{mode}"] = generate(llm, full)
        runs[f"connector_{mode}"]["load"] = LOG["loads"][-1] if LOG["loads"] else None
    MODE["load"] = "off"
    ref = runs["recompute"]
    out["runs"] = {k: slim(v) for k, v in runs.items()}
    out["vs_recompute"] = {k: compare(ref, v) for k, v in runs.items() if k != "recompute"}
    out["vs_local_resume"] = {k: compare(runs["local_resume"], v) for k, v in runs.items()
                              if k != "local_resume"}
    # the connector against vLLM's own prefix cache resuming at the same boundary
    out["pairs"] = {f"{a} vs {b}": compare(runs[a], runs[b]) for a, b in (
        ("local_resume_shorter", "connector_shorter"),
        ("local_state_zeroed", "connector_zero_recurrent"))}
    return out


# -- vLLM's own offloading connectors on this CPU -------------------------------------------

def offload_main(which: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    if which == "simple":
        tc = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 1 << 28})
    else:
        tc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": 1 << 28})
    out: dict[str, Any] = {"connector": tc.kv_connector}
    try:
        llm = engine(connector=False, kv_transfer_config=tc)
        out["started"] = True
        tokens = prompt(PROMPT, seed=11)
        a = generate(llm, tokens, n=4, logprobs=1)
        assert llm.reset_prefix_cache()
        b = generate(llm, tokens, n=4, logprobs=1)
        out.update(a_cached=a["cached"], b_cached=b["cached"], equal=a["tokens"] == b["tokens"])
    except BaseException as exc:  # what happens is the fact
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                        for f in traceback.extract_tb(exc.__traceback__)][-3:]
    return out


# -- other recurrent families: tiny configs, first prefill with prefix caching ---------------

FAMILIES: dict[str, dict[str, Any]] = {
    "nemotron_h": {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*M-", "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "mamba_num_heads": 8, "mamba_head_dim": 32, "ssm_state_size": 64,
        "n_groups": 1, "conv_kernel": 4, "expand": 1, "chunk_size": 128,
        "mamba_hidden_act": "silu", "mlp_hidden_act": "relu2", "vocab_size": 1024,
        "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5, "use_conv_bias": True,
        "use_bias": False, "mamba_proj_bias": False, "initializer_range": 0.1,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
    },
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "hidden_size": 256, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 64,
        "state_size": 64, "n_groups": 1, "conv_kernel": 4, "expand": 2, "chunk_size": 128,
        "vocab_size": 1024, "layer_norm_epsilon": 1e-5, "use_conv_bias": True,
        "use_bias": False, "initializer_range": 0.1, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "bfloat16",
    },
    "granite4": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"], "num_attention_heads": 4,
        "num_key_value_heads": 2, "mamba_n_heads": 8, "mamba_d_head": 32,
        "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 1,
        "mamba_chunk_size": 128, "num_local_experts": 0, "num_experts_per_tok": 0,
        "shared_intermediate_size": 512, "vocab_size": 1024, "position_embedding_type": "rope",
        "max_position_embeddings": 4096, "initializer_range": 0.1, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "bfloat16",
    },
}


def family_main(name: str, prefix_caching: str = "pc") -> dict[str, Any]:
    from qwen3next import cached_model

    out: dict[str, Any] = {"family": name, "prefix_caching": prefix_caching == "pc"}
    try:
        model = cached_model(config=FAMILIES[name])
    except BaseException as exc:
        out["error"] = f"building the model: {type(exc).__name__}: {exc}"
        return out
    from vllm import LLM

    try:
        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                  max_model_len=2048, max_num_seqs=4, seed=0, block_size=32,
                  enable_prefix_caching=prefix_caching == "pc")
        out["started"] = True
        out.update({k: v for k, v in cache_facts(llm).items()
                    if k in ("groups", "cache_config", "model_dtype")})
        tokens = prompt(400, seed=11)
        a = generate(llm, tokens, n=4, logprobs=1)
        b = generate(llm, tokens, n=4, logprobs=1)
        out.update(ran=True, a_cached=a["cached"], b_cached=b["cached"],
                   equal=a["tokens"] == b["tokens"])
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        out["where"] = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}"
                        for f in traceback.extract_tb(exc.__traceback__)][-3:]
    return out


# -- driver ----------------------------------------------------------------------------------

EXPERIMENTS: dict[str, Callable[..., dict[str, Any]]] = {
    "engine": engine_main, "boundaries": boundaries_main, "exactness": exactness_main,
    "offload": offload_main, "family": family_main}
# what ``all`` runs: (experiment, args)
PLAN: list[tuple[str, tuple[str, ...]]] = [
    ("engine", ()), ("engine", ("bfloat16",)),
    ("boundaries", ("{}",)),
    ("boundaries", ('{"block_size": 160, "max_num_batched_tokens": 320}',)),
    ("boundaries", ('{"block_size": 160, "max_num_batched_tokens": 320, '
                    '"prefix_cache_retention_interval": null}',)),
    ("boundaries", ('{"block_size": 160, "max_num_batched_tokens": 320, '
                    '"prefix_cache_retention_interval": 640}',)),
    ("boundaries", ('{"block_size": 160, "max_num_batched_tokens": 2048, '
                    '"long_prefill_token_threshold": 320, '
                    '"prefix_cache_retention_interval": null}',)),
    ("boundaries", ('{"block_size": 160, "max_num_batched_tokens": 320, '
                    '"enable_mamba_shared_prefix_checkpoint": true}',)),
    ("boundaries", ('{"block_size": 160, "prefix_cache_retention_interval": null}',)),
    ("boundaries", ('{"block_size": 160, "prefix_cache_retention_interval": 640}',)),
    ("boundaries", ('{"block_size": 160, "mamba_block_size": 320}',)),
    ("exactness", ("{}",)),
    ("offload", ("simple",)), ("offload", ("native",)),
    ("family", ("nemotron_h", "pc")), ("family", ("nemotron_h", "nopc")),
    ("family", ("mamba2", "pc")), ("family", ("granite4", "pc")),
]


def run_one(name: str, *args: str, timeout: float = 900) -> dict[str, Any]:
    """One experiment in a fresh process; its JSON (or what went wrong)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), str(HERE)]))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, str(Path(__file__)), name, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = round(time.perf_counter() - t, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"experiment": [name, *args], "rc": proc.returncode, "wall_s": wall,
                "stderr_tail": proc.stderr[-3000:]}
    return {"experiment": [name, *args], "wall_s": wall, **json.loads(lines[-1])}


def main(argv: list[str]) -> None:
    name, *args = argv
    if name == "all":
        results = []
        for exp, exp_args in PLAN:
            results.append(run_one(exp, *exp_args))
            print(json.dumps(results[-1])[:300], file=sys.stderr, flush=True)
        Path(args[0]).write_text(json.dumps(results, indent=1))
        return
    print(json.dumps(EXPERIMENTS[name](*args), default=str), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
