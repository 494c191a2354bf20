"""kill -9 soak (issue 35; ``-m slow``): >= 50 cycles of SIGKILLs of the shard and of
``hkv serve`` under a real ``hkv up``, with a writer and a reader attached in another process.

The writer writes prompts whose bytes are a function of (prompt, slot), offloads each to the
shard's disk tier and notes the prompts whose every object the tier acknowledged (offload
OK: OFFLOAD_COMMITTED applied). The reader reads prompts the writer wrote and compares every
byte a read returns with what was written. After the last kill, once the shard and service
are back, every prompt acknowledged on disk must still be a full hit whose bytes read back
right. Figures: cycles, reads checked, wrong bytes (must be 0), prompts acknowledged and lost
(must be 0).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from workers.attach import _token_auth_if_available
from workers.launcher import clear_stale_ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

ROOT = Path(__file__).resolve().parents[2]
CYCLES = 50  # each a shard kill and a service kill
SERVE_S = 3.0  # between a kill and the one before it came back: the workload runs

WORKER = r"""
import json, sys, threading, time
from pathlib import Path
import numpy as np
from workers.attach import attach
from workers.dataplane import Recompute

hkv = attach(sys.argv[1], ray_address=sys.argv[2], timeout_s=5.0)
stop = Path(sys.argv[3])
lay = hkv.layout
TOKENS = 257  # four whole hash blocks and one token to compute: resumable at 256
FULL = 256

def prompt(i):
    return np.random.default_rng(i).integers(0, 50_000, TOKENS)

def payload(i, d, c, n=0):
    size = lay.object_bytes(c, d, tail_len=n) if n else lay.object_bytes(c, d)
    return np.random.default_rng((i, d, c)).integers(0, 256, size, np.uint8)

written, acked = [], []  # prompts written whole; and acknowledged on disk
figures = {"reads": 0, "wrong": 0, "recomputes": 0, "writes": 0, "write_failures": 0}
lock = threading.Lock()

def check(i, match, out):
    for name, arrays in out.items():
        c = lay.by_name[name]
        col = lay.columns[c]
        for d, arr in zip(lay.needed_depths(c, match.usable_tokens), arrays):
            n = col.tail_tokens_at((d + 1) * lay.hash_block) if col.kind.value == "TAIL" else 0
            if arr.tobytes() != payload(i, d, c, n).tobytes():
                return False
    return True

def writer():
    i = 0
    while not stop.exists():
        hashes = hkv.hashes(prompt(i))
        blocks, tails = {}, {}
        for d in range(len(hashes)):
            for c in lay.attached[d % lay.period]:
                col = lay.columns[c]
                if col.kind.value == "TAIL":
                    n = col.tail_tokens_at((d + 1) * lay.hash_block)
                    tails[(d, col.name)] = (payload(i, d, c, n), n)
                else:
                    blocks[(d, col.name)] = payload(i, d, c)
        rep = hkv.plane.write_prefix(hashes, blocks, tails)
        with lock:
            figures["writes"] += 1
            figures["write_failures"] += bool(rep.failed)
        if rep.ok:
            with lock:
                written.append(i)
            res = hkv.plane.offload([rep.handles[s] for s in sorted(rep.handles)])
            if all(r.ok for r in res):
                with lock:
                    acked.append(i)
        i += 1
        time.sleep(0.05 if rep.ok else 0.3)  # (a failing call is quick: do not count it 10x)

def reader():
    rng = np.random.default_rng(1)
    while not stop.exists():
        with lock:
            if not written:
                continue
            i = int(written[rng.integers(0, len(written))])
        hashes, m = hkv.lookup(prompt(i))
        out = hkv.plane.read(m, hashes)
        missed = isinstance(out, Recompute) or m.usable_tokens == 0
        with lock:
            if missed:
                figures["recomputes"] += 1
            else:
                figures["reads"] += 1
                figures["wrong"] += not check(i, m, out)
        time.sleep(0.3 if missed else 0.02)

threads = [threading.Thread(target=f, daemon=True) for f in (writer, reader)]
for t in threads:
    t.start()
for t in threads:
    t.join()
# every prompt acknowledged on disk is a full hit again, its bytes right (the shard and the
# service are back: allow them a while)
lost = list(acked)
deadline = time.monotonic() + 120
while lost and time.monotonic() < deadline:
    still = []
    for i in lost:
        hashes, m = hkv.lookup(prompt(i))
        out = hkv.plane.read(m, hashes)
        if isinstance(out, Recompute) or m.usable_tokens < FULL:
            still.append(i)
        elif not check(i, m, out):
            figures["wrong"] += 1
    lost = still
    if lost:
        time.sleep(2)
figures.update(acked=len(acked), lost=len(lost), lost_prompts=lost[:20])
print("FIGURES " + json.dumps(figures), flush=True)
hkv.close()
"""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    out: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.put(line)
    threading.Thread(target=pump, daemon=True).start()
    return out


def _await(lines: queue.Queue[str], seen: list[str], pattern: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r}: {''.join(seen)[-4000:]}")


def _shard_pid(name: str, timeout_s: float = 120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(name, namespace="hkv")
            return int(ray.get(actor.ping.remote(), timeout=30)["pid"])
        except (ray.exceptions.RayError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_kill9_soak_serves_no_wrong_byte_and_loses_nothing_acknowledged(tmp_path: Path) -> None:
    clear_stale_ray()
    up = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--blocks-per-group",
         "512", "--heartbeat-timeout-s", "4", "--disk-budget-bytes", str(2 << 30),
         "--service-restarts", "200", "--shard-replacements", "200", "--restart-window-s", "600",
         "--data-dir", str(tmp_path / "hkv-data")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker: subprocess.Popen[str] | None = None
    stop = tmp_path / "stop"
    try:
        lines, seen = _lines(up), []
        line = _await(lines, seen, r"^hkv up: worker: ", 180)
        m = re.search(r"attach\('([^']+)', ray_address='([^']+)'", line)
        assert m, line
        endpoint, address = m.groups()
        service = int(re.search(r"metadata service \(pid (\d+)\)", "".join(seen)).group(1))
        _token_auth_if_available()
        ray.init(address=address, namespace="hkv", log_to_driver=False)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("shard-")]
        worker = subprocess.Popen([sys.executable, "-c", WORKER, endpoint, address, str(stop)],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        w_lines = _lines(worker)
        started = time.monotonic()
        for cycle in range(CYCLES):
            time.sleep(SERVE_S)  # the writer and reader get a while on a healthy system
            os.kill(_shard_pid(name), signal.SIGKILL)  # Ray restarts it, or hkv up replaces it
            _shard_pid(name)  # back
            time.sleep(SERVE_S)
            with contextlib.suppress(ProcessLookupError):  # died meanwhile: hkv up says so
                os.kill(service, signal.SIGKILL)
            restarted = _await(lines, seen, r"restarted as pid \d+", 120)
            service = int(re.search(r"restarted as pid (\d+)", restarted).group(1))
            assert up.poll() is None, f"hkv up stopped at cycle {cycle}: {''.join(seen)[-3000:]}"
            print(f"soak: cycle {cycle + 1} done at {time.monotonic() - started:.0f} s",
                  flush=True)
        stop.touch()
        w_seen: list[str] = []
        got = _await(w_lines, w_seen, r"^FIGURES ", 600)
        figures = json.loads(got.removeprefix("FIGURES "))
        figures.update(cycles=CYCLES, seconds=round(time.monotonic() - started))
        print("kill -9 soak:", json.dumps(figures))
        assert figures["wrong"] == 0, figures
        assert figures["lost"] == 0, figures
        assert figures["acked"] > 0 and figures["reads"] > 0, figures
        assert worker.wait(60) == 0
    finally:
        stop.touch()
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        ray.shutdown()
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
