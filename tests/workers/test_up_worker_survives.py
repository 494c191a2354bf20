"""A worker attached to ``hkv up``'s Ray outlives ``hkv up`` (issue 35 item 6, RELIABILITY.md
row 28): it recomputes, it does not die with hkv.

Ray ends a process whose GCS stays unreachable for ``gcs_rpc_server_reconnect_timeout_s``
(60 s by default): "Failed to connect to GCS within 60 seconds ... The program will
terminate", ``std::_Exit``, no Python exception. ``hkv up`` takes its local Ray down with it
when it stops (a signal, or a crash loop of its service), so a vLLM server whose connector had
joined that Ray died 60 s later. ``workers.attach.join_ray`` (what ``attach`` and the connector
call) joins with that timeout raised for the worker process.

The worker here is a fresh process, as a real one is: it attaches, writes a prompt, holds a
lookup's hit, and waits; ``hkv up`` is stopped (SIGTERM: its service, shards and Ray go); for
longer than Ray's timeout the worker keeps calling hkv, and every call fails the documented
way: a lookup answers "reuse nothing" with the reason SERVICE_UNAVAILABLE, a read of the held
hit is a ``Recompute``, a write reports every block failed. Slow: it waits out Ray's 60 s.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from up_proc import ROOT, Up, env

from workers.attach import GCS_RECONNECT_ENV

RAY_KILL_S = 60  # Ray's default gcs_rpc_server_reconnect_timeout_s
PAST_S = 15  # the worker keeps calling this long past it

WORKER = r"""
import sys, time
import numpy as np
from hkv_service.core.errors import HkvError
from workers.attach import attach
from workers.dataplane import Recompute

hkv = attach(sys.argv[1], ray_address=sys.argv[2], timeout_s=5.0)
prompt = np.random.default_rng(0).integers(0, 50_000, 1_000)
hashes, _ = hkv.lookup(prompt)
lay = hkv.layout
blocks, tails = {}, {}
for d in range(len(hashes)):
    for c in lay.attached[d % lay.period]:
        col = lay.columns[c]
        if col.kind.value == "TAIL":
            n = col.tail_tokens_at((d + 1) * lay.hash_block)
            tails[(d, col.name)] = (np.zeros(lay.object_bytes(c, d, tail_len=n), np.uint8), n)
        else:
            blocks[(d, col.name)] = np.zeros(lay.object_bytes(c, d), np.uint8)
assert hkv.plane.write_prefix(hashes, blocks, tails).ok
hashes, held = hkv.lookup(prompt, lease_ttl_s=60.0)  # a hit, read after hkv up is gone
assert held.usable_tokens > 0, held
print("READY", flush=True)
sys.stdin.readline()  # hkv up has stopped
start, until = time.monotonic(), float(sys.argv[3])
while time.monotonic() - start < until:
    at = time.monotonic() - start
    try:
        _, m = hkv.lookup(prompt)
        lookup = ",".join(d.reason.value for d in m.downgrades) if not m.usable_tokens else "hit"
    except HkvError as err:
        lookup = type(err).__name__
    got = hkv.plane.read(held, hashes)
    read = "Recompute" if isinstance(got, Recompute) else "bytes"
    report = hkv.plane.write_prefix(hashes, blocks, tails)
    write = "failed" if report.failed and not report.written else "written"
    print(f"CALLS at={at:.0f} lookup={lookup} read={read} write={write}", flush=True)
    time.sleep(2.0)
print("ALIVE", flush=True)
"""


def _pump(proc: subprocess.Popen[str], lines: list[str], ready: threading.Event) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if line.startswith("READY"):
            ready.set()
    ready.set()


@pytest.mark.slow
def test_a_worker_outlives_hkv_up_and_recomputes(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    up = Up(tmp_path, tmp_path / "data")
    worker: subprocess.Popen[str] | None = None
    lines: list[str] = []
    try:
        endpoint, ray_address = up.ready()
        worker_env = env()
        worker_env.pop(GCS_RECONNECT_ENV, None)  # Ray's default unless the join raises it
        worker = subprocess.Popen(
            [sys.executable, "-c", WORKER, endpoint, ray_address, str(RAY_KILL_S + PAST_S)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=worker_env, cwd=ROOT)
        ready = threading.Event()
        threading.Thread(target=_pump, args=(worker, lines, ready), daemon=True).start()
        assert ready.wait(180) and "READY" in lines, "\n".join(lines)

        assert up.stop() == 0, up.text()  # service, shards and Ray: all gone
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
        code = worker.wait(RAY_KILL_S + PAST_S + 120)
        out = "\n".join(lines)
        assert code == 0 and "ALIVE" in lines, out  # Ray would have ended it at 60 s
        calls = [ln.split() for ln in lines if ln.startswith("CALLS ")]
        assert int(calls[-1][1].removeprefix("at=")) > RAY_KILL_S, out  # still calling then
        assert {tuple(c[2:]) for c in calls} == {
            ("lookup=SERVICE_UNAVAILABLE", "read=Recompute", "write=failed")}, out
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        up.stop()
