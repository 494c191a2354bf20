"""A router's question: how many tokens of this prompt can hkv certify for resuming, per tier,
and why does it stop there (issue 39).

The answer is the connector's (``connectors/scheduler.py`` probes with the same lookup): the
funnel's usable tokens, never a raw block count. Two tiers::

    tokens          resumable counting disk loads (a disk copy at rest is loaded first)
    memory_tokens   resumable from memory alone (no load): <= tokens

    [0, memory_tokens)   every object in a shard's memory
    [0, tokens)          every object in memory or in the disk tier
    [tokens, prompt)     recomputed: ``stop`` says why (the reason of the downgrade there,
                         NOT_CACHED where no hash matched, WHOLE_PROMPT if none is left)

Cost: one lookup with handles, no lease, when nothing needs a load (every answer served from
memory); otherwise a binary search over resume points (multiples of the LCM block) for the
longest one that needs no load, one lookup each (log2 of the prompt's LCM blocks). A
resume point found so is certified (its own lookup said so) even where readiness is not
monotone in the position (sliding windows): the search may miss a longer one, never
report one that is not.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .funnel import Downgrade, LookupRequest
from .ids import BlockHash
from .layout import Layout
from .match import Match
from .states import Reason

__all__ = ["Resumable", "Stop", "resumable"]

Lookup = Callable[[LookupRequest], Match]


class Stop(enum.StrEnum):
    WHOLE_PROMPT = "WHOLE_PROMPT"  # nothing is left to recompute
    NOT_CACHED = "NOT_CACHED"  # the prompt's next block was never stored (or is gone)
    DOWNGRADED = "DOWNGRADED"  # a funnel layer cut it back: ``reason`` says which
    NEEDS_LOAD = "NEEDS_LOAD"  # memory tier: the next resume point needs a disk load


@dataclass(frozen=True, slots=True)
class Resumable:
    prompt_tokens: int  # tokens the hashes cover
    tokens: int  # resumable, disk loads included
    memory_tokens: int  # resumable with no load
    stop: Stop  # why ``tokens`` ends where it does
    reason: Reason | None  # the funnel's reason when ``stop`` is DOWNGRADED
    memory_stop: Stop  # why ``memory_tokens`` ends where it does
    downgrades: tuple[Downgrade, ...]
    lookups: int  # lookups it took (its cost)


def resumable(lookup: Lookup, hashes: Sequence[BlockHash], layout: Layout,
              reader_abi: Mapping[str, int] | None = None) -> Resumable:
    """The router's answer for the prompt of ``hashes`` (from block 0), through ``lookup``
    (``CacheState.lookup``, a client's, a partitioned client's: any port answers alike)."""
    prompt = len(hashes) * layout.hash_block
    first = lookup(LookupRequest(hashes, None, reader_abi))
    stop, reason = _why(first, prompt)
    memory, memory_stop, n = first.usable_tokens, stop, 1
    if _needs_load(first):
        memory, n = _longest_without_load(lookup, hashes, layout.lcm, first.usable_tokens,
                                          reader_abi)
        memory_stop, n = Stop.NEEDS_LOAD, n + 1
    return Resumable(prompt, first.usable_tokens, memory, stop, reason, memory_stop,
                     first.downgrades, n)


def _needs_load(m: Match) -> bool:
    """``m.needs_load`` read off the packed columns (that one builds a Handle per object)."""
    return any(len(col) and int(col.array["block"].min()) < 0 for col in m.columns.values())


def _why(m: Match, prompt: int) -> tuple[Stop, Reason | None]:
    usable = m.usable_tokens
    if usable >= prompt:
        return Stop.WHOLE_PROMPT, None
    at = [d for d in m.downgrades if d.position >= usable]
    if at:
        return Stop.DOWNGRADED, min(at, key=lambda d: d.position).reason
    return Stop.NOT_CACHED, None


def _longest_without_load(lookup: Lookup, hashes: Sequence[BlockHash], lcm: int, hi: int,
                          abi: Mapping[str, int] | None) -> tuple[int, int]:
    """(the longest usable resume point found that needs no load, lookups made)."""
    lo, top = 0, hi // lcm - 1  # k LCM blocks, k < hi/lcm (at hi itself a load is needed)
    best = n = 0
    while lo < top:
        mid = (lo + top + 1) // 2
        m = lookup(LookupRequest(hashes, mid * lcm, abi))
        n += 1
        if _needs_load(m):
            top = mid - 1
        else:
            best, lo = max(best, m.usable_tokens), mid
    return best, n
