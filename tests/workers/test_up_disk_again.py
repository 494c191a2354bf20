"""A restarted ``hkv up`` on the same ``--data-dir`` finds its shards' disk tiers again (issue
35 item 6).

A shard's tier is ``DATA_DIR/shard-<key>-<k>``. The key was Ray's node id, new on every run: a
restarted ``hkv up`` opened an empty directory, the disk cache was lost on every restart (and
left on disk, outside any budget). The key is now the one the node's data dir holds
(``workers.nodekey``).

Real processes: ``hkv up`` started, a worker (a fresh process, ``attach``) writes a prompt of
random bytes and offloads every block to the disk tier (memory copies evicted); ``hkv up`` is
stopped (SIGTERM) and started again on the same data dir; a new worker's lookup of the prompt
is a disk hit (``needs_load``) and its read returns the same bytes.
"""

from __future__ import annotations

import importlib.util
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from up_proc import ROOT, Up, env

WORKER = r"""
import sys
import numpy as np
from workers.attach import attach
from workers.dataplane import Recompute

hkv = attach(sys.argv[1], ray_address=sys.argv[2], timeout_s=20.0)
lay = hkv.layout
tokens = np.random.default_rng(7).integers(0, 50_000, 4 * lay.hash_block + 1)
hashes = hkv.hashes(tokens)
rng = np.random.default_rng(8)
blocks, tails, want = {}, {}, {}
for d in range(len(hashes)):
    for c in lay.attached[d % lay.period]:
        col = lay.columns[c]
        n = col.tail_tokens_at((d + 1) * lay.hash_block) if col.kind.value == "TAIL" else 0
        size = lay.object_bytes(c, d, tail_len=n) if n else lay.object_bytes(c, d)
        data = rng.integers(0, 256, size, dtype=np.uint8)
        if n:
            tails[(d, col.name)] = (data, n)
        else:
            blocks[(d, col.name)] = data
        want[(col.name, d)] = data.tobytes()
if sys.argv[3] == "cold":  # a damaged tier was set aside: nothing to reuse, writes go on
    _, match = hkv.lookup(tokens)
    wrote = hkv.plane.write_prefix(hashes, blocks, tails)
    print(f"RESULT usable={match.usable_tokens} written={wrote.written} ok={wrote.ok}")
    sys.exit(0)
if sys.argv[3] == "write":
    assert hkv.plane.write_prefix(hashes, blocks, tails).ok
    _, match = hkv.lookup(tokens)
    handles = [h for hs in match.handles.values() for h in hs]
    hkv.meta.release_lease(match.lease_id)
    done = hkv.plane.offload(handles, evict_memory=True)
    assert all(r.ok for r in done), done
_, match = hkv.lookup(tokens)
got = hkv.plane.read(match, hashes)
assert not isinstance(got, Recompute), got
same = all([a.tobytes() for a in arrays] == [
    want[(col, d)] for d in lay.needed_depths(lay.by_name[col], match.usable_tokens)]
    for col, arrays in got.items())
print(f"RESULT usable={match.usable_tokens} needs_load={match.needs_load} same={same}")
"""


def _storage_helper(name: str) -> Any:
    """tests/storage's LMDB page helpers (test folders are not packages)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "storage" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)  # dataclasses look their module up while made
    spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _worker(endpoint: str, ray_address: str, mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", WORKER, endpoint, ray_address, mode],
                          capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))


def test_a_restarted_hkv_up_finds_its_disk_tier_again(tmp_path: Path, w: Any) -> None:
    data = tmp_path / "data"
    results = []
    for mode in ("write", "read"):
        w.clear_stale_ray()
        up = Up(tmp_path, data)
        try:
            endpoint, ray_address = up.ready()
            results.append(_worker(endpoint, ray_address, mode))
        finally:
            assert up.stop() == 0, up.text()
    # Both runs: the whole prompt (4 blocks) from disk, byte for byte. The second run's
    # service started empty: the hit is the disk tier its shard found and re-confirmed.
    assert results == ["RESULT usable=256 needs_load=True same=True"] * 2, results
    tiers = sorted(p.name for p in data.iterdir() if p.is_dir())
    assert len(tiers) == 1 and tiers[0].startswith("shard-"), tiers  # one, used by both


def test_a_tier_damaged_at_rest_starts_cold_under_hkv_up(tmp_path: Path, w: Any) -> None:
    """Issue 35 item 7 through a real ``hkv up``: the shard's ``data.mdb`` gets heavy damage at
    rest (256 random bit flips past the meta pages, and garbage over a B-tree page with its
    header kept, which LMDB follows: SIGBUS or an assertion in the old open, and a shard that
    crash-looped). Started again on that data dir, the shard starts cold: the tier is set
    aside (counted), the prompt is a miss, and writes go to the fresh tier."""
    lmdb_pages = _storage_helper("lmdb_pages")
    data = tmp_path / "data"
    w.clear_stale_ray()
    up = Up(tmp_path, data)
    try:
        endpoint, ray_address = up.ready()
        assert _worker(endpoint, ray_address, "write").startswith("RESULT usable=256")
    finally:
        assert up.stop() == 0, up.text()
    (tier,) = [p for p in data.iterdir() if p.is_dir()]
    mdb = next(tier.rglob("data.mdb"))
    pages = lmdb_pages.tree_pages(mdb.read_bytes())
    lmdb_pages.garble_page(mdb, pages[len(pages) // 2], seed=3, keep_header=True)
    raw = bytearray(mdb.read_bytes())
    rng = random.Random(3)
    first = 2 * lmdb_pages.meta(bytes(raw)).psize  # past the two meta pages
    for _ in range(256):
        raw[rng.randrange(first, len(raw))] ^= 1 << rng.randrange(8)
    mdb.write_bytes(bytes(raw))
    w.clear_stale_ray()
    up = Up(tmp_path, data)
    try:
        endpoint, ray_address = up.ready()
        got = _worker(endpoint, ray_address, "cold")
    finally:
        assert up.stop() == 0, up.text()
    assert got == "RESULT usable=0 written=16 ok=True", (got, up.text()[-3000:])
    aside = list(tier.rglob("set-aside/*-damaged"))
    assert len(aside) == 1 and (aside[0] / "REASON").read_text().strip(), aside
