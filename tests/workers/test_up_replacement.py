"""A shard replaced under a running worker comes back and serves it (issue 35, item 5), through
a real ``hkv up`` and a worker in its own process that ``attach``-ed before the replacement.

The issue's recipe: ``hkv up --heartbeat-timeout-s 4``; a worker loops (write a new prompt,
offload it, read an old one); SIGKILL the shard's process twice, 5 s apart (its one Ray
restart used up, ``hkv up`` places a new actor under the same name). Before the fix the
worker's links named the dead actor: every call failed, and the data plane reported the new
shard lost with witnesses from fresh lookups (the new incarnation's), mid-registration, every
time: ~8 failed placements in 100 s and no shard, until the worker exited.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ray

from workers.attach import _token_auth_if_available
from workers.launcher import clear_stale_ray

ROOT = Path(__file__).resolve().parents[2]

WORKER = r"""
import sys, time
import numpy as np
from workers.attach import attach
from workers.dataplane import Recompute

hkv = attach(sys.argv[1], ray_address=sys.argv[2], timeout_s=5.0)
lay = hkv.layout
rng = np.random.default_rng(0)
prompts = []
end = time.monotonic() + float(sys.argv[3])
i = 0
while time.monotonic() < end:
    prompt = rng.integers(0, 50_000, 256)
    prompts.append(prompt)
    hashes, match = hkv.lookup(prompt)
    blocks, tails = {}, {}
    for d in range(len(hashes)):
        for c in lay.attached[d % lay.period]:
            col = lay.columns[c]
            if col.kind.value == "TAIL":
                n = col.tail_tokens_at((d + 1) * lay.hash_block)
                tails[(d, col.name)] = (np.full(lay.object_bytes(c, d, tail_len=n), i % 251,
                                                np.uint8), n)
            else:
                blocks[(d, col.name)] = np.full(lay.object_bytes(c, d), i % 251, np.uint8)
    report = hkv.plane.write_prefix(hashes, blocks, tails)
    hkv.plane.offload([h for s, h in report.handles.items() if s in report.wrote])
    old_hashes, old = hkv.lookup(prompts[max(0, len(prompts) - 3)])
    got = hkv.plane.read(old, old_hashes)
    read = "recompute" if isinstance(got, Recompute) else f"read {old.usable_tokens}"
    print(f"{time.monotonic():.2f} wrote {report.written} failed {len(report.failed)} {read}",
          flush=True)
    i += 1
    time.sleep(0.1)
print("worker done", flush=True)
hkv.close()
"""


def _pump(proc: subprocess.Popen[str], out: queue.Queue[tuple[float, str]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        out.put((time.monotonic(), line))


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[tuple[float, str]]:
    out: queue.Queue[tuple[float, str]] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, out), daemon=True).start()
    return out


def _await(lines: queue.Queue[tuple[float, str]], seen: list[tuple[float, str]], pattern: str,
           timeout_s: float, after: float = 0.0) -> tuple[float, str]:
    """The first line matching ``pattern`` printed at or after ``after``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(got)
        if got[0] >= after and re.search(pattern, got[1]):
            return got
    raise AssertionError(f"no line matching {pattern!r}: {''.join(s for _, s in seen)[-4000:]}")


def _shard_pid(name: str, timeout_s: float = 90.0) -> int:
    """The pid of the shard's process, once it answers (a restart takes a while)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            actor = ray.get_actor(name, namespace="hkv")
            return int(ray.get(actor.ping.remote(), timeout=30)["pid"])
        except (ray.exceptions.RayError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_a_replaced_shard_serves_a_worker_attached_before(tmp_path: Path) -> None:
    clear_stale_ray()
    up = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--port", "0", "--blocks-per-group",
         "256", "--heartbeat-timeout-s", "4", "--data-dir", str(tmp_path / "hkv-data")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    worker: subprocess.Popen[str] | None = None
    try:
        up_lines, up_seen = _lines(up), []
        _, line = _await(up_lines, up_seen, r"^hkv up: worker: ", 180)
        m = re.search(r"attach\('([^']+)', ray_address='([^']+)'", line)
        assert m, line
        endpoint, address = m.groups()
        _token_auth_if_available()  # a local hkv up runs Ray with token auth
        ray.init(address=address, namespace="hkv", log_to_driver=False)
        (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith("shard-")]
        worker = subprocess.Popen([sys.executable, "-c", WORKER, endpoint, address, "45"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        w_lines, w_seen = _lines(worker), []
        _await(w_lines, w_seen, r"wrote \d+ failed 0 read", 120)  # serving

        os.kill(_shard_pid(name), signal.SIGKILL)  # Ray restarts it (its one restart)
        time.sleep(5)
        os.kill(_shard_pid(name), signal.SIGKILL)  # dead for good: hkv up replaces it
        _await(up_lines, up_seen, r"died for good", 60)
        placed, _ = _await(up_lines, up_seen, r"shard\(s\) placed", 60)
        back, _ = _await(w_lines, w_seen, r"wrote [1-9]\d* failed 0 read", 60, after=placed)
        assert back - placed <= 10.0, f"the worker reached the new shard {back - placed:.1f} s " \
                                      "after it was placed"
        assert worker.poll() is None  # the worker never died with the shard
        lost = "".join(s for _, s in up_seen).count("died for good")
        assert lost == 1, "".join(s for _, s in up_seen)  # replaced once, then it stays
        _await(w_lines, w_seen, r"worker done", 120)
        assert worker.wait(30) == 0
    finally:
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
