"""SWA checkpoints survive churn in a spec without tails (issue 35, item 2), through the real
data plane, shard and pools: full attention + two sliding windows, H = 8, as every vLLM
connector geometry is (its full-attention group has no overlap, so no tail)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hkv_service.core.api import LookupRequest
from hkv_service.core.hashing import ExtraKeys, hash_blocks
from hkv_service.core.spec import spec_from_dict
from workers.dataplane import Recompute
from workers.inprocess import InProcessConfig, InProcessSystem

ABI = {"dtype": "float16", "layout": "NHD", "head_shape": [1, 8], "kernel_version": "k"}
SPEC = spec_from_dict({"model_id": "full-swa", "hash_block_size": 8, "groups": [
    {"name": "full", "kind": "COMPRESSED", "block_size": 64, "ratio": 1, "abi": ABI},
    {"name": "wide", "kind": "SWA", "block_size": 64, "window": 512, "abi": ABI},
    {"name": "narrow", "kind": "SWA", "block_size": 8, "window": 8, "abi": ABI}]})


def _prompt(seed: int) -> list[Any]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, 16 * 8)
    return hash_blocks(tokens, 8, ExtraKeys(SPEC.model_id))


def _payload(plane: Any, seed: int) -> dict[tuple[int, str], np.ndarray]:
    rng = np.random.default_rng(seed)
    lay = plane.layout
    return {(d, lay.columns[c].name): rng.integers(0, 256, lay.object_bytes(c, d), np.uint8)
            for d in range(16) for c in lay.attached[d % lay.period]}


def test_checkpoints_outlive_blocks_no_resume_point_needs(tmp_path: Path) -> None:
    system = InProcessSystem(SPEC, tmp_path, InProcessConfig(shards=1, blocks_per_group=16))
    try:
        plane = system.dataplane()
        a, pa = _prompt(1), _payload(plane, 1)
        checkpoints = {s: pa[s] for s in ((7, "narrow"), (15, "narrow"))}
        assert plane.write_prefix(a, checkpoints).ok  # the checkpoints first: oldest
        assert plane.write_prefix(a, {s: v for s, v in pa.items() if s not in checkpoints}).ok
        b, pb = _prompt(2), _payload(plane, 2)
        assert plane.write_prefix(b, {s: v for s, v in pb.items() if s[1] != "narrow"}).ok
        for d in range(12):  # b's narrow blocks, one write each: a's unneeded ones go first
            assert plane.write_prefix(b, {(d, "narrow"): pb[(d, "narrow")]}).ok
        for n, at in ((16, 15), (8, 7)):  # the checkpoints at 128 and at 64
            m = system.meta.lookup(LookupRequest(a[:n], lease_ttl_s=10.0))
            assert m.usable_tokens == n * 8, m.downgrades
            out = plane.read(m, a[:n])
            assert not isinstance(out, Recompute), out
            assert out["narrow"][-1].tobytes() == pa[(at, "narrow")].tobytes()
            assert out["full"][-1].tobytes() == pa[(at, "full")].tobytes()
    finally:
        system.close()
