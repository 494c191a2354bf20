"""Disk full through the shard (reliability row 9): the offload that does not fit fails as
DISK_FULL, its object stays in memory (never ON_DISK, its block not freed), every transfer
counter is released and what was already on disk stays intact. In process, no Ray: the shard
is the real ``ShardActor`` over a ``LocalMetadata`` view and a real LMDB tier.

Two ways to fill the disk: the tier's byte budget (an object larger than all of it), and the
file system itself (``RLIMIT_FSIZE`` in a child process, so LMDB's commit gets EFBIG/EIO).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkv_service.core.api import AllocRequest, Handle
from hkv_service.core.ids import BlockHash, ShardId
from hkv_service.core.states import Event, State
from storage import DiskKey
from storage.record import HEADER
from workers.local import LocalMetadata
from workers.ports import Commit, Outcome
from workers.shard import ShardActor, ShardConfig
from workers.tags import TAG, BlockTag

REPO_ROOT = Path(__file__).resolve().parents[2]
C4_RECORD = HEADER.size + TAG.size + 2048  # a c4 block on disk (random bytes stay raw)
SWA_RECORD = HEADER.size + TAG.size + 8192
BUDGET = 3 * C4_RECORD + 64  # room for three c4 blocks, never for one swa block
assert BUDGET < SWA_RECORD


@pytest.fixture
def shard(meta: LocalMetadata, data_dir: Path) -> Any:
    s = ShardActor(ShardConfig("s0", meta, str(data_dir), blocks_per_group=8,
                               disk_budget_bytes=BUDGET, heartbeat_interval_s=60.0,
                               device="cpu"))
    yield s
    s.shutdown()


def write(shard: ShardActor, meta: LocalMetadata, hashes: list[BlockHash], depth: int,
          column: str, data: np.ndarray) -> Handle:
    alloc = meta.allocate(hashes, [AllocRequest(depth, column)], ShardId("s0"))[0]
    tag = BlockTag(hashes[depth], hashes[depth - 1] if depth else None, depth)
    [res] = shard.write_blocks([alloc.handle], [data], [tag], [Commit((Event.WRITE_DONE,))])
    assert res.ok, res
    return alloc.handle


def payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def read_back(shard: ShardActor, h: Handle | None) -> np.ndarray:
    assert h is not None
    [out] = shard.read_blocks([h])
    assert isinstance(out, np.ndarray), out
    return out


def assert_kept_in_memory(shard: ShardActor, meta: LocalMetadata, h: Handle,
                          data: np.ndarray) -> None:
    """After a failed offload: the memory object is untouched and no disk copy exists."""
    rec = meta.state.objects[h.object_id]
    assert rec.state is State.SWA_VALID  # still readable, never became ON_DISK
    assert (rec.block, rec.generation) == (h.block, h.generation)  # block not freed
    disk = rec.entry.disk[h.column] if rec.entry.disk else None
    assert disk is None  # the rolled-back DISK copy is gone, not left OFFLOADING/ON_DISK
    assert np.array_equal(read_back(shard, h), data)


def assert_no_transfer_in_flight(shard: ShardActor, meta: LocalMetadata) -> None:
    assert meta.state.admission.stats().in_transit_objects == 0
    assert shard.disk.gate.stats().in_transit_objects == 0
    assert not [r for r in meta.state.objects.values() if r.state is State.OFFLOADING]


def test_offload_over_the_budget_is_disk_full_and_keeps_the_memory_copy(
    shard: ShardActor, meta: LocalMetadata, w: Any
) -> None:
    hashes = w.prompt(3, seed=21)
    c4 = {d: payload(2048, d) for d in range(2)}
    on_disk = [shard.offload([write(shard, meta, hashes, d, "c4", c4[d])], evict_memory=True)[0]
               for d in range(2)]
    assert all(r.ok and r.handle is not None for r in on_disk), on_disk
    swa_data = payload(8192, 99)
    swa = write(shard, meta, hashes, 0, "swa", swa_data)

    [res] = shard.offload([swa], evict_memory=True)

    assert res.outcome is Outcome.DISK_FULL and "budget" in res.detail, res
    assert_kept_in_memory(shard, meta, swa, swa_data)
    assert_no_transfer_in_flight(shard, meta)
    # What was on disk before stays there, verifies and loads back byte for byte.
    assert shard.disk.check_integrity() == []
    c4_abi = meta.state.layout.columns[meta.state.layout.by_name["c4"]].abi_fingerprint
    stored = {m.key for m in shard.disk.scan(verify=True)}
    assert stored == {DiskKey(bytes(hashes[d]), "c4", "COMPRESSED", c4_abi) for d in range(2)}
    for d, r in enumerate(on_disk):
        assert r.handle is not None
        assert meta.state.objects[r.handle.object_id].state is State.ON_DISK
        [ld] = shard.load([(r.handle, hashes[d])])
        assert ld.ok and ld.handle is not None, ld
        assert np.array_equal(read_back(shard, ld.handle), c4[d])
    # The tier is still usable: an object that fits goes to disk after the refusal.
    c4[2] = payload(2048, 2)
    [fits] = shard.offload([write(shard, meta, hashes, 2, "c4", c4[2])])
    assert fits.ok and fits.handle is not None, fits
    assert meta.state.objects[fits.handle.object_id].state is State.ON_DISK


def test_disk_full_item_in_a_batch_fails_alone(shard: ShardActor, meta: LocalMetadata,
                                               w: Any) -> None:
    """One offload call, [c4, swa, c4]: the whole batch's put fails, then each item is put on
    its own; only the item that cannot fit is DISK_FULL, only the others leave memory."""
    hashes = w.prompt(2, seed=22)
    data = [payload(2048, 1), payload(8192, 2), payload(2048, 3)]
    handles = [write(shard, meta, hashes, 0, "c4", data[0]),
               write(shard, meta, hashes, 0, "swa", data[1]),
               write(shard, meta, hashes, 1, "c4", data[2])]

    results = shard.offload(handles, evict_memory=True)

    assert [r.outcome for r in results] == [Outcome.OK, Outcome.DISK_FULL, Outcome.OK], results
    assert_kept_in_memory(shard, meta, handles[1], data[1])
    assert_no_transfer_in_flight(shard, meta)
    for i in (0, 2):
        res = results[i]
        assert res.handle is not None
        assert handles[i].object_id not in meta.state.objects  # evicted: it is on disk now
        assert meta.state.objects[res.handle.object_id].state is State.ON_DISK
        [ld] = shard.load([(res.handle, hashes[i // 2])])
        assert ld.ok and ld.handle is not None, ld
        assert np.array_equal(read_back(shard, ld.handle), data[i])
    assert shard.disk.stats().entries == 2 and shard.disk.check_integrity() == []



def test_a_loaded_copy_the_full_tier_evicts_leaves_no_ghost_on_disk(
    shard: ShardActor, meta: LocalMetadata, w: Any
) -> None:
    """Regression: a full tier makes room by evicting its least recently used record and the
    shard reports that to the view with ``evict``. For a DISK object loaded back into memory
    (ON_DISK_READY) ``evict`` only drops the memory copy, so the object went back to ON_DISK,
    "at rest on disk" with its bytes gone: lookups kept offering it for loading, every load
    answered NOT_HERE and nothing ever removed it."""
    hashes = w.prompt(4, seed=23)
    data = {d: payload(2048, 40 + d) for d in range(4)}
    [first] = shard.offload([write(shard, meta, hashes, 0, "c4", data[0])], evict_memory=True)
    assert first.ok and first.handle is not None, first
    [loaded] = shard.load([(first.handle, hashes[0])])
    assert loaded.ok and meta.state.objects[first.handle.object_id].state is State.ON_DISK_READY
    later = [shard.offload([write(shard, meta, hashes, d, "c4", data[d])], evict_memory=True)[0]
             for d in (1, 2, 3)]  # the third needs room: the first is the oldest record
    assert all(r.ok and r.handle is not None for r in later), later

    key = DiskKey(bytes(hashes[0]), "c4", "COMPRESSED", first.handle.abi_fingerprint)
    assert not shard.disk.contains(key) and shard.disk.stats().evicted == 1
    assert first.handle.object_id not in meta.state.objects  # gone with its bytes
    entry = meta.state.index.get(hashes[0])
    assert entry is None or entry.disk is None or entry.disk[first.handle.column] is None
    assert_no_transfer_in_flight(shard, meta)
    for d, r in zip((1, 2, 3), later, strict=True):  # the records kept load back exactly
        assert r.handle is not None
        [ld] = shard.load([(r.handle, hashes[d])])
        assert ld.ok and ld.handle is not None, ld
        assert np.array_equal(read_back(shard, ld.handle), data[d])

def test_a_record_the_tier_lost_under_a_reader_ends_its_disk_object_at_the_next_load(
    shard: ShardActor, meta: LocalMetadata, w: Any
) -> None:
    """Regression: when the full tier evicted a loaded copy's record while a reader held that
    copy, both ``evict`` reports were refused (held), the object stayed ON_DISK_READY with its
    disk bytes gone, and once the copy was dropped it sat ON_DISK for good: offered for loading
    by every lookup, every load answering NOT_HERE. The disk owner's own load now ends it."""
    hashes = w.prompt(4, seed=29)
    data = {d: payload(2048, 60 + d) for d in range(4)}
    [first] = shard.offload([write(shard, meta, hashes, 0, "c4", data[0])], evict_memory=True)
    assert first.ok and first.handle is not None, first
    oid = first.handle.object_id
    [loaded] = shard.load([(first.handle, hashes[0])])
    assert loaded.ok and loaded.handle is not None
    rec = meta.state.objects[oid]
    meta.state.holds.pins[rec] = 1  # a reader holds the loaded copy
    later = [shard.offload([write(shard, meta, hashes, d, "c4", data[d])], evict_memory=True)[0]
             for d in (1, 2, 3)]  # the third needs room: the first record goes
    assert all(r.ok for r in later), later
    key = DiskKey(bytes(hashes[0]), "c4", "COMPRESSED", first.handle.abi_fingerprint)
    assert not shard.disk.contains(key)
    assert rec.state is State.ON_DISK_READY  # the reader's copy was left alone ...
    assert np.array_equal(read_back(shard, loaded.handle), data[0])  # ... and reads right
    del meta.state.holds.pins[rec]
    meta.evict(oid)  # memory pressure later drops the copy: at rest, bytes long gone
    assert rec.state is State.ON_DISK
    [ld] = shard.load([(first.handle, hashes[0])])
    assert ld.outcome is Outcome.NOT_HERE and not ld.ok
    assert rec.state is State.LOST  # never offered for loading again
    assert_no_transfer_in_flight(shard, meta)


FSIZE_CHILD = """
import json, os, resource, signal, sys
import numpy as np
from hkv_service.core.ids import ShardId
from hkv_service.core.state_view import AllocRequest, CacheState, StateConfig
from hkv_service.core.states import Event, State
from hkv_service.specs import default_spec
from workers.local import LocalMetadata
from workers.ports import Commit, Outcome
from workers.tags import BlockTag
from workers.shard import ShardActor, ShardConfig

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(2), not killed
meta = LocalMetadata(CacheState(default_spec(), StateConfig()))
shard = ShardActor(ShardConfig("s0", meta, sys.argv[1], blocks_per_group=64,
                               disk_budget_bytes=1 << 30, heartbeat_interval_s=60.0,
                               device="cpu"))
data_mdb = os.path.join(sys.argv[1], "s0", "data.mdb")
limit = os.path.getsize(data_mdb) + (160 << 10)  # room for about 18 swa records
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
hashes = [bytes([d]) * 16 for d in range(64)]
def block(d):
    return np.random.default_rng(d).integers(0, 256, 8192, dtype=np.uint8)
acked, full, other = [], None, []
for d in range(64):
    a = meta.allocate(hashes[: d + 1], [AllocRequest(d, "swa")], ShardId("s0"))[0]
    tag = BlockTag(hashes[d], hashes[d - 1] if d else None, d)
    [wr] = shard.write_blocks([a.handle], [block(d)], [tag], [Commit((Event.WRITE_DONE,))])
    assert wr.ok, wr
    [res] = shard.offload([a.handle], evict_memory=True)
    if res.ok:
        acked.append((d, res.handle))
        continue
    if res.outcome is Outcome.DISK_FULL:
        full = (d, a.handle, res.detail)
    else:
        other.append(str(res))
    break
report = {"acked": len(acked), "other": other, "full_detail": full and full[2]}
if full is not None:
    d, h, _ = full
    rec = meta.state.objects[h.object_id]
    out = shard.read_blocks([h])[0]
    report["kept_state"] = rec.state.value
    report["kept_block"] = [rec.block, rec.generation] == [h.block, h.generation]
    report["kept_bytes"] = bool(np.array_equal(out, block(d)))
    report["disk_copy"] = rec.entry.disk is not None and rec.entry.disk[h.column] is not None
report["in_transit"] = [meta.state.admission.stats().in_transit_objects,
                        shard.disk.gate.stats().in_transit_objects]
loads = [shard.load([(dh, hashes[d])])[0] for d, dh in acked]
report["loads_ok"] = all(r.ok for r in loads)
report["loads_exact"] = all(bool(np.array_equal(shard.read_blocks([r.handle])[0], block(d)))
                            for (d, _), r in zip(acked, loads) if r.ok)
report["integrity"] = shard.disk.check_integrity()
shard.shutdown()
print(json.dumps(report))
"""


def test_file_system_full_under_the_shard_is_disk_full(data_dir: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(data_dir / "fs")],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["other"] == [] and out["full_detail"], out  # DISK_FULL, not FAILED or a crash
    assert "disk write failed" in out["full_detail"]  # the file system, not the byte budget
    assert 2 <= out["acked"] < 64
    assert out["kept_state"] == State.SWA_VALID.value and out["kept_block"], out
    assert out["kept_bytes"] and not out["disk_copy"], out
    assert out["in_transit"] == [0, 0]
    assert out["loads_ok"] and out["loads_exact"] and out["integrity"] == [], out

