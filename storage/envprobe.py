"""Walk an LMDB environment with LMDB itself in a child process, before this process opens it.

Why: LMDB maps ``data.mdb`` and trusts every page it reaches. Garbage in a page makes it read
past the file's end (SIGBUS) or fail one of its assertions (SIGABRT: ``IS_LEAF(mp)`` in
``mdb_cursor_next``); either kills the process, and a shard whose disk tier dies in its
constructor dies again at every restart. A child process can die instead: it opens the
environment read-only, walks every tree and looks every key up (:mod:`storage.envwalk`, which
imports nothing of hkv and opens the environment itself: one inherited across ``fork`` is
unusable, see RELIABILITY.md). Only if it ends cleanly does the caller open the environment
in-process, and then without walking it again.

A key the walk meets that its lookup does not find is damage too: a bit flipped in a key
leaves it out of order in its page, where a binary search misses it and may miss its
neighbours. Such a tree reads right but cannot be repaired: a delete by key misses the very
entries the repair must remove (after one, the records, index and lru held different keys).

:func:`walk_in_child` reads the child's ending back as a :class:`ChildWalk`; which endings
mean damage is the caller's to decide (:func:`storage.lmdb_store._walk_damage`).

Cost: the child starts without ``site`` (tens of milliseconds) and walks the tree pages, not
the overflow pages of large values (LMDB's cursor only points at them), so it grows with the
number of records more than with their bytes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

from . import envwalk
from .envwalk import STARTED

__all__ = ["ChildWalk", "timeout_for", "walk_in_child"]

# The walk is linear in the tree pages (a few percent of the file); a child that is still
# walking after this long is stuck in garbage, or on a disk too slow to serve the tier.
TIMEOUT_BASE_S = 60.0
TIMEOUT_PER_GIB_S = 60.0


@dataclass(frozen=True, slots=True)
class ChildWalk:
    """How the child's walk ended.

    ``started``: it had imported lmdb and was opening the environment (a child that never
    got there says nothing about the environment). ``signal``: the signal that killed it.
    ``damage``: what the walk itself found wrong (a key it walked that a lookup does not
    find). ``error``, ``text``: the LMDB error it met (its class name in ``lmdb``), or a
    failure to run at all. ``timed_out``: killed after ``seconds``. ``detail``: its last
    stderr line (an LMDB assertion names itself there). Clean: started, finished, nothing
    found.
    """

    started: bool
    seconds: float
    signal: int | None = None
    damage: str | None = None
    error: str | None = None
    text: str = ""
    timed_out: bool = False
    detail: str = ""

    @property
    def clean(self) -> bool:
        return self.started and (self.signal, self.damage, self.error) == (None, None, None) \
            and not self.timed_out

    def describe(self) -> str:
        """Why the walk did not end cleanly, for a REASON file."""
        how = f" ({self.detail})" if self.detail else ""
        if self.signal is not None:
            return (f"an LMDB walk of the environment in a child process was killed by "
                    f"{_signal_name(self.signal)}{how}")
        if self.damage is not None:
            return f"an LMDB walk of the environment in a child process found {self.damage}"
        if self.timed_out:
            return f"an LMDB walk of the environment in a child process did not end within " \
                   f"{self.seconds:.0f} s"
        return f"an LMDB walk of the environment in a child process met {self.error}: " \
               f"{self.text}{how}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def timeout_for(data: Path) -> float:
    size = data.stat().st_size if data.exists() else 0
    return TIMEOUT_BASE_S + TIMEOUT_PER_GIB_S * size / (1 << 30)


def walk_in_child(path: Path, timeout_s: float | None = None) -> ChildWalk:
    """Walk the environment in directory ``path`` in a fresh interpreter; never raises for
    what the child meets. ``timeout_s`` defaults to :func:`timeout_for` its data file."""
    limit = timeout_for(path / "data.mdb") if timeout_s is None else timeout_s
    command = [sys.executable, "-I", "-S", str(Path(envwalk.__file__).resolve()),
               str(Path(lmdb.__file__).resolve().parent.parent), str(path)]
    start = _now()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit,
                              check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # run() has killed and reaped it
        return ChildWalk(_said_started(exc.stdout), limit, timed_out=True)
    except OSError as exc:  # no process at all (no memory, no interpreter)
        return ChildWalk(False, _now() - start, error=type(exc).__name__, text=str(exc))
    return _verdict(done, _now() - start)


def _now() -> float:
    return time.monotonic()


def _said_started(stdout: str | bytes | None) -> bool:
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    return STARTED in text.splitlines()[:1]


def _verdict(done: subprocess.CompletedProcess[str], seconds: float) -> ChildWalk:
    lines = done.stdout.splitlines()
    started = lines[:1] == [STARTED]
    detail = (done.stderr.strip().splitlines() or [""])[-1][:300]
    if done.returncode < 0:
        return ChildWalk(started, seconds, signal=-done.returncode, detail=detail)
    try:
        report = json.loads(lines[-1]) if started and len(lines) > 1 else None
    except ValueError:
        report = None
    if done.returncode != 0 or not isinstance(report, dict):
        return ChildWalk(started, seconds, error="ChildFailed",
                         text=f"exit status {done.returncode}", detail=detail)
    error, damage = report.get("error"), report.get("damage")
    return ChildWalk(started, seconds, damage=None if damage is None else str(damage),
                     error=None if error is None else str(error), text=str(report.get("text", "")))
