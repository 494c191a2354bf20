"""A child process that ends with its parent, however the parent ends (SIGKILL included).

The parent keeps the write end of a pipe and never writes; the child gets the read end (its
number in ``HKV_PARENT_FD``) and watches it on a thread. The kernel closes a process's
descriptors when it dies, so the read returns EOF once every holder of the write end is
gone: the child then stops the way a SIGTERM stops it (drain, grace), with a hard exit past
that as a backstop::

    parent: spawn_tied(argv)  --pipe-->  child: watch_parent(stop, backstop_s)
    parent dies (any way)  ->  EOF  ->  stop()  ->  os._exit(1) after backstop_s

Why a pipe and not ``prctl(PR_SET_PDEATHSIG)``: the death signal fires when the *thread*
that forked the child exits, not the process. ``hkv demo`` restarts ``hkv serve`` from a
worker thread that ends before the demo does, so the service would be killed under a live
demo; and setting it needs a ``preexec_fn`` (unsafe in a parent running Ray's and gRPC's
threads) or a ``getppid()`` re-check racing the parent's death. A pipe has no such race (a
parent already dead is EOF at the first read), and the child drains instead of dying mid-RPC.
The write end is non-inheritable (PEP 446), so only a ``fork()`` without exec could hold it
open longer, and nothing here forks that way.

The write end belongs to the child's ``Popen`` object: it is closed when that object is
collected (``weakref.finalize``) or by :func:`let_go`, after which the child stops too.

Processes the parent caused but did not fork (a local Ray's, forked by Ray's raylet) cannot
watch it themselves: :func:`reap_when_gone` starts a watcher that ends exactly those (pid and
start time) once the parent is gone. Run as ``python -m hkv_service.lifeline`` it is that
watcher (stdlib only: it idles at a few MiB).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ENV", "end_processes", "let_go", "proc_start", "proc_stat", "reap_when_gone",
           "spawn_tied", "watch_parent"]

ENV = "HKV_PARENT_FD"
log = logging.getLogger(__name__)
_Child = subprocess.Popen[Any]
# each child's write end, closed by a finalizer when its Popen object goes
_held: weakref.WeakKeyDictionary[_Child, weakref.finalize[[int], _Child]] = \
    weakref.WeakKeyDictionary()


def spawn_tied(argv: Sequence[str], env: Mapping[str, str], **popen: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(argv, env=env, **popen)`` whose child can watch this process
    (:func:`watch_parent`); this process keeps the pipe's write end while the object lives."""
    read_fd, write_fd = os.pipe()
    try:
        proc: subprocess.Popen[Any] = subprocess.Popen(
            argv, env={**env, ENV: str(read_fd)}, pass_fds=(read_fd,), **popen)
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)  # the child's now: EOF must depend only on the write end
    _held[proc] = weakref.finalize(proc, os.close, write_fd)
    return proc


def let_go(proc: subprocess.Popen[Any]) -> None:
    """Close ``proc``'s write end now (it stopped, or must): its watcher sees EOF."""
    done = _held.pop(proc, None)
    if done is not None:
        done()


def watch_parent(stop: Callable[[], None], backstop_s: float) -> bool:
    """If this process was started by :func:`spawn_tied`, call ``stop`` once the parent is
    gone and exit (1) ``backstop_s`` later if still running. False when there is nothing to
    watch (started otherwise; a descriptor that is no pipe is ignored, with a warning)."""
    fd = _parent_fd()
    if fd is None:
        return False

    def watch() -> None:
        _until_eof(fd)
        log.warning("parent process gone: stopping (hard exit in %.0f s)", backstop_s)
        stop()
        time.sleep(backstop_s)
        log.error("still running %.0f s after the parent died: exiting", backstop_s)
        os._exit(1)

    threading.Thread(target=watch, name="hkv-parent-watch", daemon=True).start()
    return True


def _parent_fd() -> int | None:
    raw = os.environ.pop(ENV, None)  # not for this process's own children
    if raw is None:
        return None
    try:
        fd = int(raw)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            raise OSError(f"descriptor {fd} is not a pipe")
        os.set_inheritable(fd, False)
    except (ValueError, OSError) as exc:
        log.warning("%s=%r: not watching the parent (%s)", ENV, raw, exc)
        return None
    return fd


def _until_eof(fd: int) -> None:
    """Block until every holder of the pipe's write end is gone (or the pipe fails)."""
    while True:
        try:
            if not os.read(fd, 1):
                return
        except InterruptedError:
            continue
        except OSError:
            return


# -- what a parent started without being their parent (a local Ray's processes) -------------

Procs = Mapping[int, int]  # pid -> start time: one process for good (a reused pid differs)


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from ``/proc/<pid>/stat`` (fields 4 and
    22); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw.rsplit(b")", 1)[1].split()  # the name in (...) may hold spaces
    return None if fields[0] in (b"Z", b"X") else (int(fields[1]), int(fields[19]))


def proc_start(pid: int) -> int | None:
    """``pid``'s start time; None if it is gone or a zombie."""
    st = proc_stat(pid)
    return None if st is None else st[1]


def end_processes(procs: Procs, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for ``procs`` to exit; SIGKILL those still running."""
    deadline = time.monotonic() + timeout_s
    left = [p for p, start in procs.items() if proc_start(p) == start]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if proc_start(p) == procs[p]]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def reap_when_gone(procs: Procs, grace_s: float = 1.0) -> subprocess.Popen[Any]:
    """A small process tied to this one (:func:`spawn_tied`) that, once this process is gone
    however it ended, ends ``procs`` (those still running ``grace_s`` later). Ours to start
    and not our children: a local Ray's agents outlived a SIGKILLed ``hkv up`` by ~60 s (they
    report the raylet's death to a GCS that died with it, until that times out)."""
    argv = [sys.executable, "-m", "hkv_service.lifeline", f"{grace_s:g}",
            *(f"{p}:{t}" for p, t in procs.items())]
    return spawn_tied(argv, os.environ, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                      start_new_session=True)  # (not in a terminal's Ctrl-C group: it waits)


def _reaper(args: Sequence[str]) -> int:
    fd = _parent_fd()
    if fd is None:
        return 2
    grace_s = float(args[0])
    procs = {int(p): int(t) for p, _, t in (a.partition(":") for a in args[1:])}
    _until_eof(fd)
    end_processes(procs, grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(_reaper(sys.argv[1:]))
