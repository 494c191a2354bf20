"""Heavy damage (issue 35, item 7): hundreds of random bit flips past the meta pages of a real
``data.mdb`` of thousands of records. Opening the tier on it always returns; then either the
environment was set aside, counted and replaced by an empty one, or every record it serves
reads back byte-exact and the rest are misses. Never a crash: LMDB's own walk of such pages
died with SIGBUS (a read past the end of the file) or SIGABRT (its assertion ``IS_LEAF(mp)``
in ``mdb_cursor_next``), and a shard whose tier crashes in ``__init__`` crash-loops.

Every open runs in a child process whose exit status the test checks. The fixed seeds were
found by a sweep against this file's layout (the records, their sizes and the batches they
are put in fix which page holds what; timestamps change only values): on the code before the
fix, seeds 30, 86 and 120 killed the open with SIGBUS and 61 and 143 with SIGABRT, 5 of 150.
The sweep itself runs with ``-m slow``.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import lmdb_pages
import numpy as np
import pytest

from hkv_service.core.admission import AdmissionCap
from storage import DiskKey, DiskTier

RECORDS = 3000
FLIPS = 256
BATCH = 64
CRASHED_BEFORE = {30: "SIGBUS", 61: "SIGABRT", 86: "SIGBUS", 120: "SIGBUS", 143: "SIGABRT"}
SEEDS = [*sorted(CRASHED_BEFORE), 0, 1, 2]

CHILD = """
import json, sys
import numpy as np
from hkv_service.core.admission import AdmissionCap
from storage import CorruptEntry, DiskKey, DiskTier, NotOnDisk

def key(i):
    return DiskKey(i.to_bytes(16, "big"), "g", "SWA", 7)

def payload(i):
    return np.random.default_rng(i).bytes((600, 1500, 5000, 9000)[i % 4])

path, records = sys.argv[1], int(sys.argv[2])
tier = DiskTier(path, 256 << 20, AdmissionCap())
stats = tier.stats()
served = wrong = 0
for i in range(records):
    try:
        got = tier.get(key(i))
    except (NotOnDisk, CorruptEntry):
        continue
    served += 1
    wrong += got != payload(i)
out = {"damaged": stats.damaged_envs, "entries": stats.entries, "served": served,
       "wrong": wrong, "corruption": tier.stats().corruption,
       "integrity": tier.check_integrity()}
# The tier goes on: new records are stored, and a reopen finds them and no new damage.
tier.put_many([(key(records + j), payload(records + j)) for j in range(200)])
out["damaged_end"] = tier.stats().damaged_envs
tier.close()
again = DiskTier(path, 256 << 20, AdmissionCap())
out["kept"] = all(again.get(key(records + j)) == payload(records + j) for j in range(200))
out["reopened_damaged"] = again.stats().damaged_envs
again.close()
print(json.dumps(out))
"""


def _key(i: int) -> DiskKey:
    return DiskKey(i.to_bytes(16, "big"), "g", "SWA", 7)


def _payload(i: int) -> bytes:
    return np.random.default_rng(i).bytes((600, 1500, 5000, 9000)[i % 4])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """RECORDS records (~19 MB: inline values and overflow pages), put in batches."""
    path = tmp_path_factory.mktemp("heavy") / "disk"
    with DiskTier(path, 256 << 20, AdmissionCap()) as tier:
        for start in range(0, RECORDS, BATCH):
            tier.put_many([(_key(i), _payload(i)) for i in range(start, start + BATCH)
                           if i < RECORDS])
    return path


def flip_random_bits(data: Path, seed: int, count: int) -> None:
    """Flip ``count`` seeded random bits anywhere past the two meta pages."""
    raw = bytearray(data.read_bytes())
    first = 2 * lmdb_pages.meta(bytes(raw)).psize
    rng = random.Random(seed)
    for _ in range(count):
        raw[rng.randrange(first, len(raw))] ^= 1 << rng.randrange(8)
    data.write_bytes(bytes(raw))


def _open_damaged(pristine: Path, tmp_path: Path, h: Any, seed: int) -> tuple[dict[str, Any],
                                                                                Path]:
    copy = tmp_path / "disk"
    shutil.copytree(pristine, copy)
    flip_random_bits(copy / "data.mdb", seed, FLIPS)
    done = h.run_child(CHILD, str(copy), str(RECORDS), timeout=300)
    assert done.returncode == 0, f"the open died ({done.returncode}): {done.stderr[-2000:]}"
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out, copy


def _check(out: dict[str, Any], path: Path, seed: int) -> None:
    assert out["wrong"] == 0 and out["integrity"] == [], out
    assert out["kept"] and out["reopened_damaged"] == 0, out
    if seed in CRASHED_BEFORE:  # LMDB cannot walk this file: it must not be used
        assert out["damaged"] == 1, out
    if out["damaged"]:
        assert (out["entries"], out["served"]) == (0, 0), out
    else:  # kept: what it does not serve was found bad, and counted
        assert out["served"] == RECORDS or out["corruption"] >= 1 or out["damaged_end"], out
    aside = sorted((path / "set-aside").glob("*-damaged"))  # the newest only is kept
    assert len(aside) == min(out["damaged_end"], 1), (aside, out)
    for folder in aside:
        assert (folder / "data.mdb").is_file() and (folder / "REASON").read_text().strip()


def test_garbage_over_the_free_page_db_is_found_before_any_write(
    pristine: Path, tmp_path: Path, h: Any
) -> None:
    """LMDB's free-page DB is read by writes only, and no LMDB walk reaches it: garbage over
    its root passed the open, then the first put died of SIGBUS, at every restart. The page
    check reads it at open: set aside, counted, and the writes go to the fresh tier."""
    copy = tmp_path / "disk"
    shutil.copytree(pristine, copy)
    data = copy / "data.mdb"
    lmdb_pages.garble_page(data, lmdb_pages.meta(data.read_bytes()).free_root, 7, True)
    done = h.run_child(CHILD, str(copy), str(RECORDS), timeout=300)
    assert done.returncode == 0, f"died ({done.returncode}): {done.stderr[-2000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["damaged"] == out["damaged_end"] == 1 and out["kept"], out


@pytest.mark.parametrize("seed", SEEDS)
def test_heavy_bit_flips_never_crash_the_open(pristine: Path, tmp_path: Path, h: Any,
                                              seed: int) -> None:
    out, path = _open_damaged(pristine, tmp_path, h, seed)
    _check(out, path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(150))
def test_heavy_bit_flips_sweep(pristine: Path, tmp_path: Path, h: Any, seed: int) -> None:
    out, path = _open_damaged(pristine, tmp_path, h, seed)
    _check(out, path, seed)
