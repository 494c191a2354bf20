"""A shard restarted under another kernel ABI (reliability row 17): what its disk tier holds
for the old ABI is never vouched for under the new one. In process, no Ray.

Block hashes cover the model id and the tokens, not the dtype, layout or kernel version, so
after such a change the same prefix hashes to the same blocks; only the ABI fingerprint in
each disk key tells the two layouts' bytes apart.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from hkv_service.core.api import AllocRequest, StateConfig
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.spec import CacheSpec
from hkv_service.core.state_view import CacheState
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from storage import DiskKey
from workers.local import LocalMetadata
from workers.ports import Commit
from workers.shard import ShardActor, ShardConfig
from workers.tags import BlockTag


def _shard(meta: LocalMetadata, data_dir: Path) -> ShardActor:
    return ShardActor(ShardConfig("s0", meta, str(data_dir), blocks_per_group=8,
                                  heartbeat_interval_s=60.0, device="cpu"))


def _with_kernel(spec: CacheSpec, group: str, kernel_version: str) -> CacheSpec:
    groups = tuple(
        dataclasses.replace(g, abi=dataclasses.replace(g.abi, kernel_version=kernel_version))
        if g.name == group else g
        for g in spec.groups
    )
    return dataclasses.replace(spec, groups=groups)


def _offload(shard: ShardActor, meta: LocalMetadata, hashes: list[BlockHash],
             column: str, nbytes: int) -> None:
    alloc = meta.allocate(hashes, [AllocRequest(0, column)], ShardId("s0"))[0]
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    tag = BlockTag(hashes[0], None, 0)
    [wr] = shard.write_blocks([alloc.handle], [data], [tag], [Commit((Event.WRITE_DONE,))])
    assert wr.ok, wr
    [off] = shard.offload([alloc.handle], evict_memory=True)
    assert off.ok, off


def test_restart_under_a_new_abi_does_not_confirm_the_old_abis_records(
    data_dir: Path, w: Any
) -> None:
    """Regression: the shard re-confirmed every record whose group name the new spec knew,
    whatever its ABI. The view then held an ON_DISK copy of c4 (counted by lookups as a
    prefix to load) whose bytes were laid out for the old kernel; every load of it answered
    NOT_HERE (the handle carries the new ABI) and the copy stayed ON_DISK for good."""
    old = default_spec()
    hashes = w.prompt(1, seed=31)
    meta = LocalMetadata(CacheState(old, StateConfig()))
    shard = _shard(meta, data_dir)
    _offload(shard, meta, hashes, "c4", 2048)
    _offload(shard, meta, hashes, "swa", 8192)
    shard.shutdown()

    new = _with_kernel(old, "c4", "csa-2")  # c4's kernel changed; swa's did not
    meta = LocalMetadata(CacheState(new, StateConfig()))
    shard = _shard(meta, data_dir)
    try:
        lay = meta.state.layout
        c4, swa = lay.by_name["c4"], lay.by_name["swa"]
        assert lay.columns[c4].abi_fingerprint != old_fingerprint(old, "c4")
        assert lay.columns[swa].abi_fingerprint == old_fingerprint(old, "swa")
        assert shard.confirmed == 1  # the swa record only
        entry = meta.state.index[hashes[0]]
        assert entry.disk is not None and entry.disk[c4] is None
        disk_swa = entry.disk[swa]
        assert disk_swa is not None and disk_swa.state is State.ON_DISK
        # The old ABI's record is left alone on disk under its own key (not ours to delete).
        old_key = DiskKey(bytes(hashes[0]), "c4", "COMPRESSED", old_fingerprint(old, "c4"))
        assert shard.disk.contains(old_key)
    finally:
        shard.shutdown()


def old_fingerprint(spec: CacheSpec, group: str) -> int:
    return next(g.abi.fingerprint() for g in spec.groups if g.name == group)
