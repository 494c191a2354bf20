"""storage/lmdb_store.py: sync mode, map growth, error translation, fork safety."""

from __future__ import annotations

import os
from pathlib import Path

import lmdb
import pytest

from hkv_service.core.api import AdmissionCap
from storage import DiskFull, DiskKey, DiskTier, StorageFailure
from storage.lmdb_store import DB_NAMES, DiskStore, StoreConfig, translate
from storage.record import FORMAT_VERSION


def test_opens_with_durable_sync_mode_and_sub_databases(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, StoreConfig())
    flags = store.env.flags()
    assert flags["sync"] and flags["metasync"] and not flags["writemap"] and flags["lock"]
    assert set(store.dbs) == set(DB_NAMES) and store.stale_readers_cleared == 0
    assert store.env.max_readers() == StoreConfig().max_readers
    store.close()


def test_map_grows_on_map_full_and_retries(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, StoreConfig(map_size_initial=128 << 10, map_size_max=8 << 20))
    db = store.dbs["records"]
    for i in range(8):
        store.write(lambda txn, i=i: txn.put(b"%d" % i, os.urandom(256 << 10), db=db),
                    need_bytes=256 << 10)
    assert 128 << 10 < store.map_size <= 8 << 20
    with store.read() as txn:
        assert txn.stat(db)["entries"] == 8
    store.close()


def test_map_full_at_max_is_disk_full_and_leaves_nothing(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, StoreConfig(map_size_initial=256 << 10, map_size_max=512 << 10))
    db = store.dbs["records"]

    def too_big(txn: lmdb.Transaction) -> None:
        txn.put(b"a", b"small", db=db)
        txn.put(b"b", os.urandom(1 << 20), db=db)

    with pytest.raises(DiskFull, match="map is full"):
        store.write(too_big, need_bytes=1 << 20)
    with store.read() as txn:
        assert txn.get(b"a", db=db) is None  # the whole transaction rolled back
    store.write(lambda txn: txn.put(b"a", b"ok", db=db))  # env still usable
    store.close()


def test_lmdb_errors_are_translated_in_one_place() -> None:
    with pytest.raises(DiskFull, match="rolled back"), translate(writing=True):
        raise lmdb.Error("mdb_txn_commit: No space left on device")
    with pytest.raises(StorageFailure), translate(writing=False):
        raise lmdb.Error("mdb_txn_commit: No space left on device")
    with pytest.raises(StorageFailure), translate(writing=True):
        raise lmdb.BadTxnError("mdb_txn_begin: bad transaction")
    with pytest.raises(lmdb.MapFullError), translate(writing=True):
        raise lmdb.MapFullError("full")


def test_forked_child_refuses_the_parents_env(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, StoreConfig())
    pid = os.fork()
    if pid == 0:  # child: must not touch the inherited environment
        try:
            with store.read():
                os._exit(1)
        except StorageFailure:
            store.close()  # a no-op in the child
            os._exit(0)
        os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with store.read() as txn:  # the parent's env is unharmed
        assert txn.stat(store.dbs["records"])["entries"] == 0
    store.close()


# -- record format: a store written in another format is set aside unread, never misread ----


@pytest.mark.parametrize(("old_format", "headers_db"), [(1, False), (2, False), (2, True)])
def test_a_store_from_another_record_format_is_set_aside_unread(
    tmp_path: Path, old_format: int, headers_db: bool
) -> None:
    """Format 1 kept the header inside the record value, format 2 left three index fields
    unsealed (early on, with a "headers" sub-database of its own); read as format 3 their
    records would all fail verification. Opening moves the store aside as found (its objects
    can be recomputed) and starts cold, instead of refusing to start the node."""
    path = tmp_path / "disk"
    DiskTier(path, 1 << 20, AdmissionCap()).close()  # stamps the current format
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES) + 1)
    with env.begin(write=True) as txn:
        if headers_db:
            txn.put(b"k" * 30, b"HKVR\x02", db=env.open_db(b"headers", txn=txn))
        meta = env.open_db(b"meta", txn=txn)
        records = env.open_db(b"records", txn=txn)
        assert txn.get(b"format", db=meta) == bytes([FORMAT_VERSION])
        if old_format == 1:
            txn.delete(b"format", db=meta)  # as a format-1 store: records, no stamp
        else:
            txn.put(b"format", bytes([old_format]), db=meta)
        txn.put(b"k" * 30, b"HKVR\x01" + bytes(100), db=records)
    env.close()
    with DiskTier(path, 1 << 20, AdmissionCap()) as tier:
        stats = tier.stats()
        assert (stats.retired_envs, stats.damaged_envs, stats.entries) == (1, 0, 0)
        tier.put(DiskKey(b"\x01" * 16, "g", "SWA", 1), b"format 3")
    (aside,) = (path / "set-aside").iterdir()
    assert aside.name.endswith("-retired")
    assert f"format {old_format}; this version reads format 3" in (aside / "REASON").read_text()
    env = lmdb.open(str(aside), max_dbs=len(DB_NAMES), readonly=True, lock=False)
    with env.begin() as txn:  # kept as found
        assert txn.get(b"k" * 30, db=env.open_db(b"records", txn=txn)) is not None
    env.close()
    with DiskTier(path, 1 << 20, AdmissionCap()) as tier:  # the fresh store is stamped
        assert tier.get(DiskKey(b"\x01" * 16, "g", "SWA", 1)) == b"format 3"
        assert tier.stats().retired_envs == 0


def test_a_new_store_is_stamped_and_reopens(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    with DiskTier(path, 1 << 20, AdmissionCap()) as tier:
        tier.put(DiskKey(b"\x01" * 16, "g", "SWA", 1), b"bytes")
    with DiskTier(path, 1 << 20, AdmissionCap()) as tier:
        assert tier.get(DiskKey(b"\x01" * 16, "g", "SWA", 1)) == b"bytes"
