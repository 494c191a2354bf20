"""Fault injection on a real LMDB env: bit flips on disk, kill -9 mid-write, disk and map full.

Reliability rows 7 (bit flip), 8 (torn write), 9 (disk full), 10 (map full).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from storage import CorruptEntry, DiskFull, DiskKey, DiskTier, NotOnDisk
from storage.verify import VERIFY_CHUNK

# Offsets inside the 72-byte header (see storage/record.py).
RAW_LEN_FIELD, RAW_CHECKSUM_FIELD, LAST_USED_FIELD, HEADER_CHECKSUM_FIELD = 9, 30, 60, 68
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # every zstd frame starts with it


@pytest.mark.parametrize(
    ("where", "reason"),
    [
        ("payload", "payload_checksum"),
        ("header", "header_checksum"),
        ("raw_checksum", "header_checksum"),
        ("last_used", "header_checksum"),
        ("header_checksum", "header_checksum"),
        ("zstd_payload", "zstd"),
    ],
)
def test_bit_flip_in_data_file_is_detected_and_quarantined(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path, where: str, reason: str
) -> None:
    tier = tier_factory()
    victim, others = h.make_key(0), [h.make_key(i) for i in range(1, 40)]
    noise = h.kv_bytes(70_000, seed=1234)
    # Big enough to live on LMDB overflow pages, which are written once (small records sit in
    # leaf pages, whose stale copy-on-write versions also remain in the file).
    payload = bytes(70_000) + noise[:20_000] if where == "zstd_payload" else noise
    assert tier.put(victim, payload).codec == (where == "zstd_payload")
    for i, key in enumerate(others):
        tier.put(key, h.kv_bytes(3000 + i, seed=i))
    header = _stored_header(tier, victim)
    tier.close()

    data = tmp_path / "disk" / "data.mdb"
    if where in ("payload", "zstd_payload"):
        start = _payload_start(h, data, payload, where)
        h.flip_bit(data, start + (5000 if where == "payload" else 40), bit=3)
    else:  # the header lives in a leaf page of its own sub-database
        field = {"header": RAW_LEN_FIELD, "raw_checksum": RAW_CHECKSUM_FIELD,
                 "last_used": LAST_USED_FIELD, "header_checksum": HEADER_CHECKSUM_FIELD}[where]
        _flip_every_copy(data, header, field, bit=3)

    tier = tier_factory()
    if where in ("payload", "zstd_payload"):  # found by the get that verifies the payload
        with pytest.raises(CorruptEntry) as err:
            tier.get(victim)
        assert err.value.reason == reason
    else:  # found at open: the catalog audit verifies every index entry
        assert tier.stats().corruption == 1 and not tier.contains(victim)
    assert _quarantine_reasons(tier) == [reason]
    stats = tier.stats()
    assert (stats.corruption, stats.quarantined, tier.quarantine_count()) == (1, 1, 1)
    with pytest.raises(NotOnDisk):
        tier.get(victim)
    for i, key in enumerate(others):
        assert tier.get(key) == h.kv_bytes(3000 + i, seed=i)
    assert tier.check_integrity() == [] and stats.admission.in_transit_objects == 0


@pytest.mark.parametrize("reader", ["get_into", "get_many_into"])
def test_bit_flip_in_a_late_chunk_fails_get_into(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path, reader: str
) -> None:
    """The fused copy+verify of get_into covers the last chunk too; nothing bad is returned."""
    tier = tier_factory()
    victim, other = h.make_key(0), h.make_key(1)
    payload = h.kv_bytes(3 * VERIFY_CHUNK + 5000, seed=77)
    tier.put(victim, payload)
    tier.put(other, h.kv_bytes(3000, seed=1))
    tier.close()
    data = tmp_path / "disk" / "data.mdb"
    h.flip_bit(data, h.find_once(data, payload[:64]) + 3 * VERIFY_CHUNK + 4000, bit=6)

    tier = tier_factory()
    out = np.empty(len(payload), np.uint8)
    with pytest.raises(CorruptEntry) as err:
        if reader == "get_into":
            tier.get_into(victim, out)
        else:
            tier.get_many_into([other, victim], [np.empty(3000, np.uint8), out])
    assert err.value.reason == "payload_checksum"
    assert (tier.stats().corruption, tier.quarantine_count()) == (1, 1)
    assert tier.stats().admission.in_transit_objects == 0
    with pytest.raises(NotOnDisk):
        tier.get_into(victim, out)
    assert tier.get(other) == h.kv_bytes(3000, seed=1)


def _payload_start(h: Any, data: Path, payload: bytes, where: str) -> int:
    """File offset of the record's stored payload, found by its known bytes."""
    if where != "zstd_payload":
        return int(h.find_once(data, payload[:64]))
    return int(h.find_once(data, ZSTD_MAGIC))  # the only compressed record in the file


def _quarantine_reasons(tier: DiskTier) -> list[str]:
    with tier._store.read() as txn, txn.cursor(db=tier._store.dbs["quarantine"]) as cur:
        return [bytes(value).split(b"\0", 1)[0].decode() for value in cur.iternext(keys=False)]


def _stored_header(tier: DiskTier, key: DiskKey) -> bytes:
    with tier._store.read() as txn:
        found = tier._catalog.record(txn, key.to_bytes())
        assert found is not None
        return bytes(found[0])


def _flip_every_copy(data: Path, header: bytes, field: int, bit: int) -> None:
    """Flip one bit of ``header`` wherever it occurs in the file: the live leaf page and any
    stale copy-on-write copies (flipping those is harmless; missing the live one is not)."""
    raw = bytearray(data.read_bytes())
    start = raw.find(header)
    assert start >= 0, "the header must be in the file"
    while start >= 0:
        raw[start + field] ^= 1 << bit
        start = raw.find(header, start + 1)
    data.write_bytes(bytes(raw))


def test_scan_quarantines_corrupt_records(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path
) -> None:
    tier = tier_factory()
    payloads = {h.make_key(i): h.kv_bytes(8000, seed=i) for i in range(20)}
    for key, payload in payloads.items():
        tier.put(key, payload)
    tier.close()
    data = tmp_path / "disk" / "data.mdb"
    h.flip_bit(data, h.find_once(data, payloads[h.make_key(7)][:64]) + 100)
    tier = tier_factory()
    assert len(list(tier.scan())) == 20  # headers only: the payload flip is not seen
    assert len(list(tier.scan(verify=True))) == 19
    assert tier.stats().corruption == 1 and not tier.contains(h.make_key(7))


WRITER = """
import sys
import numpy as np
from hkv_service.core.admission import AdmissionCap
from storage import DiskKey, DiskTier
tier = DiskTier(sys.argv[1], 1 << 30, AdmissionCap())
for i in range(100000):
    payload = np.random.default_rng(i).bytes(int(sys.argv[2]))
    tier.put(DiskKey(i.to_bytes(16, "big"), "g", "TAIL", 1), payload)
    print(i, flush=True)
"""


@pytest.mark.parametrize("acks_before_kill", [5, 23])
def test_kill_9_mid_write_storm_keeps_every_acknowledged_entry(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path, acks_before_kill: int
) -> None:
    size = 300_000
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "disk"), str(size)],
                            stdout=subprocess.PIPE, text=True, env=h.child_env())
    assert proc.stdout is not None
    acked = [int(proc.stdout.readline()) for _ in range(acks_before_kill)]
    time.sleep(0.002 * acks_before_kill)  # land the kill at varying points of a put
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    acked += [int(line) for line in proc.stdout.read().split()]  # printed before the kill
    tier = tier_factory(budget=1 << 30)
    for i in acked:
        assert tier.get(h.make_key(i, "TAIL", "g", 1)) == _writer_payload(i, size)
    found = [int.from_bytes(m.key.block_hash, "big") for m in tier.scan(verify=True)]
    assert set(acked) <= set(found) <= set(range(max(acked) + 2))  # one put may have committed
    assert tier.stats().corruption == 0 and tier.check_integrity() == []


WRITER_MANY = """
import sys
import numpy as np
from hkv_service.core.admission import AdmissionCap
from storage import DiskKey, DiskTier
tier = DiskTier(sys.argv[1], 1 << 30, AdmissionCap(max_objects=4))  # write batches of 2
size, per_call = int(sys.argv[2]), 6  # each put_many: 3 batches, pipelined on the helper
for call in range(100000):
    ids = range(call * per_call, (call + 1) * per_call)
    tier.put_many([(DiskKey(i.to_bytes(16, "big"), "g", "TAIL", 1),
                    np.random.default_rng(i).bytes(size)) for i in ids])
    print(call, flush=True)
"""


@pytest.mark.parametrize("acks_before_kill", [2, 7])
def test_kill_9_mid_pipelined_put_many_keeps_every_acknowledged_call(
    tier_factory: Callable[..., DiskTier], h: Any, tmp_path: Path, acks_before_kill: int
) -> None:
    """A kill while one batch syncs and the next is encoding beside it: every object of an
    acknowledged call is intact; of the call in flight, only whole committed batches."""
    size, per_call = 200_000, 6
    proc = subprocess.Popen([sys.executable, "-c", WRITER_MANY, str(tmp_path / "disk"),
                             str(size)], stdout=subprocess.PIPE, text=True, env=h.child_env())
    assert proc.stdout is not None
    calls = [int(proc.stdout.readline()) for _ in range(acks_before_kill)]
    time.sleep(0.003 * acks_before_kill)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    calls += [int(line) for line in proc.stdout.read().split()]
    acked = {i for c in calls for i in range(c * per_call, (c + 1) * per_call)}
    tier = tier_factory(budget=1 << 30)
    for i in sorted(acked):
        assert tier.get(h.make_key(i, "TAIL", "g", 1)) == _writer_payload(i, size)
    found = {int.from_bytes(m.key.block_hash, "big") for m in tier.scan(verify=True)}
    in_flight = set(range((max(calls) + 1) * per_call, (max(calls) + 2) * per_call))
    assert acked <= found <= acked | in_flight
    extra = sorted(found - acked)  # whole batches of 2, in order, from the call's start
    assert extra == sorted(in_flight)[: len(extra)] and len(extra) % 2 == 0
    assert tier.stats().corruption == 0 and tier.check_integrity() == []


def _writer_payload(i: int, size: int) -> bytes:
    import numpy as np

    return np.random.default_rng(i).bytes(size)


def test_map_full_is_disk_full_and_rolls_back(
    tier_factory: Callable[..., DiskTier], h: Any
) -> None:
    tier = tier_factory(map_size_initial=256 << 10, map_size_max=1 << 20)
    acked = []
    with pytest.raises(DiskFull, match="map is full"):
        for i in range(100):
            tier.put(h.make_key(i), h.kv_bytes(64 << 10, seed=i))
            acked.append(i)
    assert 4 <= len(acked) < 16 and tier.stats().map_size == 1 << 20  # grew, then stopped
    batch = [(h.make_key(1000 + i), h.kv_bytes(64 << 10)) for i in range(3)]
    with pytest.raises(DiskFull):
        tier.put_many(batch)
    assert not any(tier.contains(k) for k, _ in batch)  # nothing half-committed
    assert tier.check_integrity() == [] and tier.gate.stats().in_transit_objects == 0
    for i in acked:
        assert tier.get(h.make_key(i)) == h.kv_bytes(64 << 10, seed=i)
    for i in acked[:3]:
        tier.delete(h.make_key(i))
    tier.put(h.make_key(500), h.kv_bytes(64 << 10))  # usable again once space is freed
    assert tier.get(h.make_key(500)) == h.kv_bytes(64 << 10)


FSIZE_CHILD = """
import json, resource, signal, sys
import numpy as np
from hkv_service.core.admission import AdmissionCap
from storage import DiskFull, DiskKey, DiskTier
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a server does this too: get EFBIG, not killed
resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, resource.RLIM_INFINITY))
tier = DiskTier(sys.argv[1], 1 << 30, AdmissionCap())
key = lambda i: DiskKey(i.to_bytes(16, "big"), "g", "SWA", 1)
data = lambda i: np.random.default_rng(i).bytes(256 << 10)
acked, error = [], None
try:
    for i in range(64):
        tier.put(key(i), data(i))
        acked.append(i)
except DiskFull as exc:
    error = str(exc)
intact = all(tier.get(key(i)) == data(i) for i in acked)
in_transit = tier.gate.stats().in_transit_objects
for i in acked[:4]:
    tier.delete(key(i))
tier.put(key(999), data(999))
print(json.dumps({"acked": len(acked), "error": error, "intact": intact,
                  "in_transit": in_transit, "after_free": tier.get(key(999)) == data(999),
                  "integrity": tier.check_integrity()}))
"""


def test_file_size_limit_is_disk_full_not_a_crash(h: Any, tmp_path: Path) -> None:
    done = h.run_child(FSIZE_CHILD, str(tmp_path / "disk"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert 2 <= out["acked"] < 12 and "disk write failed" in out["error"]
    assert out["intact"] and out["in_transit"] == 0 and out["after_free"]
    assert out["integrity"] == []
