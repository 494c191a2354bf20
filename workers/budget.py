"""Restart budgets per time window: how ``hkv up`` tells a long life from a crash loop.

A part that dies now and then (its process killed, its node rebooted) is restarted every time,
however long ``hkv up`` lives; one that dies again and again within a short time is in a crash
loop, which restarting cannot fix and only hides. :class:`RestartBudget` allows at most
``limit`` restarts in any ``window_s`` seconds (a sliding window over the times they were
taken)::

    times taken   x        x   x                       x
                  |--------|---|---------[ window_s ]--|--> now
                  left the window: forgotten       counted: len <= limit

The caller brings the clock (``now``, monotonic seconds), so tests step time themselves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["RestartBudget"]


@dataclass(slots=True)
class RestartBudget:
    """At most ``limit`` restarts within any ``window_s`` seconds."""

    limit: int
    window_s: float
    _taken: deque[float] = field(default_factory=deque)

    def spend(self, now: float) -> bool:
        """Take one restart at ``now`` if fewer than ``limit`` were taken in the ``window_s``
        seconds up to it (the window is ``(now - window_s, now]``); False, and nothing taken,
        when the window is full: a crash loop."""
        self._forget(now)
        if len(self._taken) >= self.limit:
            return False
        self._taken.append(now)
        return True

    def used(self, now: float) -> int:
        """Restarts taken within the window up to ``now``."""
        self._forget(now)
        return len(self._taken)

    def _forget(self, now: float) -> None:
        while self._taken and self._taken[0] <= now - self.window_s:
            self._taken.popleft()
