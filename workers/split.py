"""One chain split across metadata partitions at fixed depth ranges (core/partitions.py).

With ``range_blocks`` R > 0 range k of a chain (depths ``[kR, (k+1)R)``) lives in the
partition of its anchor, the hash at depth kR. :class:`~workers.partitioned.
PartitionedMetadata` writes and looks up such a chain range by range with these pieces:

* :func:`split_slots`: an allocate's slots grouped by range, each group with the hashes of
  its range from the range's first block (``first_block``);
* :func:`range_request`: range k's part of a lookup asked at resume point p: its hashes
  from block kR, ``open_end`` where the chain goes on past it;
* :func:`fixed_point`: the lookup's answer, exactly one process's. Each partition answers
  the largest p' <= p it accepts from its own entries alone (monotone columns ready in its
  range below p', the tail at p' if p' ends in its range, its SWA blocks meeting
  ``[p'-W, p')``): every layer-3 condition is a conjunction over entries, each entry in one
  partition. The client sets p to the least answer and asks again until every partition
  answers p; p only falls, so that ends, and ends at the largest p all of them accept;
* :func:`joined`: the final round's matches as one (columns joined in token order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from hkv_service.core.api import AllocRequest, Downgrade, HandleColumn, LookupRequest, Match
from hkv_service.core.ids import BlockHash, LeaseId
from hkv_service.core.layout import Layout
from hkv_service.core.partitions import range_anchor, ranges

__all__ = ["RangeAnswer", "fixed_point", "joined", "range_request", "split_slots"]


def split_slots(block_hashes: Sequence[BlockHash], requests: Sequence[AllocRequest],
                range_blocks: int) -> list[tuple[int, Sequence[BlockHash], list[int]]]:
    """Per range an allocate touches, in depth order: its first block, the hashes from there
    up to the deepest slot asked in it, and the indexes of its slots in ``requests``."""
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(range_anchor(r.depth, range_blocks), []).append(i)
    out = []
    for lo in sorted(groups):
        last = max(requests[i].depth for i in groups[lo])
        out.append((lo, block_hashes[lo : last + 1], groups[lo]))
    return out


@dataclass(frozen=True, slots=True)
class RangeAnswer:
    """One range's match in one round, and the partition that gave it."""

    index: int  # the range's place in the chain (0: the root's)
    partition: int
    match: Match


def range_request(req: LookupRequest, spans: Sequence[tuple[int, int]], k: int, p: int,
                  hash_block: int) -> LookupRequest:
    """Range ``k``'s part of ``req`` at resume point ``p``: its hashes from its first block;
    open-ended unless it is the chain's last range (then p never passes its end)."""
    lo, hi = spans[k]
    last = k == len(spans) - 1
    return replace(req, block_hashes=req.block_hashes[lo:hi],
                   resume_tokens=min(p, hi * hash_block) if last else p,
                   first_block=lo, open_end=not last)


Ask = Callable[[Sequence[int], int], list[RangeAnswer]]  # ranges asked at p -> their answers


def fixed_point(limit: int, layout: Layout, range_blocks: int, ask: Ask,
                release: Callable[[Sequence[RangeAnswer]], None]
                ) -> tuple[int, list[RangeAnswer], list[RangeAnswer]]:
    """The largest resume point p <= ``limit`` every range's partition accepts: ``ask(ks,
    p)`` asks ranges ``ks`` at p (a range starting at or past p needs nothing of its own, so
    it is not asked). Returns p, the final round's answers (they accept p), and the first
    round's (how far each walk got). A round that did not agree has its leases released."""
    hb = layout.hash_block
    spans = ranges(limit // hb, range_blocks)
    p = limit // layout.lcm * layout.lcm
    first: list[RangeAnswer] | None = None
    while True:
        answers = ask([k for k, (lo, _) in enumerate(spans) if lo * hb < p], p)
        if first is None:
            first = answers
        least = min((a.match.usable_tokens for a in answers), default=p)
        if least == p:
            return p, answers, first
        release(answers)
        p = least


def joined(p: int, final: Sequence[RangeAnswer], first: Sequence[RangeAnswer],
           spans: Sequence[tuple[int, int]], hash_block: int,
           lease_id: LeaseId | None) -> Match:
    """One match from the final round's (in range order): ``p``, the columns joined, the
    tokens the walk matched (up to the first range whose walk stopped inside it), and each
    downgrade reason once."""
    final = sorted(final, key=lambda a: a.index)
    names: dict[str, list[HandleColumn]] = {}
    for a in final:
        for name, col in a.match.columns.items():
            names.setdefault(name, []).append(col)
    columns: Mapping[str, HandleColumn] = {
        name: cols[0] if len(cols) == 1 else HandleColumn.concat(cols)
        for name, cols in names.items()}
    matched = 0
    for a in sorted(first, key=lambda a: a.index):
        matched = a.match.matched_tokens
        if matched < spans[a.index][1] * hash_block:
            break
    seen: set[tuple[object, object]] = set()
    downgrades: list[Downgrade] = []
    for a in (*sorted(first, key=lambda a: a.index), *final):
        for d in a.match.downgrades:
            if (d.reason, d.group) not in seen:
                seen.add((d.reason, d.group))
                downgrades.append(d)
    return Match(p, max(matched, p), tuple(downgrades), lease_id, columns, None,
                 repeatable=False)
