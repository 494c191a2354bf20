"""Named faults for the demo: parse ``--faults``, roll them with a seeded RNG, count them.

Each fault makes the bytes really wrong (zeros, old bytes, a flipped bit, a freed block) so a
funnel that wrongly reported a hit would produce a silent error. ``EXPECTED`` names the
downgrade (funnel reason or read-time outcome) each fault must produce.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hkv_service.core.states import Reason

__all__ = [
    "DEFAULT_RATES", "EXPECTED", "FaultPlan", "FaultSpecError", "flip_on_disk", "parse_faults",
]

DEFAULT_RATES: dict[str, float] = {
    "evict_race": 0.15,  # evict a matched block between lookup and read (reader has no lease)
    "partial_tail": 0.25,  # a writer stalls: its tail is left TAIL_PARTIAL, rest zeros
    "stale_indexer": 0.2,  # indexer keys are old bytes and never re-synced to the KV version
    "slow_disk_load": 0.5,  # a disk load is left in flight (ON_DISK_INFLIGHT) for a while
    "disk_bitflip": 0.2,  # flip one bit of an object's bytes in the LMDB file
    "shard_kill": 0.04,  # the shard holding a matched block dies between lookup and read
    "service_restart": 0.04,  # the metadata view is rebuilt from the owners' reports
    "pool_pressure": 1.0,  # tiny block pools: constant eviction and spill to disk
    "abi_mismatch": 0.08,  # a reader whose kernel ABI differs
    "misaligned_handle": 0.1,  # a writer places blocks on a shard with 64-byte alignment
}

# What each fault must show up as: a funnel downgrade reason or a read-time outcome
# (``fallbacks``), or for pool pressure, evictions (``transitions`` *:EVICTED).
EXPECTED: dict[str, str] = {
    "evict_race": Reason.STALE_HANDLE.value,
    "partial_tail": Reason.TAIL_INCOMPLETE.value,
    "stale_indexer": Reason.INDEXER_STALE.value,
    "slow_disk_load": Reason.DISK_INFLIGHT.value,
    "disk_bitflip": Reason.CORRUPT.value,
    "shard_kill": Reason.OWNER_LOST.value,
    "service_restart": Reason.STALE_HANDLE.value,
    "pool_pressure": "EVICTED",
    "abi_mismatch": Reason.ABI_MISMATCH.value,
    "misaligned_handle": Reason.MISALIGNED.value,
}


class FaultSpecError(ValueError):
    """A ``--faults`` value that names an unknown fault or a bad rate."""


def parse_faults(text: str | None) -> dict[str, float]:
    """'none' | 'all' | 'name[=rate],...' -> {name: rate}. Raises FaultSpecError."""
    text = (text or "none").strip()
    if text in ("", "none"):
        return {}
    if text == "all":
        return dict(DEFAULT_RATES)
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, rate_text = part.strip().partition("=")
        name = name.strip()
        if name == "all":
            out.update(DEFAULT_RATES)
            continue
        if name not in DEFAULT_RATES:
            raise FaultSpecError(
                f"unknown fault {name!r}; choose from {', '.join(sorted(DEFAULT_RATES))}, "
                "'all' or 'none'"
            )
        try:
            rate = float(rate_text) if rate_text else DEFAULT_RATES[name]
        except ValueError:
            raise FaultSpecError(f"fault rate {rate_text!r} of {name!r} is not a number") from None
        if not 0.0 <= rate <= 1.0:
            raise FaultSpecError(f"fault rate of {name!r} must lie in [0, 1], got {rate}")
        out[name] = rate
    return out


@dataclass
class FaultPlan:
    """Which faults are on, at what rate; a seeded, thread-safe roll; counts of injections."""

    rates: dict[str, float]
    seed: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed * 7919 + 17)

    def on(self, name: str) -> bool:
        return self.rates.get(name, 0.0) > 0.0

    def roll(self, name: str) -> bool:
        rate = self.rates.get(name, 0.0)
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def choice(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.injected[name] += n


def flip_on_disk(data_dir: str | os.PathLike[str], head: bytes) -> int:
    """Flip one bit 100 bytes past every copy of ``head`` (a payload's first bytes) in the LMDB
    data files under ``data_dir`` (old pages may hold copies too); returns how many. The page
    cache is shared, so a shard that has the file mapped sees the flip at once: its checksum
    must catch it. Fault injection for the demo and tests."""
    n = 0
    for target in sorted(Path(data_dir).rglob("data.mdb")):
        fd = os.open(target, os.O_RDWR)
        try:
            with mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ) as mm:
                spots, at = [], mm.find(head)
                while at >= 0:
                    spots.append(at)
                    at = mm.find(head, at + 1)
            for at in spots:
                byte = os.pread(fd, 1, at + 100)
                os.pwrite(fd, bytes([byte[0] ^ (1 << 3)]), at + 100)
                n += 1
        finally:
            os.close(fd)
    return n
