"""A lane: one background thread that runs a connector side's I/O in order, off vLLM's step.

The step only hands a :class:`Task` over (``submit`` never blocks). Each task has an
``abandon`` that settles it when it cannot run: its ``run`` raised, the thread died under it,
or the lane was closed with it still queued; so every task is settled exactly once and a
request waiting on one is always reported. FIFO order matters: a request's later saves extend
its earlier ones, and a finished request's last save must land after them.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Lane", "Task", "shorten_gil_switch"]

log = logging.getLogger(__name__)


def shorten_gil_switch(interval_s: float) -> float:
    """Lower this process's GIL switch interval to ``interval_s`` (never raise it; 0: leave
    it) and return the interval in force. A lane thread that waits for the GIL while vLLM's
    engine loop runs Python gets it after at most this long, instead of Python's 5 ms: a
    lane's copy lets go of the GIL once per item. Process-wide: whoever lowered it further
    (a test, the operator) keeps theirs."""
    if 0 < interval_s < sys.getswitchinterval():
        log.info("hkv connector: GIL switch interval %.2g s -> %.2g s (gil_switch_interval_s)",
                 sys.getswitchinterval(), interval_s)
        sys.setswitchinterval(interval_s)
    return sys.getswitchinterval()


@dataclass(frozen=True, slots=True)
class Task:
    run: Callable[[], None]
    abandon: Callable[[str], None]  # why it did not run (or did not finish)


class Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: deque[Task] = deque()
        self._running: Task | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.deaths = 0  # threads that died (a BaseException out of a task)

    def submit(self, task: Task) -> None:
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                self._queue.append(task)
                self._start()
                self._cond.notify_all()
        if closed:
            task.abandon(f"lane {self.name} is closed")

    def _start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=f"hkv-{self.name}",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._running = self._queue.popleft()
            try:
                task.run()
            except Exception as exc:  # a task's own failure: settle it, keep the lane going
                log.warning("hkv %s task failed: %s", self.name, exc)
                task.abandon(f"{type(exc).__name__}: {exc}")
            except BaseException as exc:  # the thread dies: settle the task, then the rest
                task.abandon(f"the {self.name} thread died ({type(exc).__name__})")
                with self._cond:
                    self._running = None
                    self.deaths += 1
                    self._cond.notify_all()
                raise
            finally:
                with self._cond:
                    self._running = None
                    self._cond.notify_all()

    def check(self) -> int:
        """Restart a dead thread for the tasks still queued (called once per step); the
        number of deaths seen so far."""
        with self._cond:
            if self._queue and not self._closed and (
                    self._thread is None or not self._thread.is_alive()):
                self._start()
            return self.deaths

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (self._running is not None)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until every submitted task has settled; True if so."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._running is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._thread is None or not self._thread.is_alive():
                    self._start()
                self._cond.wait(min(left, 0.05))
            return True

    def close(self, timeout_s: float) -> int:
        """Drain for up to ``timeout_s``, then abandon what is still queued (the task running
        finishes on its own; the thread is a daemon). The number abandoned."""
        self.drain(timeout_s)
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for task in left:
            task.abandon(f"lane {self.name} closed with it queued")
        return len(left)
