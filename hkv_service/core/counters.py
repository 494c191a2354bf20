"""Health counters: transitions by kind and state, downgrades by reason, hit/partial/miss.

A sudden jump of one kind's transition rate is the design's signal of collapsing reuse or a bad
eviction policy; ``hkv stats`` computes rates from these monotone counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .states import Kind, Reason, State

__all__ = ["Counters"]


@dataclass(slots=True)
class Counters:
    transitions: Counter[tuple[Kind, State]] = field(default_factory=Counter)
    downgrades: Counter[Reason] = field(default_factory=Counter)
    lookups: Counter[str] = field(default_factory=Counter)  # hit / partial / miss
    evictions: Counter[Kind] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)  # stale_read, owner_lost, ...

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            "transitions": {f"{k.value}:{s.value}": n for (k, s), n in self.transitions.items()},
            "downgrades": {r.value: n for r, n in self.downgrades.items()},
            "lookups": dict(self.lookups),
            "evictions": {k.value: n for k, n in self.evictions.items()},
            "events": dict(self.events),
        }
