"""The generation floor a shard registers with: block generations only grow, across service
restarts and re-registrations.

A registration gets a fresh pool twin on the service, and the twin hands blocks out at the
floor the shard registered (``PoolConfig.generation_floor``); the shard sets every block of
the registration to the floor first (kept blocks too: they are re-confirmed there). A claim
handed out before (by a service that restarted, or by this one before it declared the shard
lost) is below the floor, so the shard's pool refuses its write (an older generation), and it
can never equal a generation handed out after (so even an object id that happened to repeat
could not commit or serve another object's bytes).

A floor is ``epoch << FLOOR_BITS``: the generations of one registration are ``floor + n``,
``n`` the frees of that block under it. The epoch is above the last one this process
registered with, above every generation its pools hold, and at least the time in 10 ms
units since 2025 (a successor process after a crash starts above what its predecessor
registered, as long as the clock did not step back). Bounds: a block freed 2**24 times
(16.7M) under one registration without the shard ever seeing a write of it could reach the
next floor; epochs stay below 2**38 (the floor below ``MAX_GENERATION_FLOOR``) for ~87 years.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from hkv_service.core.inputs import MAX_GENERATION_FLOOR

__all__ = ["FLOOR_BITS", "next_floor"]

FLOOR_BITS = 24  # frees of one block one registration may hand out before the next floor
_EPOCH_BASE_NS = 1_735_689_600 * 10**9  # 2025-01-01T00:00:00Z
_EPOCH_UNIT_NS = 10**7  # 10 ms


def next_floor(previous: int, held: Iterable[int], now_ns: int | None = None) -> int:
    """The floor of the next registration: above ``previous`` (this process's last floor, 0
    before the first), above every generation in ``held`` (what the pools hold now), at least
    the clock's epoch."""
    clock = (time.time_ns() if now_ns is None else now_ns) - _EPOCH_BASE_NS
    epoch = max((previous >> FLOOR_BITS) + 1, (max(held, default=-1) >> FLOOR_BITS) + 1,
                clock // _EPOCH_UNIT_NS)
    floor = epoch << FLOOR_BITS
    if floor >= MAX_GENERATION_FLOOR:
        raise OverflowError(f"generation floor {floor} past 2**62: a clock far in the future?")
    return floor
