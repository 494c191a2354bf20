"""Helpers shared by test modules in several folders (``from tests.helpers import ...``):
child processes (their environment, their output read on a thread, a free port) and the
reports an owner would make of a state view's objects. Fixtures live in the conftest.py files.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

from hkv_service.core.api import ObjectReport
from hkv_service.core.state_view import CacheState

__all__ = ["ROOT", "Lines", "child_env", "free_port", "reports_of", "up_env"]

ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process running this tree's code, output unbuffered."""
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT)) | extra


def up_env(**extra: str) -> dict[str, str]:
    """A child that runs ``hkv up`` (or Ray): Ray's shutdown drain off, no inherited Ray
    address (the child starts or names its own cluster)."""
    env = child_env(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    env.pop("RAY_ADDRESS", None)
    return env | extra


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the moment it is asked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Lines:
    """A child's merged stdout/stderr, read on a thread (a full pipe would block it);
    :meth:`wait` for the first line holding ``ready``."""

    def __init__(self, proc: subprocess.Popen[str], ready: str) -> None:
        self.proc, self.lines, self.ready_line = proc, [], ""
        self._ready = ready
        self.event = threading.Event()
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    lines: list[str]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if not self.ready_line and self._ready in line:
                self.ready_line = line.strip()
                self.event.set()
        self.event.set()

    def wait(self, timeout_s: float) -> str:
        self.event.wait(timeout_s)
        assert self.ready_line, f"not ready within {timeout_s:.0f}s:\n{self.text()}"
        return self.ready_line

    def text(self) -> str:
        return "\n".join(self.lines[-80:])


def reports_of(st: CacheState, *, ordered: bool = False) -> list[ObjectReport]:
    """What an owner would report of every object of ``st`` (``ordered``: by depth, column
    and hash, deterministic; else in the object table's order)."""
    out = [
        ObjectReport(r.entry.block_hash, r.entry.parent.block_hash if r.entry.parent else None,
                     r.entry.depth, st.layout.columns[r.column].name, r.state, r.block,
                     r.generation, r.version, r.lo, r.hi)
        for r in st.objects.values()
    ]
    return sorted(out, key=lambda r: (r.depth, r.column, r.block_hash)) if ordered else out
