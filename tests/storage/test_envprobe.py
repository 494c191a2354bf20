"""The walk of an LMDB environment in a child process (``storage.envprobe`` and ``envwalk``):
what it reports for a sound environment, one that crashes LMDB, one with a key out of order,
and a child that cannot run; and how the store reads each report
(``lmdb_store._walk_damage``)."""

from __future__ import annotations

import logging
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import lmdb_pages
import pytest

from hkv_service.core.admission import AdmissionCap
from storage import DiskKey, DiskTier
from storage.envprobe import ChildWalk, walk_in_child
from storage.lmdb_store import _walk_damage


def _key(i: int) -> DiskKey:
    return DiskKey(i.to_bytes(16, "big"), "g", "SWA", 7)


@pytest.fixture(scope="module")
def sound(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A closed tier whose records tree is two levels deep (a branch root over leaves)."""
    path = tmp_path_factory.mktemp("probe") / "disk"
    with DiskTier(path, 64 << 20, AdmissionCap()) as tier:
        tier.put_many([(_key(i), bytes([i % 251]) * (300 + 7 * i)) for i in range(200)])
    return path


@pytest.fixture
def copy(sound: Path, tmp_path: Path) -> Path:
    shutil.copytree(sound, tmp_path / "disk")
    return tmp_path / "disk"


def test_a_sound_environment_walks_clean(copy: Path) -> None:
    walk = walk_in_child(copy)
    assert walk.clean and walk.started, walk
    assert _walk_damage(walk, copy) is None


def test_a_crash_in_the_walk_ends_the_child_and_names_the_signal(copy: Path) -> None:
    """A branch entry naming its own page: LMDB's cursor moves to it as a leaf's sibling and
    fails its assertion IS_LEAF(mp), which aborts the process that runs it."""
    data = copy / "data.mdb"
    root = lmdb_pages.db_root(data.read_bytes(), b"records")
    lmdb_pages.repoint_child(data, b"records", 1, root)
    walk = walk_in_child(copy)
    assert walk.started and walk.signal == signal.SIGABRT, walk
    reason = _walk_damage(walk, copy)
    assert reason is not None and "SIGABRT" in reason and "IS_LEAF" in reason, reason


def test_a_key_out_of_order_is_damage(copy: Path, h: Any) -> None:
    data = copy / "data.mdb"
    at = lmdb_pages.key_offset(data.read_bytes(), b"index", _key(100).to_bytes())
    h.flip_bit(data, at, 7)
    walk = walk_in_child(copy)
    assert walk.damage is not None and "out of order" in walk.damage, walk
    assert _walk_damage(walk, copy) == walk.describe()


def test_a_child_that_cannot_start_says_nothing_about_the_environment(
    copy: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No interpreter to run: the walk did not start, so it shows no damage; the store opens
    in-process as it did before there was a child, and says so."""
    monkeypatch.setattr(sys, "executable", str(copy / "no-such-python"))
    walk = walk_in_child(copy)
    assert not walk.started and walk.error is not None, walk
    with caplog.at_level(logging.WARNING, logger="storage.lmdb_store"):
        assert _walk_damage(walk, copy) is None
    assert "could not walk" in caplog.text


@pytest.mark.parametrize(
    ("walk", "damaged"),
    [
        (ChildWalk(True, 1.0, signal=int(signal.SIGBUS)), True),
        (ChildWalk(False, 1.0, signal=int(signal.SIGKILL)), False),  # killed before it walked
        (ChildWalk(True, 60.0, timed_out=True), True),
        (ChildWalk(True, 1.0, error="CorruptedError", text="Located page was wrong type"), True),
        (ChildWalk(True, 1.0, error="PageNotFoundError", text="page not found"), True),
        (ChildWalk(True, 1.0, error="ReadersFullError", text="no reader slot"), False),
        (ChildWalk(True, 1.0, error="ChildFailed", text="exit status 1"), False),
    ],
)
def test_which_endings_are_damage(walk: ChildWalk, damaged: bool, tmp_path: Path) -> None:
    """A child that died or stalled while walking, or met an LMDB damage error, shows damage;
    one killed before it walked, or failing for another reason, shows none (the in-process
    open then meets the same error and reports it as it always did)."""
    assert (_walk_damage(walk, tmp_path) is not None) is damaged
