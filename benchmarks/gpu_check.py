"""The GPU check (issue 38 item 4), for a host with a CUDA device:

    PYTHONPATH=. python benchmarks/gpu_check.py            # prints one JSON object

1. the CUDA block pools in this process (no Ray): a write is readable only through its copy
   event, a reused block refuses its old generation (read and write), the bytes round-trip;
2. a real :class:`~workers.shard.ShardActor` in this process with CUDA pools: ``write_blocks``
   (H2D) and ``read_blocks`` (D2H) of one block of 64 KiB, 1 MiB, 4 MiB, 16 MiB and 64 MiB per
   call, against a plain ``torch`` H2D / D2H copy of the same bytes on this machine (from and
   to pinned host memory; pageable too), best of ``--reps``, ratios per size;
3. a shard in its own process with CUDA pools, SIGKILLed: the device's free memory
   (``cudaMemGetInfo``, all processes) drops by its pools while it runs and comes back after
   the kill.

Without CUDA it stops at once with a sentence saying so (exit status 2). It was written on a
machine without a GPU and has NOT been run on one: only ``--cpu-dry-run`` (the same steps on
host pools, step 3 measured as the system's shared memory, the shard's pool segment) was run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hkv_service.core.api import AdmissionCap, AllocRequest, StateConfig  # noqa: E402
from hkv_service.core.ids import BlockHash  # noqa: E402
from hkv_service.core.spec import spec_from_dict  # noqa: E402
from hkv_service.core.state_view import CacheState  # noqa: E402
from hkv_service.core.states import Event  # noqa: E402
from workers.commits import commit_many  # noqa: E402
from workers.local import LocalMetadata  # noqa: E402
from workers.pool import BlockPool, HandleBatch, StaleRead, StaleWrite  # noqa: E402
from workers.ports import Commit  # noqa: E402
from workers.shard import ShardActor, ShardConfig  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
SIZES = {"64KiB": 64 * KiB, "1MiB": MiB, "4MiB": 4 * MiB, "16MiB": 16 * MiB, "64MiB": 64 * MiB}
TOKENS = 64
NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False); this check "
           "needs a GPU host (a lent H200). Nothing was measured.")


def spec() -> Any:
    groups = [{"name": f"b{label}", "kind": "SWA", "block_size": TOKENS, "window": TOKENS,
               "abi": {"dtype": "uint8", "head_shape": [size // TOKENS]}}
              for label, size in SIZES.items()]
    return spec_from_dict({"model_id": "hkv-gpu-check", "hash_block_size": TOKENS,
                           "groups": groups})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best(fn: Callable[[], Any], reps: int, device: str) -> float:
    fn()
    sync(device)
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out = min(out, time.perf_counter() - t0)
    return out


# -- 1. the pools in process -------------------------------------------------------------------

def check_pools(device: str) -> dict[str, Any]:
    pool = BlockPool("c", 4 * MiB, 4, torch.device(device))
    data = np.random.default_rng(0).integers(0, 256, 4 * MiB, dtype=np.uint8)
    pool.write(1, 0, data, object_id=3)
    assert np.array_equal(pool.read(1, 0, 3), data), "bytes differ after a round trip"
    pool.write(1, 1, data[::-1].copy(), object_id=4)  # the block evicted and reused
    try:
        pool.read(1, 0, 3)
        raise AssertionError("a stale read was served")
    except StaleRead:
        pass
    try:
        pool.write(1, 0, data, object_id=3)
        raise AssertionError("a stale write was accepted")
    except StaleWrite:
        pass
    assert np.array_equal(pool.read(1, 1, 4), data[::-1])
    return {"device": str(pool.tensor.device), "base_align": pool.config.base_align, "ok": True}


# -- 2. a shard's reads and writes against plain copies ----------------------------------------

class InProcessShard:
    def __init__(self, device: str, tmp: str) -> None:
        self.meta = LocalMetadata(CacheState(spec(), StateConfig(AdmissionCap())))
        self.shard = ShardActor(ShardConfig("gpu", self.meta, tmp, blocks_per_group=3,
                                            disk_budget_bytes=64 * MiB,
                                            heartbeat_interval_s=60.0, device=device,
                                            shared_memory=False))
        self.next_hash = 1

    def fresh(self, label: str) -> HandleBatch:
        h = BlockHash(self.next_hash.to_bytes(16, "big"))
        self.next_hash += 1
        (a,) = self.meta.allocate([h], [AllocRequest(0, f"b{label}")], "gpu")  # type: ignore[arg-type]
        return HandleBatch.of([a.handle])

    def give_back(self, batch: HandleBatch) -> None:
        commit_many(self.meta, [(batch[0], Commit((Event.EVICT,)))])


def measure_shard(device: str, reps: int) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="hkv-gpu-check-") as tmp:
        s = InProcessShard(device, tmp)
        try:
            for label, size in SIZES.items():
                out[label] = _measure_size(s, device, label, size, reps)
        finally:
            s.shard.shutdown()
    return out


def _measure_size(s: InProcessShard, device: str, label: str, size: int,
                  reps: int) -> dict[str, float]:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    held = s.fresh(label)
    assert s.shard.write_blocks(held, [data])[0].ok

    def write() -> None:
        batch = s.fresh(label)
        t0 = time.perf_counter()
        res = s.shard.write_blocks(batch, [data])  # waits until readable (its copy event)
        times.append(time.perf_counter() - t0)
        assert res[0].ok, res[0]
        s.give_back(batch)

    times: list[float] = []
    for _ in range(reps + 1):
        write()
    write_s = min(times[1:])
    read_s = best(lambda: s.shard.read_blocks(held), reps, device)
    got = s.shard.read_blocks(held)[0]
    assert np.array_equal(got, data), f"{label}: bytes differ"
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    pinned = torch.from_numpy(data.copy())
    if device == "cuda":
        pinned = pinned.pin_memory()
    pageable = torch.from_numpy(data.copy())
    h2d = best(lambda: gpu.copy_(pinned, non_blocking=True), reps, device)
    d2h = best(lambda: pinned.copy_(gpu, non_blocking=True), reps, device)
    h2d_pageable = best(lambda: gpu.copy_(pageable), reps, device)
    d2h_pageable = best(lambda: pageable.copy_(gpu), reps, device)
    gb = size / 1e9
    return {"shard_write_gbps": gb / write_s, "shard_read_gbps": gb / read_s,
            "h2d_pinned_gbps": gb / h2d, "d2h_pinned_gbps": gb / d2h,
            "h2d_pageable_gbps": gb / h2d_pageable, "d2h_pageable_gbps": gb / d2h_pageable}


# -- 3. a killed shard's memory -------------------------------------------------------------

CHILD = r"""
import sys, tempfile, time
from hkv_service.core.state_view import CacheState
from workers.local import LocalMetadata
from workers.shard import ShardActor, ShardConfig
sys.path.insert(0, %(bench)r)
from gpu_check import spec
meta = LocalMetadata(CacheState(spec()))
shard = ShardActor(ShardConfig("victim", meta, tempfile.mkdtemp(), blocks_per_group=4,
                               heartbeat_interval_s=60.0, device=%(device)r))
print(shard.pools.nbytes(), flush=True)
time.sleep(3600)
"""


def free_bytes(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    with open("/proc/meminfo") as f:  # host pools: the shard's segment is shared memory
        shmem = next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))
    return -shmem * 1024


def check_kill_frees(device: str, timeout_s: float = 60.0) -> dict[str, Any]:
    before = free_bytes(device)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.Popen([sys.executable, "-c", CHILD % {"bench": str(Path(__file__).parent),
                                                             "device": device}],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None
        pool_bytes = int(child.stdout.readline())
        running = free_bytes(device)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + timeout_s
        after = free_bytes(device)
        while before - after > pool_bytes // 4 and time.monotonic() < deadline:
            time.sleep(0.2)
            after = free_bytes(device)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    taken, still = before - running, before - after
    return {"pool_bytes": pool_bytes, "taken_while_running": taken, "held_after_kill": still,
            "freed": taken >= pool_bytes * 3 // 4 and still <= pool_bytes // 4}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the same steps on host pools (checks this script, not a GPU)")
    args = ap.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    pools = check_pools(device)
    per = measure_shard(device, args.reps)
    kill = check_kill_frees(device)
    ratios = {}
    for label, m in per.items():
        ratios[f"shard_write_vs_h2d_pinned_{label}"] = round(
            m["shard_write_gbps"] / m["h2d_pinned_gbps"], 3)
        ratios[f"shard_read_vs_d2h_pinned_{label}"] = round(
            m["shard_read_gbps"] / m["d2h_pinned_gbps"], 3)
    print(json.dumps({
        "name": "gpu_check", "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "pools_in_process": pools,
        "figures": {k: {n: round(v, 3) for n, v in m.items() if n.startswith("shard_")}
                    for k, m in per.items()},
        "baseline": {k: {n: round(v, 3) for n, v in m.items() if not n.startswith("shard_")}
                     for k, m in per.items()},
        "ratios": ratios, "killed_shard_memory": kill,
        "note": ("dry run on host pools: the ratios compare host copies (a host pool's read "
                 "hands out a view) and mean nothing; steps 1 and 3 are checked")
        if device == "cpu" else "first run on a GPU: the script was never run on one before",
    }, indent=1))
    return 0 if kill["freed"] else 1


if __name__ == "__main__":
    sys.exit(main())
