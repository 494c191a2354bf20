"""Helpers shared by test modules in several folders (``from tests.helpers import ...``):
child processes (their environment, their output read on a thread, a free port) and the
reports an owner would make of a state view's objects. Fixtures live in the conftest.py files.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

from hkv_service.core.api import ObjectReport
from hkv_service.core.state_view import CacheState
from hkv_service.lifeline import proc_stat

__all__ = ["ROOT", "Lines", "Procs", "child_env", "descendants", "free_port", "kill_procs",
           "reports_of", "survivors", "up_env"]

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
    """A TCP port that nothing is bound to on any address (at the moment it is asked), from
    below the kernel's ephemeral range and above Ray's worker ports (10002-19999): a port the
    kernel handed out here could be handed to another process (a Ray starting meanwhile)
    before the test's server binds it (a fresh-clone CI: "Address already in use")."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, low) if low > 20001 else 0
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free TCP port below the ephemeral range")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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


Procs = dict[int, int]  # pid -> its start time: one process for good (lifeline.proc_stat)


def descendants(root: int) -> Procs:
    """Every live process under ``root`` (children, theirs, ...), not ``root`` itself."""
    table = {int(p.name): st for p in Path("/proc").iterdir() if p.name.isdigit()
             if (st := proc_stat(int(p.name))) is not None}
    found: Procs = {}
    todo = [pid for pid, (ppid, _) in table.items() if ppid == root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][1]
            todo += [c for c, (ppid, _) in table.items() if ppid == pid]
    return found


def survivors(procs: Procs, timeout_s: float) -> Procs:
    """Those of ``procs`` still running (the same process: pid and start time) after waiting
    up to ``timeout_s`` for all of them to end."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {p: t for p, t in procs.items() if (st := proc_stat(p)) is not None and st[1] == t}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def kill_procs(procs: Procs) -> None:
    """SIGKILL those of ``procs`` still running (a test's own, found by :func:`descendants`)."""
    for pid in survivors(procs, 0):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def assert_sigkill_ends_its_tree(proc: subprocess.Popen[bytes], service_pid: int, tree: Procs,
                                 what: str, within_s: float) -> None:
    """SIGKILL ``proc`` (whose process tree was ``tree``, its ``hkv serve`` ``service_pid``):
    the service and every other process of the tree must end within ``within_s``."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    service = {service_pid: tree[service_pid]}
    assert survivors(service, within_s) == {}, \
        f"hkv serve (pid {service_pid}) outlived its SIGKILLed {what} by {within_s} s"
    left = survivors(tree, within_s)
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0][:60] for p in left
             if Path(f"/proc/{p}/cmdline").exists()}
    assert not names, f"processes of a SIGKILLed {what} still run: {names}"
