"""The README's ``vllm serve ... --kv-transfer-config ...`` line, run as written (issue 18).

The production path end to end: a real ``hkv up`` (a subprocess with its own local Ray), the
connector's gRPC ``MetadataClient`` (scheduler side, in vLLM's engine core) and ``RayLink`` s to
the shard actors (worker side, in vLLM's worker process), and vLLM's OpenAI server.

The code block between the ``vllm-serve`` markers in README.md is cut out. Its ``vllm serve``
command runs through ``bash -c`` with three substitutions only: the model path placeholder,
vLLM's ``--port 8000`` and hkv's ``127.0.0.1:50051`` (each replaced by a free port's, as this
machine is shared). Its ``hkv up`` line gets ``--port 0`` and a data directory of its own. The
README's flow, step by step:

1. ``hkv up`` with its default spec; vLLM starts, writes the spec it needs to ``spec_out`` and
   refuses (exit status not 0, the sentence says so);
2. ``hkv up --spec vllm-spec.yaml`` (the README's line); vLLM starts again and serves;
3. two completions of the same 1,000-token prompt (a list of token ids): after the first, hkv
   certifies the prompt's whole blocks (asked over gRPC); vLLM's own prefix cache is dropped
   between them (``/reset_prefix_cache``, a dev-mode route), so the second request's prefix can
   only come from hkv: vLLM's ``external_prefix_cache_hits`` grows by exactly the tokens hkv
   certified, its local hits do not, and the two outputs are equal.

``ray_address`` is ``"auto"`` as in the README; the vLLM process gets ``RAY_ADDRESS`` set to the
address ``hkv up`` printed (other Ray clusters may be running on this machine), and
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; vLLM would take most of the machine's memory) and
``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``). The model is the tiny hybrid Llama of
``vllm_e2e.py``, or the tiny Qwen3-Next (GatedDeltaNet + full attention: the second hit also
restores each recurrent group's state, saved from vLLM's hand-offs, over Ray), each with a
word-level tokenizer, so the README line needs no tokenizer flag. Everything started here is
stopped by pid and then by its process group. 3-5 minutes a model on 2 cores.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import TINY, prompt, readme_commands

MODEL_PLACEHOLDER = "/path/to/model"
VLLM_PORT = "--port 8000"
HKV_ENDPOINT = "127.0.0.1:50051"
PROMPT_TOKENS = 1000
MAX_TOKENS = 8
START_TIMEOUT_S = 300.0  # vLLM's engine starts in ~60 s here; a loaded machine is slower


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_model(path: Path, which: str = "llama") -> Path:
    """The tiny hybrid Llama of ``vllm_e2e.py`` or the tiny Qwen3-Next of ``qwen3next.py``
    (seeded safetensors weights), with a word-level tokenizer of its vocabulary ("t3" is
    token 3), so ``vllm serve`` takes it as it would a real model: no tokenizer flags."""
    from qwen3next import QWEN3_NEXT
    from qwen3next import write_model as write_qwen
    from tokenizers import Tokenizer, models, pre_tokenizers
    from vllm_e2e import write_model as write_weights

    tf: Any = importlib.import_module("transformers")  # untyped
    (write_qwen if which == "qwen3-next" else write_weights)(path)
    vocab = QWEN3_NEXT["vocab_size"] if which == "qwen3-next" else TINY["vocab_size"]
    words = {f"t{i}": i for i in range(3, int(str(vocab)))}
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, **words},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>").save_pretrained(path)
    return path


class HkvUp:
    """``hkv up`` as a subprocess in a process group of its own; :meth:`ready` waits for it
    and reads the endpoint and the Ray address it prints."""

    def __init__(self, argv: list[str], cwd: Path) -> None:
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.endpoint = self.ray_address = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def ready(self) -> HkvUp:
        worker = self._await("hkv up: worker: ")
        m = re.search(r"attach\('([^']+)', ray_address='([^']+)'\)", worker)
        assert m, worker
        self.endpoint, self.ray_address = m.group(1), m.group(2)
        return self

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def _await(self, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                assert self.proc.poll() is None, "hkv up exited: " + "".join(self.seen)
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line.strip()
        raise AssertionError(f"no {prefix!r} line from hkv up: {''.join(self.seen)}")

    def stop(self) -> None:
        stop_group(self.proc, grace_s=60.0)


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM to ``proc`` (hkv up and vLLM both stop what they started on it), then, once it
    exited or ``grace_s`` passed, SIGKILL to whatever is left of the process group it leads."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the group left behind
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10.0)


@contextlib.contextmanager
def vllm_serve(command: str, cwd: Path, ray_address: str, log: Path) -> Iterator[
        subprocess.Popen[bytes]]:
    env = dict(os.environ, RAY_ADDRESS=ray_address, VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    with log.open("wb") as out:
        proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, grace_s=30.0)


def http(port: int, path: str, body: dict[str, Any] | None = None, timeout_s: float = 120.0,
         attempts: int = 3) -> Any:
    """A loopback HTTP call (JSON in and out, or text for /metrics), a few bounded retries."""
    data = json.dumps(body).encode() if body is not None else None
    method = "POST" if body is not None or path.startswith("/reset") else "GET"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                raw = resp.read().decode()
            return raw if path == "/metrics" else json.loads(raw)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if attempt == attempts - 1:
                raise
            time.sleep(2.0)
    raise AssertionError("unreachable")


def await_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "vllm serve exited:\n" + log.read_text()[-6000:]
        with (contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
              urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5.0) as r):
            if r.status == 200:
                return
        time.sleep(2.0)
    raise AssertionError("vllm serve did not get ready:\n" + log.read_text()[-6000:])


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus counter's samples (every label set) in /metrics text."""
    pat = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
    values = [float(v) for v in pat.findall(text)]
    assert values, f"no {name} in /metrics"
    return sum(values)


def certified(endpoint: str, spec_path: Path, tokens: list[int]) -> tuple[int, int]:
    """(the tokens of ``tokens`` hkv certifies now, the most it could: every whole block before
    the last token): a match-only lookup over gRPC, hashed as the connector hashes them for
    this engine's spec."""
    from hkv_service.client import MetadataClient
    from hkv_service.core.api import LookupRequest
    from hkv_service.core.hashing import ExtraKeys, hash_blocks
    from hkv_service.core.spec import load_spec

    spec = load_spec(spec_path)
    limit = (len(tokens) - 1) // spec.lcm_block_size * spec.lcm_block_size
    hashes = hash_blocks(tokens[:limit], spec.hash_block_size, ExtraKeys(spec.model_id))
    with MetadataClient(endpoint) as client:
        match = client.lookup(LookupRequest(hashes, limit, handles=False))
    return int(match.usable_tokens), limit


def complete(port: int, model: str, tokens: list[int]) -> list[int]:
    out = http(port, "/v1/completions", {"model": model, "prompt": tokens,
                                         "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                         "return_token_ids": True})
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == MAX_TOKENS, out
    return [int(t) for t in ids]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "qwen3-next"])
def test_the_readme_vllm_serve_line_serves_a_prefix_from_hkv_up(tmp_path: Path,
                                                                 which: str) -> None:
    up_argv, serve_line = readme_commands()
    assert up_argv[:2] == [".venv-vllm/bin/hkv", "up"] and "--spec" in up_argv, up_argv
    for part in (MODEL_PLACEHOLDER, VLLM_PORT, HKV_ENDPOINT):
        assert serve_line.count(part) == 1, f"{part!r} not once in the README line"
    spec_file = tmp_path / up_argv[up_argv.index("--spec") + 1]  # relative: vLLM's cwd
    # The README's relative paths, as a user has them: the venv beside the files.
    (tmp_path / ".venv-vllm").symlink_to(Path(sys.prefix), target_is_directory=True)
    http_port = free_port()
    model = tmp_path / "model"
    t0 = time.monotonic()

    def phase(name: str) -> None:  # shown when the test fails
        print(f"{time.monotonic() - t0:7.1f} s  {name}", flush=True)

    def serve_command(endpoint: str) -> str:
        return (serve_line.replace(MODEL_PLACEHOLDER, str(model))
                .replace(VLLM_PORT, f"--port {http_port}").replace(HKV_ENDPOINT, endpoint))

    def up(argv: list[str], data: str) -> HkvUp:
        return HkvUp([*argv, "--port", "0", "--data-dir", str(tmp_path / data),
                      "--blocks-per-group", "256"], tmp_path)

    # 1. hkv up with its default spec: vLLM writes the spec it needs and refuses to start.
    hkv = up(up_argv[:2], "hkv-default")
    try:
        write_model(model, which)  # while hkv up starts
        phase("model written")
        hkv.ready()
        phase("hkv up (default spec) ready")
        log = tmp_path / "vllm-refused.log"
        with vllm_serve(serve_command(hkv.endpoint), tmp_path, hkv.ray_address, log) as proc:
            try:
                code = proc.wait(START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise AssertionError("vllm serve neither refused nor exited:\n"
                                     + log.read_text()[-4000:]) from None
        phase(f"vllm serve exited {code}")
        said = log.read_text()
        assert code != 0, said[-4000:]
        assert "the hkv service runs cache spec 'hkv-reference-v1'" in said, said[-4000:]
        assert spec_file.is_file(), said[-4000:]
    finally:
        hkv.stop()
        phase("hkv up stopped")

    # 2. hkv up with that spec (the README's line); vLLM starts and serves.
    hkv = up(up_argv, "hkv-vllm").ready()
    phase("hkv up (vLLM's spec) ready")
    try:
        log = tmp_path / "vllm.log"
        tokens = prompt(PROMPT_TOKENS, seed=11)
        with vllm_serve(serve_command(hkv.endpoint), tmp_path, hkv.ray_address, log) as proc:
            await_ready(proc, http_port, log)
            phase("vllm serve ready")
            assert certified(hkv.endpoint, spec_file, tokens)[0] == 0  # a fresh hkv
            first = complete(http_port, str(model), tokens)
            deadline = time.monotonic() + 30.0  # saved in the step that computed the blocks
            while True:
                held, most = certified(hkv.endpoint, spec_file, tokens)
                if held == most or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert held == most > 0, (held, most)  # the prompt's whole blocks, all in hkv

            # 3. vLLM forgets its own prefix cache: what it reuses now can only come from hkv.
            for _ in range(10):
                if http(http_port, "/reset_prefix_cache")["success"]:
                    break
                time.sleep(1.0)
            else:
                raise AssertionError("vLLM would not reset its prefix cache")
            before = http(http_port, "/metrics")
            second = complete(http_port, str(model), tokens)
            deadline = time.monotonic() + 30.0
            while True:  # the step's stats reach the server's metrics with its outputs
                after = http(http_port, "/metrics")
                hits = (metric(after, "vllm:external_prefix_cache_hits_total")
                        - metric(before, "vllm:external_prefix_cache_hits_total"))
                if hits or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            local = (metric(after, "vllm:prefix_cache_hits_total")
                     - metric(before, "vllm:prefix_cache_hits_total"))
            phase("two completions done")
            assert proc.poll() is None, log.read_text()[-4000:]
        phase("vllm serve stopped")
        assert hits == held, (hits, held, log.read_text()[-4000:])
        assert local == 0
        assert second == first
        if which == "qwen3-next":  # the hit included each recurrent group's state
            spec = spec_file.read_text()
            assert spec.count("kind: RECURRENT") == 3 and "state_kind: GDN_ATTN" in spec
    finally:
        hkv.stop()
        phase("hkv up stopped")
