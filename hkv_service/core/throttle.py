"""At most one log line per kind of occurrence per interval; the rest held back and counted.

Why: a flood of one failure (a fuzzer, a client speaking another protocol) must not flood the
log. 2,700 fuzzed calls wrote 909 WARNING lines, one per undecodable request (issue 35, item
8). A line per interval says the same, and the next line says how many were held back.

The throttle only decides; the caller logs, and counts every occurrence where its counters are
(a counter is exact, a log line a sample). Pure: the caller's clock (monotonic seconds, e.g.
``CacheState.clock``), so a test steps time instead of waiting for it. Thread-safe.

Timeline of one key, interval I::

    t0          first occurrence: Pass(held_back=0), logged; next line not before t0 + I
    [t0, t0+I)  occurrences held back, counted
    t >= t0+I   next occurrence: Pass(held_back=n), logged; next line not before t + I
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from .errors import InvalidInput

__all__ = ["Pass", "Throttle"]


@dataclass(frozen=True, slots=True)
class Pass:
    """Log this occurrence; ``held_back`` occurrences of its key were not logged since the
    key's last line."""

    held_back: int


class Throttle:
    """One :class:`Pass` per key per ``interval_s`` of ``clock``; :meth:`note` counts the rest."""

    def __init__(self, interval_s: float, clock: Callable[[], float]) -> None:
        if not interval_s >= 0:  # NaN too
            raise InvalidInput(f"a throttle interval must be >= 0 s, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next: dict[Hashable, float] = {}  # key -> earliest time of its next line
        self._held: dict[Hashable, int] = {}  # key -> occurrences held back since its last line

    def note(self, key: Hashable) -> Pass | None:
        """One occurrence of ``key``: a Pass when it is to be logged, None when held back."""
        now = self._clock()
        with self._lock:
            if now < self._next.get(key, -math.inf):
                self._held[key] = self._held.get(key, 0) + 1
                return None
            self._next[key] = now + self.interval_s
            return Pass(self._held.pop(key, 0))

    def held_back(self, key: Hashable) -> int:
        """Occurrences of ``key`` held back since its last line (the next line will say)."""
        with self._lock:
            return self._held.get(key, 0)
