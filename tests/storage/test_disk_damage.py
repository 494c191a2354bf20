"""A damaged disk tier starts cold; it never crashes, wedges or serves wrong bytes.

Damage to the LMDB environment itself (a truncated data file, garbage over B-tree pages) is
found at open, or by the first transaction that meets it while running: the environment is
moved aside to ``<dir>/set-aside/<stamp>-damaged/`` (with a REASON file), counted in
``TierStats.damaged_envs`` and replaced by an empty one. Damage to one index entry (a bit of
any field) fails that entry's checksum: the record is quarantined and counted, the byte
accounting is derived from verified entries only, and the tier keeps evicting and deleting.

Each scenario that could crash the interpreter (SIGBUS on a mapped page past the end of a
truncated file) runs in a child process, whose exit status the test checks.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
import lmdb_pages
import numpy as np
import pytest

from hkv_service.core.api import AdmissionCap
from storage import CorruptEntry, DiskKey, DiskTier, NotOnDisk, lmdb_store
from storage.envprobe import ChildWalk
from storage.lmdb_store import DB_NAMES
from storage.record import HEADER

RECORDS = 120
TESTS_DIR = str(Path(__file__).resolve().parent)

COMMON = """
import json, sys
import numpy as np
from hkv_service.core.admission import AdmissionCap
from storage import CorruptEntry, DiskKey, DiskTier, NotOnDisk, StorageFailure

def key(i):
    return DiskKey(i.to_bytes(16, "big"), "g", "SWA", 7)

def payload(i):
    return np.random.default_rng(i).bytes((500, 3000, 70000, 300000)[i % 4])

def served(tier):
    '''(records served, of which wrong) over a verified scan, each read back by get.'''
    good = wrong = 0
    for meta in tier.scan(verify=True):
        i = int.from_bytes(meta.key.block_hash, "big")
        try:
            got = tier.get(meta.key)
        except (NotOnDisk, CorruptEntry):
            continue
        good += 1
        wrong += got != payload(i)
    return good, wrong

def afterwards(tier, path):
    '''The tier works after the damage, and so does a fresh one on the same directory.'''
    tier.put(key(10**6), b"after the damage")
    ok = tier.get(key(10**6)) == b"after the damage"
    integrity = tier.check_integrity()
    tier.close()
    again = DiskTier(path, 64 << 20, AdmissionCap())
    ok = ok and again.get(key(10**6)) == b"after the damage"
    clean = getattr(again.stats(), "damaged_envs", None) == 0
    again.close()
    return {"ok": ok, "integrity": integrity, "reopened_clean": clean}
"""

OPEN_CHILD = COMMON + """
path = sys.argv[1]
tier = DiskTier(path, 64 << 20, AdmissionCap())
stats = tier.stats()
good, wrong = served(tier)
out = {"entries": stats.entries, "damaged": getattr(stats, "damaged_envs", None),
       "corruption": tier.stats().corruption, "served": good, "wrong": wrong}
out.update(afterwards(tier, path))
print(json.dumps(out))
"""

RUNTIME_CHILD = COMMON + """
sys.path.insert(0, sys.argv[3])
import lmdb_pages
from pathlib import Path
path, op = sys.argv[1], sys.argv[2]
tier = DiskTier(path, 64 << 20, AdmissionCap())
assert tier.get(key(1)) == payload(1)
data = Path(path) / "data.mdb"
lmdb_pages.garble_page(data, lmdb_pages.db_root(data.read_bytes(), b"index"), 5, True)
result = None
if op == "get":
    try:
        tier.get(key(1))
        result = "served"
    except CorruptEntry as exc:
        result = exc.reason
elif op == "get_many":
    try:
        tier.get_many([key(1), key(2)], wait_s=1.0)
        result = "served"
    except CorruptEntry as exc:
        result = exc.reason
elif op == "contains":
    result = tier.contains(key(1))
elif op == "scan":
    result = len(list(tier.scan()))
elif op == "put":
    result = tier.put(key(5000), b"written through the damage").raw_len
elif op == "delete":
    result = tier.delete(key(1))
stats = tier.stats()
out = {"result": result, "damaged": getattr(stats, "damaged_envs", None),
       "entries": stats.entries}
out.update(afterwards(tier, path))
print(json.dumps(out))
"""


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).bytes((500, 3000, 70000, 300000)[i % 4])


def _key(i: int) -> DiskKey:
    return DiskKey(i.to_bytes(16, "big"), "g", "SWA", 7)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed tier of RECORDS records (B-trees two levels deep, some pages freed)."""
    path = tmp_path_factory.mktemp("pristine") / "disk"
    with DiskTier(path, 64 << 20, AdmissionCap()) as tier:
        for i in range(RECORDS):
            tier.put(_key(i), _payload(i))
        for i in range(0, RECORDS, 7):
            tier.delete(_key(i))
    return path


@pytest.fixture
def damaged_copy(pristine: Path, tmp_path: Path) -> Iterator[Path]:
    copy = tmp_path / "disk"
    shutil.copytree(pristine, copy)
    yield copy


def _run(h: Any, script: str, *args: str) -> dict[str, Any]:
    done = h.run_child(script, *args, timeout=120)
    assert done.returncode == 0, f"child died ({done.returncode}): {done.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _set_aside(path: Path) -> list[Path]:
    root = path / "set-aside"
    return sorted(root.iterdir()) if root.is_dir() else []


def _assert_started_cold(out: dict[str, Any], path: Path) -> None:
    assert out["damaged"] == 1, out
    assert (out["entries"], out["served"], out["wrong"]) == (0, 0, 0), out
    assert out["ok"] and out["integrity"] == [] and out["reopened_clean"], out
    aside = _set_aside(path)
    assert len(aside) == 1 and aside[0].name.endswith("-damaged"), aside
    assert (aside[0] / "data.mdb").is_file() and (aside[0] / "REASON").read_text().strip()


# -- damage to the environment, found at open -----------------------------------------------


@pytest.mark.parametrize("fraction", [0.99, 0.5, 0.01, 0.0])
def test_truncated_data_file_starts_cold(damaged_copy: Path, h: Any, fraction: float) -> None:
    data = damaged_copy / "data.mdb"
    size = int(data.stat().st_size * fraction)
    with data.open("r+b") as f:
        f.truncate(size)
    out = _run(h, OPEN_CHILD, str(damaged_copy))
    _assert_started_cold(out, damaged_copy)
    kept = _set_aside(damaged_copy)[0]
    assert (kept / "data.mdb").stat().st_size == size  # moved aside as found
    assert "truncated" in (kept / "REASON").read_text() or size < 8192


@pytest.mark.parametrize("tree", ["main", "index", "records", "lru", "meta"])
def test_garbage_over_a_btree_root_starts_cold(damaged_copy: Path, h: Any, tree: str) -> None:
    """The root page keeps its header (LMDB still takes it for a branch or leaf page) and
    holds garbage: the open's validation pass meets it before any record is served."""
    data = damaged_copy / "data.mdb"
    raw = data.read_bytes()
    root = (lmdb_pages.meta(raw).main_root if tree == "main"
            else lmdb_pages.db_root(raw, tree.encode()))
    lmdb_pages.garble_page(data, root, seed=11, keep_header=True)
    _assert_started_cold(_run(h, OPEN_CHILD, str(damaged_copy)), damaged_copy)


# Stands for a kind of damage the page check does not know: LMDB's walk in the child is then
# the one that meets it.
WITHOUT_PAGE_CHECK = ("import storage.lmdb_store\n"
                      "storage.lmdb_store.tree_problem = lambda data: None\n")


@pytest.mark.parametrize("page_check", [True, False], ids=["page-check", "child-only"])
def test_a_page_that_crashes_lmdbs_walk_starts_cold(damaged_copy: Path, h: Any,
                                                    page_check: bool) -> None:
    """A branch entry naming its own page: LMDB's cursor takes it for the next leaf and fails
    its assertion IS_LEAF(mp), which aborts the process (issue 35: the shard crash-looped).
    The page check finds it without LMDB; past the page check, the walk in a child process
    meets it and dies of it. Either way the tier starts cold."""
    data = damaged_copy / "data.mdb"
    root = lmdb_pages.db_root(data.read_bytes(), b"records")
    lmdb_pages.repoint_child(data, b"records", 1, root)
    script = OPEN_CHILD if page_check else WITHOUT_PAGE_CHECK + OPEN_CHILD
    _assert_started_cold(_run(h, script, str(damaged_copy)), damaged_copy)
    reason = (_set_aside(damaged_copy)[0] / "REASON").read_text()
    if page_check:
        assert "page" in reason and "SIGABRT" not in reason, reason
    else:
        assert "SIGABRT" in reason and "IS_LEAF" in reason, reason


WRITES_CHILD = COMMON + """
path = sys.argv[1]
tier = DiskTier(path, 64 << 20, AdmissionCap())
damaged = tier.stats().damaged_envs
for r in range(5):  # enough writes to reuse the pages the free list names
    tier.put_many([(key(5000 + 40 * r + j), payload(5000 + 40 * r + j)) for j in range(40)])
    for i in range(r, 120, 9):
        tier.delete(key(i))
out = {"damaged": damaged, "damaged_end": tier.stats().damaged_envs,
       "integrity": tier.check_integrity()}
tier.close()
again = DiskTier(path, 64 << 20, AdmissionCap())
out["kept"] = all(again.get(key(i)) == payload(i) for i in range(5000, 5200))
out["integrity_again"] = again.check_integrity()
again.close()
print(json.dumps(out))
"""


def _free_db_garbage(data: Path) -> None:
    lmdb_pages.garble_page(data, lmdb_pages.meta(data.read_bytes()).free_root, 3, True)


def _free_page_in_use(data: Path) -> None:
    raw = data.read_bytes()
    with data.open("r+b") as f:
        f.seek(lmdb_pages.free_list_at(raw))
        f.write(struct.pack("<Q", lmdb_pages.db_root(raw, b"index")))


@pytest.mark.parametrize("damage", [_free_db_garbage, _free_page_in_use],
                         ids=["garbage", "page-in-use"])
def test_damage_to_the_free_page_list_starts_cold(damaged_copy: Path, h: Any,
                                                  damage: Callable[[Path], None]) -> None:
    """LMDB's free-page DB (its list of reusable pages) is read by writes only, and no LMDB
    walk reaches it. Garbage over it was met by the first write: here as an error (the tier
    reset itself mid-run), on a 3,000-record tier as SIGBUS, at every restart. A free page
    that the index still used was handed to a write, which overwrote the index: records put
    after the open were gone at the next one. The page check finds both before LMDB opens
    the file: the tier starts cold, and what it is given afterwards it keeps."""
    damage(damaged_copy / "data.mdb")
    out = _run(h, WRITES_CHILD, str(damaged_copy))
    assert out["damaged"] == out["damaged_end"] == 1, out
    assert out["kept"] and out["integrity"] == out["integrity_again"] == [], out
    reason = (_set_aside(damaged_copy)[0] / "REASON").read_text()
    assert "free-page" in reason or "used twice" in reason, reason


@pytest.mark.parametrize("seed", range(8))
def test_random_garbage_pages_never_crash_or_serve_wrong_bytes(
    damaged_copy: Path, h: Any, seed: int
) -> None:
    """Garbage over random B-tree and data pages: the tier either starts cold (the damage
    counted) or quarantines what fails verification; it never raises, crashes or serves
    bytes other than those put."""
    data = damaged_copy / "data.mdb"
    raw = data.read_bytes()
    rng = np.random.default_rng(seed)
    tree = lmdb_pages.tree_pages(raw)
    pages = list(rng.choice(tree, size=4, replace=False))
    pages += list(rng.integers(2, lmdb_pages.meta(raw).last_pg + 1, size=4))
    for n, pgno in enumerate(pages):
        lmdb_pages.garble_page(data, int(pgno), seed=seed * 100 + n, keep_header=n % 2 == 0)
    out = _run(h, OPEN_CHILD, str(damaged_copy))
    assert out["wrong"] == 0 and out["ok"] and out["integrity"] == [], out
    assert out["reopened_clean"], out
    lost = RECORDS - len(range(0, RECORDS, 7)) - out["served"]
    assert lost == 0 or out["damaged"] == 1 or out["corruption"] >= 1, out


@pytest.mark.parametrize("child_walk", [True, False], ids=["child", "no-child"])
@pytest.mark.parametrize("tree", ["records", "index", "lru"])
def test_a_key_out_of_order_in_its_page_sets_the_environment_aside(
    damaged_copy: Path, h: Any, tree: str, child_walk: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bit flipped in a key leaves it out of order in its leaf page: a cursor walks it, a
    binary search misses it (and may miss its neighbours). Reads stayed right, but the
    repair at open deletes by key, missed it, and left the records, index and lru holding
    different key sets (issue 35, after heavy damage). Such a tree cannot be repaired by
    key: it is set aside like a page of garbage, and check_integrity holds. The child's walk
    finds it (a key walked that a lookup misses); without the child (it could not run), the
    repair finds it (a delete that misses a key the audit walked)."""
    if not child_walk:
        monkeypatch.setattr(lmdb_store, "walk_in_child",
                            lambda path: ChildWalk(False, 0.0, error="OSError", text="test"))
    data = damaged_copy / "data.mdb"
    at = lmdb_pages.key_offset(data.read_bytes(), tree.encode(), _key(30).to_bytes())
    h.flip_bit(data, at, 7)  # the first byte's top bit (a key's or an lru tick's): now last
    with DiskTier(damaged_copy, 64 << 20, AdmissionCap()) as tier:
        assert tier.check_integrity() == []
        assert tier.stats().damaged_envs == 1
        for i in range(RECORDS):
            with contextlib.suppress(NotOnDisk, CorruptEntry):
                assert tier.get(_key(i)) == _payload(i)
    assert [p.name.endswith("-damaged") for p in _set_aside(damaged_copy)] == [True]


# -- damage met by a transaction while the tier runs ------------------------------------


@pytest.mark.parametrize("op", ["get", "get_many", "contains", "scan", "put", "delete"])
def test_damage_found_while_running_restarts_cold(damaged_copy: Path, h: Any, op: str) -> None:
    """Garbage over the index root of an open tier. The operation that meets it gets no
    LMDB error: a read is a miss (CorruptEntry, reason env_damaged), a put lands in the
    fresh environment; the damaged one is moved aside and counted."""
    out = _run(h, RUNTIME_CHILD, str(damaged_copy), op, TESTS_DIR)
    expected: dict[str, Any] = {"get": "env_damaged", "get_many": "env_damaged",
                                "contains": False, "scan": 0,
                                "put": len(b"written through the damage"), "delete": False}
    assert out["result"] == expected[op], out
    assert out["damaged"] == 1 and out["entries"] == (op == "put"), out
    assert out["ok"] and out["integrity"] == [] and out["reopened_clean"], out
    assert len(_set_aside(damaged_copy)) == 1


CONCURRENT_CHILD = COMMON + """
import random, threading, time
sys.path.insert(0, sys.argv[2])
import lmdb_pages
from pathlib import Path
path = sys.argv[1]
tier = DiskTier(path, 64 << 20, AdmissionCap())
stop, pause, idle, problems, wrong = (threading.Event(), threading.Event(),
                                      threading.Event(), [], [])

def reader(seed):
    rnd = random.Random(seed)
    while not stop.is_set():
        i = rnd.randrange(120)
        try:
            if rnd.random() < 0.5:
                wrong.extend(i for got in [tier.get(key(i))] if got != payload(i))
            elif rnd.random() < 0.5:
                tier.contains(key(i))
                list(tier.scan())
            else:
                got = tier.get_many([key(i), key(i + 1)], wait_s=0.5)
                wrong.extend(i for j, g in enumerate(got) if g != payload(i + j))
        except (NotOnDisk, CorruptEntry):
            pass
        except Exception as exc:
            problems.append(repr(exc))

def writer():
    j = 0
    while not stop.is_set():
        if pause.is_set():  # no commit moves the index root while it is being garbled
            idle.set()
            time.sleep(0.001)
            continue
        j += 1
        try:
            tier.put(key(2000 + j % 50), payload(2000 + j % 50))
            tier.delete(key(2000 + (j + 25) % 50))
        except Exception as exc:
            problems.append(repr(exc))

threads = [threading.Thread(target=reader, args=(n,)) for n in range(4)]
threads.append(threading.Thread(target=writer))
for t in threads:
    t.start()
time.sleep(0.3)
pause.set()
idle.wait()
data = Path(path) / "data.mdb"
lmdb_pages.garble_page(data, lmdb_pages.db_root(data.read_bytes(), b"index"), 5, True)
pause.clear()
time.sleep(0.7)
stop.set()
for t in threads:
    t.join(20)
out = {"hung": sum(t.is_alive() for t in threads), "problems": problems[:5],
       "wrong": len(wrong), "damaged": tier.stats().damaged_envs}
out.update(afterwards(tier, path))
print(json.dumps(out))
"""


def test_damage_met_by_concurrent_readers_and_a_writer_resets_once(
    damaged_copy: Path, h: Any
) -> None:
    """Readers and a writer race over the damage: the environment is set aside once, no
    thread hangs or sees an LMDB error, no wrong bytes are served, and the tier goes on."""
    out = _run(h, CONCURRENT_CHILD, str(damaged_copy), TESTS_DIR)
    assert out["hung"] == 0 and out["problems"] == [] and out["wrong"] == 0, out
    assert out["damaged"] == 1 and len(_set_aside(damaged_copy)) == 1, out
    assert out["ok"] and out["integrity"] == [] and out["reopened_clean"], out


# -- damage to one index entry ------------------------------------------------------------

SMALL = 2000
SMALL_COUNT = 8


def _small(i: int) -> bytes:
    return np.random.default_rng(1000 + i).bytes(SMALL)


def _budget() -> int:
    return SMALL_COUNT * (HEADER.size + SMALL)


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SMALL_COUNT records filling the budget exactly, so every new put evicts."""
    path = tmp_path_factory.mktemp("small") / "disk"
    with DiskTier(path, _budget(), AdmissionCap()) as tier:
        for i in range(SMALL_COUNT):
            tier.put(_key(i), _small(i))
        tier.get(_key(0))  # a last-use note, folded into the index at close
    return path


def _rewrite(path: Path, db_name: str, edit: Callable[[lmdb.Transaction, Any], None]) -> None:
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES))
    with env.begin(write=True) as txn:
        edit(txn, env.open_db(db_name.encode(), txn=txn))
    env.close()


def _index_entry(path: Path, key: DiskKey) -> bytes:
    env = lmdb.open(str(path), max_dbs=len(DB_NAMES), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(key.to_bytes(), db=env.open_db(b"index", txn=txn))
    env.close()
    assert value is not None
    return bytes(value)


def _flip_entry(path: Path, key: DiskKey, offset: int) -> None:
    def edit(txn: lmdb.Transaction, db: Any) -> None:
        value = bytearray(txn.get(key.to_bytes(), db=db))
        value[offset] ^= 1 << (offset % 8)
        txn.put(key.to_bytes(), bytes(value), db=db)

    _rewrite(path, "index", edit)


def _keeps_working(tier: DiskTier, victim: DiskKey, lost: set[DiskKey]) -> None:
    """Deletes, evictions and new puts work; the accounting matches what is stored."""
    assert not tier.delete(victim)
    assert tier.delete(_key(5))
    new = [DiskKey((500 + j).to_bytes(16, "big"), "g", "SWA", 7) for j in range(SMALL_COUNT + 3)]
    tier.put(new[0], _small(500))  # evicts the oldest record
    tier.put_many([(key, _small(500 + j)) for j, key in enumerate(new) if j])  # and the rest
    assert tier.check_integrity() == []
    metas = list(tier.scan(verify=True))
    assert {m.key for m in metas} == set(new[-SMALL_COUNT:])
    assert tier.stats().bytes_used == sum(m.record_bytes for m in metas) <= _budget()
    assert all(tier.get(m.key) == _small(500 + new.index(m.key)) for m in metas)
    assert not lost & {m.key for m in metas}


@pytest.mark.timeout(120)
def test_a_bit_flipped_in_any_index_entry_field_is_detected(small_store: Path,
                                                            tmp_path: Path) -> None:
    """Every byte of the victim's index entry (last use, sizes, the header, the checksum),
    one bit each: the entry fails verification and is quarantined and counted; deletes,
    evictions and new puts keep working and the byte counter stays exact."""
    victim = _key(3)
    failures: dict[int, str] = {}
    for offset in range(len(_index_entry(small_store, victim))):
        copy = tmp_path / f"flip{offset}"
        shutil.copytree(small_store, copy)
        _flip_entry(copy, victim, offset)
        try:
            with DiskTier(copy, _budget(), AdmissionCap()) as tier:
                with pytest.raises((CorruptEntry, NotOnDisk)):
                    tier.get(victim)
                stats = tier.stats()
                assert (stats.corruption, stats.quarantined) == (1, 1), stats
                assert not tier.contains(victim)
                for i in set(range(SMALL_COUNT)) - {3}:
                    assert tier.get(_key(i)) == _small(i)
                _keeps_working(tier, victim, {victim})
        except (Exception, pytest.fail.Exception) as exc:
            failures[offset] = f"{type(exc).__name__}: {exc}"[:200]
        shutil.rmtree(copy)
    assert failures == {}, failures


def test_a_damaged_lru_entry_or_byte_counter_is_rebuilt_at_open(small_store: Path,
                                                                tmp_path: Path) -> None:
    """The lru order and the byte counter are derived from the verified index entries: a
    flipped lru key or counter is rebuilt at open, never trusted."""
    lru_copy, used_copy = tmp_path / "lru", tmp_path / "used"
    shutil.copytree(small_store, lru_copy)
    shutil.copytree(small_store, used_copy)

    def flip_lru(txn: lmdb.Transaction, db: Any) -> None:
        with txn.cursor(db=db) as cur:
            assert cur.first()
            old = bytes(cur.key())
        txn.delete(old, db=db)
        txn.put(bytes([old[0] ^ 0x80]) + old[1:-1] + bytes([old[-1] ^ 1]), b"", db=db)

    def shrink_counter(txn: lmdb.Transaction, db: Any) -> None:
        txn.put(b"used_bytes", struct.pack("<Q", 1), db=db)

    _rewrite(lru_copy, "lru", flip_lru)
    _rewrite(used_copy, "meta", shrink_counter)
    for path in (lru_copy, used_copy):
        with DiskTier(path, _budget(), AdmissionCap()) as tier:
            assert tier.check_integrity() == []
            assert all(tier.get(_key(i)) == _small(i) for i in range(SMALL_COUNT))
            _keeps_working(tier, DiskKey(b"\xff" * 16, "g", "SWA", 7), set())
