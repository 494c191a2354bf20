"""Named faults for the demo: parse ``--faults``, schedule and roll them, count them.

Each fault makes the bytes really wrong (zeros, old bytes, a flipped bit, a freed block) so a
funnel that wrongly reported a hit would produce a silent error. ``EXPECTED`` names the
downgrade (funnel reason or read-time outcome) each fault must produce.

Every requested fault lands at least once a run, then the rest are drawn at the rates. A fault
can only be injected where it has an opportunity (``OPPORTUNITY``: a disk bit flip needs a
request that loads a disk copy, a shard kill a lookup that matched something ...). Each has a
turn, a request drawn (seeded) from the first half of the run; from the moment the run reaches
it the fault is *owed*, and every opportunity injects it (no draw) until one lands; after that,
one draw at its rate per opportunity. So a requested fault is missing from a run only when no
opportunity came after its turn; the report names it in ``faults_missing`` with what it needed
(a run of 2 requests has evicted nothing: no disk load, no disk bit flip). A disk bit flip
owed, or a slow disk load still owed in the run's last quarter (``overdue``), makes its own:
the worker pushes a matched block to disk so the next lookup loads it.
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
    "DEFAULT_RATES", "EXPECTED", "OPPORTUNITY", "FaultPlan", "FaultSpecError", "flip_on_disk",
    "parse_faults",
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
    # a writer hands over the recurrent state of one boundary earlier for a boundary
    "state_off_boundary": 0.15,
    "state_dtype": 0.15,  # a writer hands over a recurrent state held in float16
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
    # refused at the write (workers.checkpoints): the reader finds no state there
    "state_off_boundary": Reason.NO_STATE_AT_BOUNDARY.value,
    "state_dtype": Reason.NO_STATE_AT_BOUNDARY.value,
}


# Where each fault can be injected (worker.py rolls it there, and counts it once it landed).
OPPORTUNITY: dict[str, str] = {
    "evict_race": "a lookup without a lease that matched a memory block",
    "partial_tail": "a write-back of a new tail at the prompt's last resume point",
    "stale_indexer": "a write-back of a new indexer block",
    "slow_disk_load": "a lookup whose match loads a disk copy",
    "disk_bitflip": "a lookup whose match loads a disk copy of a compressed or sliding-window "
                    "block",
    "shard_kill": "a lookup that matched something",
    "service_restart": "a lookup that matched something",
    "pool_pressure": "the run itself (its pools are small from the start)",
    "abi_mismatch": "a request with a prefix that is safe to reuse",
    "misaligned_handle": "a write-back of new blocks",
    "state_off_boundary": "a write-back of a new recurrent state",
    "state_dtype": "a write-back of a new recurrent state",
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
    """Which faults are on, at what rate, and each one's turn (see the module); a seeded,
    thread-safe roll; counts of injections. ``requests``: the run's length (turns fall in
    its first half; 0: every fault owed from the start)."""

    rates: dict[str, float]
    seed: int = 0
    requests: int = 0
    injected: Counter[str] = field(default_factory=Counter)
    turn: dict[str, int] = field(init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _rng: random.Random = field(init=False)
    _started: int = field(init=False, default=0)  # requests started: the run's clock

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed * 7919 + 17)
        turns = random.Random(self.seed * 7919 + 29)  # apart: the draws do not move the turns
        span = max(1, self.requests // 2)
        self.turn = {name: turns.randrange(span) for name in sorted(self.rates)
                     if self.rates[name] > 0.0}

    def on(self, name: str) -> bool:
        return self.rates.get(name, 0.0) > 0.0

    def start(self) -> None:
        """A request starts (the clock the turns are on)."""
        with self._lock:
            self._started += 1

    def owed(self, name: str) -> bool:
        """``name`` is on, its turn has come, and it has not landed yet."""
        with self._lock:
            return self._owed_after(name, 0)

    def overdue(self, name: str) -> bool:
        """``name`` is owed and the run is in its last quarter: rather than wait for an
        opportunity that may not come (a disk load needs an eviction first), the worker makes
        one. Only from the last quarter, so a run where the fault lands by itself is unchanged."""
        with self._lock:
            return self._owed_after(name, self.requests * 3 // 4)

    def roll(self, name: str) -> bool:
        """Inject ``name`` at this opportunity? Yes while it is owed; else a draw at its rate."""
        rate = self.rates.get(name, 0.0)
        if rate <= 0.0:
            return False
        with self._lock:
            return self._owed_after(name, 0) or self._rng.random() < rate

    def _owed_after(self, name: str, started: int) -> bool:
        """(Under the lock.) ``name`` is on, not landed, and the run is past its turn and
        past ``started`` requests: the one rule of owing."""
        return (self.rates.get(name, 0.0) > 0.0 and not self.injected[name]
                and self._started > max(self.turn[name], started))

    def choice(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.injected[name] += n

    def missing(self) -> list[str]:
        """Requested faults not injected (so far)."""
        with self._lock:
            return sorted(name for name in self.turn if not self.injected[name])

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
