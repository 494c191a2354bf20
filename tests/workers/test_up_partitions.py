"""`hkv up --service-replicas 2`, the production path (issue 19): two `hkv serve` partitions,
real Ray shards, a worker attached as the README's is. A prompt lives in its root's partition;
one partition's process SIGKILLed is restarted by hkv up on its port and rebuilt from the
shard's re-confirm of that partition only, while the other keeps answering the same hit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import ray

from hkv_service.core.errors import HkvError
from hkv_service.core.funnel import LookupRequest
from hkv_service.core.partitions import partition_of_root
from workers.attach import attach

ROOT = Path(__file__).resolve().parents[2]
_PID = re.compile(r"partition (\d+)/2 \(pid (\d+)\) listening")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))


def _group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid=,stat="], capture_output=True, text=True,
                         check=True).stdout
    return [int(p) for p, g, st in (line.split()[:3] for line in out.splitlines())
            if int(g) == pgid and not st.startswith("Z")]


def _until_ready(proc: subprocess.Popen[str]) -> tuple[list[str], str, str]:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.rstrip())
        if line.startswith("hkv up: worker: "):
            ray_address = line.split("ray_address=")[1].rstrip(")\n").strip("'\"")
            endpoint = next(ln.split()[-1] for ln in lines if ln.startswith("hkv up: endpoint"))
            return lines, endpoint, ray_address
    raise AssertionError("hkv up did not come up:\n" + "\n".join(lines))


def _usable(meta: Any, hashes: list[bytes]) -> int | None:
    try:
        return int(meta.lookup(LookupRequest(hashes)).usable_tokens)
    except HkvError:  # that partition is down (UNAVAILABLE) or restarting
        return None


def test_a_partition_killed_is_rebuilt_while_the_other_serves(tmp_path: Path, w: Any) -> None:
    w.clear_stale_ray()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hkv_service.cli", "up", "--service-replicas", "2", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--blocks-per-group", "64",
         "--disk-budget-bytes", str(16 << 20), "--heartbeat-timeout-s", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(),
        start_new_session=True, cwd=tmp_path)
    worker = None
    try:
        lines, endpoint, ray_address = _until_ready(proc)
        pids = {int(m.group(1)): int(m.group(2)) for ln in lines if (m := _PID.search(ln))}
        assert sorted(pids) == [0, 1], lines
        assert len(endpoint.split(",")) == 2
        worker = attach(endpoint, ray_address=ray_address)
        stats = worker.meta.stats()
        assert [p["partition"] for p in stats["partitions"]] == ["0/2", "1/2"]
        assert all(p["gauges"]["owners_alive"] == 1 for p in stats["partitions"])

        prompts: dict[int, list[bytes]] = {}
        seed = 0
        while len(prompts) < 2:
            hashes = w.prompt(6, seed=seed)
            prompts.setdefault(partition_of_root(hashes[0], 2), hashes)
            seed += 1
        for i, hashes in prompts.items():
            blocks, tails = w.prefix_payload(worker.layout, 6, seed=i)
            assert worker.plane.write_prefix(hashes, blocks, tails).ok
        hit = {i: _usable(worker.meta, h) for i, h in prompts.items()}
        assert all(v and v > 0 for v in hit.values()), hit

        os.kill(pids[1], signal.SIGKILL)
        others, back = [], None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            others.append(_usable(worker.meta, prompts[0]))
            back = _usable(worker.meta, prompts[1])
            if back == hit[1]:
                break
            time.sleep(0.2)
        assert back == hit[1], "partition 1 did not come back with its hit"
        assert others and all(v == hit[0] for v in others), others  # never a miss or an error
        stats = worker.meta.stats()
        part0, part1 = stats["partitions"]
        assert part0["events"].get("owner_lost", 0) == 0  # partition 0 never lost the shard
        assert part1["gauges"]["owners_alive"] == 1
        worker.close()
        worker = None
        ray.shutdown()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        time.sleep(1.0)
        assert _group_pids(proc.pid) == []
    finally:
        if worker is not None:
            worker.close()
        ray.shutdown()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if _group_pids(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
